//! The ZeRO++ qgZ quantized reduce-scatter, `all_to_all_quant_reduce` (spec §3.2–3.3, §3.7),
//! built on [`Communicator`] collectives and the [`quant`] kernels; it falls back to
//! [`reduce_scatter_coalesced`] where qgZ does not apply.
//!
//! One file because it is one algorithm: its buffer layout, the striped pipeline and the
//! per-stripe requantization share the record format and the vocabulary below, and read best
//! together (about 770 lines with its tests).
//!
//! This module owns qgZ's buffer layout (the swizzled `[dev][node][group]` order); the host
//! groups it runs over are [`HostGroups`]. It does not move bytes itself (it calls
//! [`Communicator::reduce_scatter`] and [`Communicator::all_to_all`]), nor does it own the
//! quantization arithmetic ([`quant`] does).
//!
//! # Vocabulary
//!
//! * `W`: ranks of the communicator; `dpn`: ranks per host; `nodes = W / dpn`: hosts. Comm
//!   rank `ρ = node · dpn + dev`: hosts are contiguous runs of ranks.
//! * **partition**: the part of a tensor one rank gets back. [`reduce_scatter_coalesced`]
//!   uses ceil partitions of `c = ⌈L / W⌉` elements (shorter or empty at the end); the
//!   quantized path uses `P = N / W`, rank `ρ` getting elements `[ρ·P, (ρ+1)·P)`, which is the
//!   same partition the fallback gives when `W` divides `N`.
//! * **group**: `E` consecutive elements sharing one int4 scale; `G = N / E` groups per tensor,
//!   `gpp = G / W` per partition.
//! * **record**: the bytes one rank sends another for one tensor: the int4 codes of `m`
//!   partitions (`m · P/2` bytes) followed by their `m · gpp` f32 scales (native byte order,
//!   as every f32 payload of this library).
//!
//! # Cost (per rank)
//!
//! * [`reduce_scatter_coalesced`]: one ring reduce-scatter of `W · Σ c_t` elements: `W − 1`
//!   steps, `(W − 1) · Σ c_t` elements sent.
//! * [`all_to_all_quant_reduce`], quantized path: one all-to-all inside the host
//!   (`(dpn − 1) · Σ_t nodes · (P_t/2 + 4 · gpp_t)` bytes sent, none of it across hosts) and
//!   one across hosts (`(nodes − 1) · Σ_t (P_t/2 + 4 · gpp_t)` bytes sent), whatever the number
//!   of tensors, the one across hosts cut into `S ≤ 8` all-to-alls of stripes (`S = 1` below
//!   256 KiB of inter-host records per rank; see *Pipelining and buffers*). Against a ring
//!   reduce-scatter of f32 (`(W − 1) · 4P` bytes per rank) the cross-host traffic is about
//!   `1/8 · (1 + 8/E)` of what an optimal hierarchical f32 reduce-scatter must move across
//!   hosts, and far less than a flat ring.
//!
//! # Pipelining and buffers
//!
//! Every step works a group at a time, so a call is cut into **stripes**: stripe `s` of a
//! tensor is groups `[s·gpp/S, (s+1)·gpp/S)` of each of its partitions. Steps 3–5 run stripe by
//! stripe; a helper thread (scoped to the call) runs the inter-host all-to-all of each stripe
//! as soon as it is requantized, while this thread requantizes the next ones and then
//! dequantizes the stripes that have arrived. The arithmetic per group is the same whatever
//! `S`, so the results do not depend on it. The host sums are never stored whole: a block of
//! about 4096 elements is summed in f32 and requantized while it is in L1.
//!
//! The four all-to-all buffers are kept per thread between calls (each up to 64 MiB; larger
//! ones are freed), so a training loop does not fault them in again every step.
//!
//! # Where we differ from DeepSpeed, on purpose
//!
//! * **The result is the mean on every path.** DeepSpeed's quantized path returns
//!   `Σ_ranks / nodes`, which is `dpn ×` the mean, while its fallbacks return the mean (spec
//!   §3.3, an open "spec vs bug" question). We divide by `W` everywhere, so the quantized path
//!   and the fallback agree up to quantization error.
//! * Inputs are never modified (DeepSpeed's fast path divides its input in place) and the
//!   outputs are owned vectors, not views.
//! * Padding is zeroed (DeepSpeed leaves it uninitialised); it is never returned.
//! * qgZ reads f32, f16 and bf16 as what they are (DeepSpeed reads everything as fp16, issue
//!   #3992) and reduces in f32 (DeepSpeed in fp16).
//! * The preconditions DeepSpeed leaves unchecked (spec §3.7) are checked before anything is
//!   sent; a violation is [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument),
//!   never corrupt data. DeepSpeed's GPU kernel limits (`E ≤ 40960`, `E` a multiple of 8) do
//!   not apply to these CPU kernels; only `E` even (two int4 codes per byte) does.
//! * All tensors of one call share each all-to-all (DeepSpeed runs two per tensor per
//!   phase, one for codes and one for scales), and all fallback tensors share one
//!   [`reduce_scatter_coalesced`].
//! * With one host (`nodes == 1`) the second quantization is skipped (the intra-host f32 sums
//!   are the answer); with one rank per host (`dpn == 1`) the reduction step, a dequantize and
//!   requantize of a single input, is skipped. DeepSpeed never runs qgZ with `nodes == 1`.
//!
//! Every rank must pass tensors of the same lengths (and shapes) in the same order, as for any
//! collective. A different total is caught by the collectives' fingerprint check
//! ([`ErrorKind::Mismatch`](crate::ErrorKind::Mismatch)); a different split of the same total
//! is not.
//!
//! Over 600 lines because qgZ is one algorithm whose steps (quantize, exchange within a host,
//! dequantize-reduce-requantize, exchange across hosts) share one layout; the int4 kernels are in
//! `quant.rs`, the host groups in `host_groups.rs`.

use std::ops::Range;

use super::arg_error;
use crate::comm::Communicator;
use crate::compression::coalesced::reduce_scatter_coalesced;
use crate::compression::host_groups::HostGroups;
use crate::compression::quant::{self, QuantBits, QuantFloat, QuantType};
use crate::engine::LinkStats;
use crate::error::{Error, Result};

/// `tracing` target of the qgZ fallback warnings.
const LOG: &str = "oxcomm::qgz";

/// qgZ quantizes to symmetric int4 (spec §3.3 step 2).
const BITS: QuantBits = QuantBits::Int4;
const TY: QuantType = QuantType::Symmetric;

/// A tensor for [`all_to_all_quant_reduce`]: contiguous data and its shape (qgZ's group count
/// depends on the first two dimensions).
#[derive(Debug, Clone)]
pub struct TensorView<'a, T> {
    data: &'a [T],
    shape: Vec<usize>,
}

impl<'a, T> TensorView<'a, T> {
    /// A tensor of the given shape (row-major). An empty shape is a scalar (one element).
    ///
    /// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) if the product of
    /// `shape` is not `data.len()`.
    pub fn new(data: &'a [T], shape: &[usize]) -> Result<TensorView<'a, T>> {
        let numel = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        if numel != Some(data.len()) {
            return Err(Error::invalid(format!("shape {shape:?} does not hold {} elements", data.len())));
        }
        Ok(TensorView { data, shape: shape.to_vec() })
    }

    /// A 1-D tensor (always takes the fallback path).
    pub fn flat(data: &'a [T]) -> TensorView<'a, T> {
        TensorView { data, shape: vec![data.len()] }
    }

    /// The elements.
    pub fn data(&self) -> &'a [T] {
        self.data
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
}

impl<'a, T> From<&'a [T]> for TensorView<'a, T> {
    fn from(data: &'a [T]) -> Self {
        TensorView::flat(data)
    }
}

/// What one call of [`all_to_all_quant_reduce_report`] did and moved.
///
/// Byte counts are deltas of [`Communicator::stats`] around each phase: they include the
/// agreement messages of the collectives and anything else this rank ran concurrently (async
/// work) during the phase.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QuantReduceReport {
    /// Tensors that took the quantized path.
    pub quantized: usize,
    /// Tensors that took the exact [`reduce_scatter_coalesced`] fallback.
    pub fallback: usize,
    /// The all-to-all inside the host (zero with one rank per host).
    pub intra: LinkStats,
    /// The all-to-all across hosts (zero with one host): the only cross-host traffic of the
    /// quantized path.
    pub inter: LinkStats,
    /// The fallback reduce-scatter, over the whole communicator.
    pub fallback_bytes: LinkStats,
}

/// Quantized reduce-scatter (ZeRO++ qgZ, spec §3.3): returns this rank's partition of each
/// tensor's **mean** over `comm`, moving int4 codes instead of values.
///
/// `groups` is the host layout built for this `comm` ([`HostGroups::uniform`]); `None` means
/// one host holding every rank (`nodes = 1`: one int4 all-to-all, no cross-host phase).
///
/// Per tensor `T` with `N` elements and shape `[d0, d1, …]`:
/// * **1-D (or 0-D), `N == 0`, or `N % (2W) ≠ 0`**: the exact fallback,
///   [`reduce_scatter_coalesced`] over `comm` (ceil partitions); the last case logs a warning
///   on target `oxcomm::qgz`, as DeepSpeed does.
/// * **Otherwise** the quantized path, with `G = max(d0, d1, W)` groups of `E = N / G`:
///   1. quantize to symmetric int4 in the swizzled order, so that the chunk for local peer `k`
///      holds partitions `node · dpn + k` for every node;
///   2. all-to-all inside the host;
///   3. dequantize the `dpn` received records, sum in f32, requantize (`G / dpn` groups of
///      `E`);
///   4. all-to-all across hosts, the chunk for host `k` holding partition `k · dpn + dev`;
///   5. dequantize, sum the `nodes` records in f32, divide by `W`, round once to `T`.
///
///   Output `t` is elements `[ρ·P, (ρ+1)·P)` of the mean, `P = N / W`, `ρ = comm.rank()`.
///   **Error bound** per element of group `g`, from the kernels' rounding (each quantization
///   is off by at most half a step, or one step where `+amax` clamps to code 7):
///   `|out − mean| ≤ (1/W) · (Σ_ranks s1 + Σ_hosts s2) ≤ (2/W) · Σ_ranks s1` plus f32 and
///   final rounding, where `s1 = amax₁/8` are the first scales of group `g` on each rank and
///   `s2 ≤ Σ_{ranks on the host} s1` the scales of the host sums.
///
/// Checked before anything is sent, as [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument)
/// (DeepSpeed corrupts data silently here, spec §3.7): `groups` built for another
/// communicator; on the quantized path `G % W ≠ 0` (e.g. shape `(40, 8)` with `W = 16`),
/// `N % G ≠ 0`, or an odd `E` (int4 stores two codes per byte). Collective over `comm`, the
/// intra and inter groups; every rank must pass the same shapes in the same order.
pub fn all_to_all_quant_reduce<T: QuantFloat>(
    comm: &Communicator,
    tensors: &[TensorView<'_, T>],
    groups: Option<&HostGroups>,
) -> Result<Vec<Vec<T>>> {
    all_to_all_quant_reduce_report(comm, tensors, groups).map(|(out, _)| out)
}

/// Logs one quantized reduce-scatter under its own name (uncompressed bytes, as DeepSpeed
/// counts the input of `reduce_scatter`).
fn log_quant<T: QuantFloat>(comm: &Communicator, tensors: &[TensorView<'_, T>], start: u64) {
    let count: usize = tensors.iter().map(|t| t.data().len()).sum();
    let bytes = (count * std::mem::size_of::<T>()) as u64;
    comm.log_op("quant_reduce_scatter", Some(T::DTYPE), count, bytes, start);
}

/// [`all_to_all_quant_reduce`], also returning which paths ran and the bytes each phase moved.
pub fn all_to_all_quant_reduce_report<T: QuantFloat>(
    comm: &Communicator,
    tensors: &[TensorView<'_, T>],
    groups: Option<&HostGroups>,
) -> Result<(Vec<Vec<T>>, QuantReduceReport)> {
    let start = comm.logger().now_ns();
    let result = quant_reduce_inner(comm, tensors, groups)?;
    log_quant(comm, tensors, start);
    Ok(result)
}

fn quant_reduce_inner<T: QuantFloat>(
    comm: &Communicator,
    tensors: &[TensorView<'_, T>],
    groups: Option<&HostGroups>,
) -> Result<(Vec<Vec<T>>, QuantReduceReport)> {
    let hosts = Hosts::new(comm, groups)?;
    let routes: Vec<Route> = tensors.iter().map(|t| route(comm, t)).collect::<Result<_>>()?;
    let mut report = QuantReduceReport::default();
    let mut out: Vec<Vec<T>> = vec![Vec::new(); tensors.len()];

    // The exact fallback, all such tensors in one collective.
    let fallback: Vec<usize> = (0..tensors.len()).filter(|&t| matches!(routes[t], Route::Fallback)).collect();
    if !fallback.is_empty() {
        for &t in &fallback {
            let x = &tensors[t];
            if x.shape.len() > 1 && !x.data.is_empty() {
                tracing::warn!(
                    target: LOG,
                    "qgZ falls back to reduce_scatter because tensor size = {} is not divisible by \
                     (2 * global_world_size) = {}",
                    x.data.len(),
                    2 * comm.size()
                );
            }
        }
        let inputs: Vec<&[T]> = fallback.iter().map(|&t| tensors[t].data).collect();
        let before = comm.stats();
        let results = reduce_scatter_coalesced(comm, &inputs)?;
        report.fallback_bytes = delta(before, comm.stats());
        report.fallback = fallback.len();
        for (&t, r) in fallback.iter().zip(results) {
            out[t] = r;
        }
    }

    // The quantized path, all such tensors in the same all-to-alls.
    let quantized: Vec<(usize, QgzPlan)> = routes
        .iter()
        .enumerate()
        .filter_map(|(t, r)| match r {
            Route::Quantized(p) => Some((t, *p)),
            Route::Fallback => None,
        })
        .collect();
    if !quantized.is_empty() {
        let plans: Vec<QgzPlan> = quantized.iter().map(|(_, p)| *p).collect();
        let inputs: Vec<&[T]> = quantized.iter().map(|(t, _)| tensors[*t].data).collect();
        let results = quantized_reduce_scatter(&hosts, &plans, &inputs, &mut report)?;
        report.quantized = quantized.len();
        for ((t, _), r) in quantized.iter().zip(results) {
            out[*t] = r;
        }
    }
    Ok((out, report))
}

/// How one tensor is reduced.
#[derive(Debug, Clone, Copy)]
enum Route {
    Fallback,
    Quantized(QgzPlan),
}

/// Sizes of one tensor on the quantized path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct QgzPlan {
    /// `P = N / W`: elements per partition.
    p: usize,
    /// `E = N / G`: elements per group.
    e: usize,
    /// `G / W`: groups per partition.
    gpp: usize,
}

impl QgzPlan {
    /// Bytes of codes of one partition.
    fn code_bytes(self) -> usize {
        quant::quantized_len(self.p, BITS)
    }

    /// Bytes of a record of `m` partitions: codes, then scales.
    fn record_bytes(self, m: usize) -> usize {
        m * (self.code_bytes() + 4 * self.gpp)
    }
}

/// The routing rules of spec §3.3 plus the checks of §3.7.
fn route<T>(comm: &Communicator, x: &TensorView<'_, T>) -> Result<Route> {
    let (w, n) = (comm.size(), x.data.len());
    if x.shape.len() <= 1 || n == 0 || n % (2 * w) != 0 {
        return Ok(Route::Fallback);
    }
    let g = x.shape[0].max(x.shape[1]).max(w);
    let bad = |why: String| {
        Err(arg_error(
            comm,
            "all_to_all_quant_reduce",
            format!(
                "shape {:?} on {w} ranks: {why} (DeepSpeed would silently corrupt this tensor; reshape it)",
                x.shape
            ),
        ))
    };
    if g % w != 0 {
        return bad(format!("G = max(d0, d1, W) = {g} groups is not a multiple of W = {w}"));
    }
    if n % g != 0 {
        return bad(format!("{n} elements do not split into G = {g} groups"));
    }
    let e = n / g;
    if e % 2 != 0 {
        return bad(format!("groups of E = N / G = {e} elements, odd, cannot be packed two int4 codes per byte"));
    }
    Ok(Route::Quantized(QgzPlan { p: n / w, e, gpp: g / w }))
}

/// The host layout of one call.
struct Hosts<'g> {
    w: usize,
    dpn: usize,
    nodes: usize,
    intra: &'g Communicator,
    inter: Option<&'g Communicator>,
}

impl<'g> Hosts<'g> {
    fn new(comm: &'g Communicator, groups: Option<&'g HostGroups>) -> Result<Hosts<'g>> {
        let w = comm.size();
        let Some(g) = groups else {
            return Ok(Hosts { w, dpn: w, nodes: 1, intra: comm, inter: None });
        };
        if g.parent.as_slice() != comm.members() || g.parent_rank != comm.rank() {
            return Err(arg_error(
                comm,
                "all_to_all_quant_reduce",
                format!(
                    "host groups were built for the communicator of world ranks {:?}, not {:?}",
                    g.parent,
                    comm.members()
                ),
            ));
        }
        Ok(Hosts {
            w,
            dpn: g.ranks_per_host,
            nodes: g.hosts,
            intra: &g.intra,
            inter: (g.hosts > 1).then_some(&g.inter),
        })
    }
}

/// Elements of host sums (whole groups, at least one) that step 3 adds up in f32 and step 4
/// requantizes before moving on: 16 KiB of f32, which stay in L1 between the two.
const FUSE_BLOCK: usize = 4096;

/// The all-to-all buffers of the quantized path, kept per thread between calls so that a
/// training loop calling qgZ every step does not map, fault in and zero them again each time
/// (that was a quarter of the CPU time of a 64 MiB call). Buffers over [`RETAIN_MAX`] bytes
/// are freed after the call.
#[derive(Default)]
struct Scratch {
    send: Vec<u8>,
    recv: Vec<u8>,
    send2: Vec<u8>,
    recv2: Vec<u8>,
}

/// The largest buffer [`Scratch`] keeps between calls (each of the four).
const RETAIN_MAX: usize = 64 << 20;

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

impl Scratch {
    /// This thread's buffers (empty ones if another call on this thread holds them).
    fn take() -> Scratch {
        SCRATCH.with(|s| std::mem::take(&mut *s.borrow_mut()))
    }

    /// Hands the buffers back for the next call on this thread, dropping oversized ones.
    fn keep(mut self) {
        for b in [&mut self.send, &mut self.recv, &mut self.send2, &mut self.recv2] {
            if b.capacity() > RETAIN_MAX {
                *b = Vec::new();
            }
        }
        SCRATCH.with(|s| *s.borrow_mut() = self);
    }
}

/// `buf` resized to `n` bytes, keeping its allocation. Every caller overwrites all `n` bytes
/// before reading them, so old contents are harmless.
fn sized(buf: &mut Vec<u8>, n: usize) -> &mut [u8] {
    buf.resize(n, 0);
    buf
}

/// Steps 1–5 of the quantized path for every quantized tensor.
fn quantized_reduce_scatter<T: QuantFloat>(
    h: &Hosts<'_>,
    plans: &[QgzPlan],
    inputs: &[&[T]],
    report: &mut QuantReduceReport,
) -> Result<Vec<Vec<T>>> {
    let mut scratch = Scratch::take();
    let out = quantized_reduce_scatter_in(h, plans, inputs, report, &mut scratch);
    scratch.keep();
    out
}

/// [`quantized_reduce_scatter`] with its all-to-all buffers.
fn quantized_reduce_scatter_in<T: QuantFloat>(
    h: &Hosts<'_>,
    plans: &[QgzPlan],
    inputs: &[&[T]],
    report: &mut QuantReduceReport,
    bufs: &mut Scratch,
) -> Result<Vec<Vec<T>>> {
    // Step 1: swizzled quantization, straight into the intra-host send buffer.
    let chunk: usize = plans.iter().map(|p| p.record_bytes(h.nodes)).sum();
    let send = sized(&mut bufs.send, h.dpn * chunk);
    let mut scales = Vec::new();
    for (k, dst) in send.chunks_exact_mut(chunk.max(1)).enumerate().take(h.dpn) {
        let mut at = 0;
        for (plan, x) in plans.iter().zip(inputs) {
            let rec = &mut dst[at..at + plan.record_bytes(h.nodes)];
            let partitions = (0..h.nodes).map(|node| &x[(node * h.dpn + k) * plan.p..][..plan.p]);
            quantize_record(partitions, *plan, rec, &mut scales)?;
            at += rec.len();
        }
    }

    // Step 2: all-to-all inside the host.
    let recv: &[u8] = if h.dpn > 1 {
        let recv = sized(&mut bufs.recv, send.len());
        let before = h.intra.stats();
        h.intra.all_to_all(send, recv)?;
        report.intra = delta(before, h.intra.stats());
        recv
    } else {
        send
    };

    let Some(inter) = h.inter else {
        // One host: the host sums are the whole sums; step 3 and 5 in one pass.
        let mut out = Vec::with_capacity(plans.len());
        let mut at = 0;
        for plan in plans {
            let recs = Records::read(recv, chunk, at, *plan, h.nodes, h.dpn);
            let mut ins = Vec::new();
            recs.groups(0..plan.gpp, &mut ins);
            let mut o = vec![T::default(); plan.p];
            quant::dequantize_mean(&ins, plan.e, BITS, TY, h.w as f32, &mut o)?;
            out.push(o);
            at += plan.record_bytes(h.nodes);
        }
        return Ok(out);
    };

    // Steps 3–5 in stripes (a stripe: the same range of groups of every partition), so that
    // the inter-host exchange of one stripe overlaps the arithmetic of the others.
    let host_recs: Vec<Records<'_>> = {
        let mut at = 0;
        plans
            .iter()
            .map(|plan| {
                let r = Records::read(recv, chunk, at, *plan, h.nodes, h.dpn);
                at += plan.record_bytes(h.nodes);
                r
            })
            .collect()
    };
    let stripes = Stripes::new(plans, h.nodes);
    // Filled stripe by stripe, in order, by `finish_stripe` (never zeroed first).
    let mut out: Vec<Vec<T>> = plans.iter().map(|p| Vec::with_capacity(p.p)).collect();
    let send = sized(&mut bufs.send2, stripes.total);
    let recv = sized(&mut bufs.recv2, stripes.total);
    let mut sums: Vec<f32> = Vec::new();
    let (sends, recvs) = (stripes.split(send), stripes.split(recv));
    // Each stripe in turn, all on this thread: with one stripe, or if no thread can be had.
    let in_turn = |sends: Vec<&mut [u8]>,
                   recvs: Vec<&mut [u8]>,
                   sums: &mut Vec<f32>,
                   scales: &mut Vec<f32>,
                   out: &mut [Vec<T>]| {
        let before = inter.stats();
        for (st, (snd, rcv)) in sends.into_iter().zip(recvs).enumerate() {
            requantize_stripe(&stripes, st, &host_recs, h, snd, sums, scales)?;
            inter.all_to_all(snd, rcv)?;
            finish_stripe(&stripes, st, rcv, h, out)?;
        }
        Ok::<_, Error>(delta(before, inter.stats()))
    };
    if stripes.count == 1 {
        report.inter = in_turn(sends, recvs, &mut sums, &mut scales, &mut out)?;
        return Ok(out);
    }
    // A helper thread runs the exchanges, in stripe order, while this one computes; this
    // thread makes no communicator calls meanwhile, so the inter stats delta is the helper's.
    report.inter = std::thread::scope(|scope| -> Result<LinkStats> {
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<(&[u8], &mut [u8])>();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<Result<&[u8]>>();
        let spawned = std::thread::Builder::new().name("oxcomm-qgz".into()).spawn_scoped(scope, move || {
            let before = inter.stats();
            for (snd, rcv) in ready_rx {
                let r = inter.all_to_all(snd, rcv).map(|()| &*rcv);
                let failed = r.is_err();
                // The receiver only goes away after an error of its own.
                let _ = done_tx.send(r);
                if failed {
                    break;
                }
            }
            delta(before, inter.stats())
        });
        let Ok(helper) = spawned else {
            tracing::debug!(target: LOG, "no thread for the qgZ exchanges; running the stripes in turn");
            return in_turn(sends, recvs, &mut sums, &mut scales, &mut out);
        };
        let mut computed = Ok(());
        for (st, (snd, rcv)) in sends.into_iter().zip(recvs).enumerate() {
            computed = requantize_stripe(&stripes, st, &host_recs, h, snd, &mut sums, &mut scales);
            if computed.is_err() || ready_tx.send((snd, rcv)).is_err() {
                break;
            }
        }
        drop(ready_tx);
        computed?;
        for st in 0..stripes.count {
            let rcv = done_rx.recv().map_err(|_| Error::protocol("qgZ exchange thread stopped early"))??;
            finish_stripe(&stripes, st, rcv, h, &mut out)?;
        }
        helper.join().map_err(|_| Error::protocol("qgZ exchange thread panicked"))
    })?;
    Ok(out)
}

/// Bytes of inter-host records per stripe below which [`Stripes`] stops splitting.
const STRIPE_BYTES: usize = 128 << 10;

/// At most this many stripes per call.
const MAX_STRIPES: usize = 8;

/// How steps 3–5 cut the tensors into stripes: stripe `s` of a tensor is its groups
/// `[s·gpp/S, (s+1)·gpp/S)` of every partition (possibly none), and the inter-host buffers
/// hold the stripes one after another, each laid out as a whole call would be (chunk per
/// host, a record per tensor: codes, then scales).
struct Stripes<'p> {
    plans: &'p [QgzPlan],
    count: usize,
    /// Bytes of stripe `s`'s chunk (one host's share), for each `s`.
    chunks: Vec<usize>,
    nodes: usize,
    /// Bytes of all stripes.
    total: usize,
}

impl<'p> Stripes<'p> {
    fn new(plans: &'p [QgzPlan], nodes: usize) -> Stripes<'p> {
        let bytes: usize = plans.iter().map(|p| p.record_bytes(1)).sum::<usize>() * nodes;
        let count = (bytes / STRIPE_BYTES).clamp(1, MAX_STRIPES);
        let mut stripes = Stripes { plans, count, chunks: Vec::with_capacity(count), nodes, total: 0 };
        for st in 0..count {
            let chunk: usize = plans.iter().map(|p| stripes.plan(p, st).record_bytes(1)).sum();
            stripes.chunks.push(chunk);
        }
        stripes.total = stripes.chunks.iter().sum::<usize>() * nodes;
        stripes
    }

    /// Groups of each partition of `plan` in stripe `st`.
    fn groups(&self, plan: &QgzPlan, st: usize) -> Range<usize> {
        st * plan.gpp / self.count..(st + 1) * plan.gpp / self.count
    }

    /// Stripe `st` of `plan` as a plan of its own.
    fn plan(&self, plan: &QgzPlan, st: usize) -> QgzPlan {
        let gpp = self.groups(plan, st).len();
        QgzPlan { p: gpp * plan.e, e: plan.e, gpp }
    }

    /// `buf` cut into the stripes' parts.
    fn split<'b>(&self, mut buf: &'b mut [u8]) -> Vec<&'b mut [u8]> {
        let mut parts = Vec::with_capacity(self.count);
        for &c in &self.chunks {
            let (part, rest) = buf.split_at_mut(c * self.nodes);
            parts.push(part);
            buf = rest;
        }
        parts
    }
}

/// Steps 3 and 4 for stripe `st`, a block of groups at a time: sum the dpn host records of
/// each tensor in f32 and requantize the sums into `send` (chunk `k`: partition `k·dpn + dev`).
/// `sums` and `scales` are scratch.
fn requantize_stripe(
    stripes: &Stripes<'_>,
    st: usize,
    host_recs: &[Records<'_>],
    h: &Hosts<'_>,
    send: &mut [u8],
    sums: &mut Vec<f32>,
    scales: &mut Vec<f32>,
) -> Result<()> {
    let chunk = stripes.chunks[st];
    let mut at = 0;
    let mut ins = Vec::with_capacity(h.dpn);
    for (full, recs) in stripes.plans.iter().zip(host_recs) {
        let plan = stripes.plan(full, st);
        let first = stripes.groups(full, st).start;
        let per_block = (FUSE_BLOCK / plan.e).max(1);
        for (k, dst) in send.chunks_exact_mut(chunk.max(1)).enumerate().take(h.nodes) {
            let (codes, sc) = dst[at..at + plan.record_bytes(1)].split_at_mut(plan.code_bytes());
            let groups = k * full.gpp + first..k * full.gpp + first + plan.gpp;
            if h.dpn == 1 {
                // Nothing to sum: forward the one record's codes and scales.
                recs.groups(groups, &mut ins);
                if let [(c, s)] = ins[..] {
                    codes.copy_from_slice(c);
                    sc.copy_from_slice(bytemuck::cast_slice(s));
                }
                continue;
            }
            scales.clear();
            scales.resize(plan.gpp, 0.0);
            let mut g = 0;
            while g < plan.gpp {
                let ng = per_block.min(plan.gpp - g);
                let n = ng * plan.e;
                sums.resize(n, 0.0);
                recs.groups(groups.start + g..groups.start + g + ng, &mut ins);
                quant::dequantize_sum_f32(&ins, plan.e, BITS, TY, sums)?;
                let q = &mut codes[quant::quantized_len(g * plan.e, BITS)..][..quant::quantized_len(n, BITS)];
                quant::quantize(sums, plan.e, BITS, TY, q, &mut scales[g..g + ng])?;
                g += ng;
            }
            sc.copy_from_slice(bytemuck::cast_slice(scales));
        }
        at += plan.record_bytes(1);
    }
    Ok(())
}

/// Step 5 for stripe `st`: dequantize and sum the nodes' records, divide by W and round to
/// `T`, a block of groups at a time through an L1-sized buffer, appended to each output
/// (which holds stripes `0..st` already).
fn finish_stripe<T: QuantFloat>(
    stripes: &Stripes<'_>,
    st: usize,
    recv: &[u8],
    h: &Hosts<'_>,
    out: &mut [Vec<T>],
) -> Result<()> {
    let mut at = 0;
    let mut block = Vec::new();
    for (full, o) in stripes.plans.iter().zip(out) {
        let plan = stripes.plan(full, st);
        let recs = Records::read(recv, stripes.chunks[st], at, plan, 1, h.nodes);
        let mut ins = Vec::with_capacity(h.nodes);
        let per_block = (FUSE_BLOCK / plan.e).max(1);
        let mut g = 0;
        while g < plan.gpp {
            let ng = per_block.min(plan.gpp - g);
            recs.groups(g..g + ng, &mut ins);
            block.resize(ng * plan.e, T::default());
            quant::dequantize_mean(&ins, plan.e, BITS, TY, h.w as f32, &mut block)?;
            o.extend_from_slice(&block);
            g += ng;
        }
        debug_assert_eq!(o.len(), stripes.groups(full, st).end * plan.e);
        at += plan.record_bytes(1);
    }
    Ok(())
}

/// One tensor's records in a received all-to-all buffer, one per sender: their codes in
/// place and their scales copied out (a record's scales need not be 4-byte aligned).
struct Records<'a> {
    /// Codes of `m` partitions per sender.
    codes: Vec<&'a [u8]>,
    /// Scales of `m` partitions per sender.
    scales: Vec<Vec<f32>>,
    plan: QgzPlan,
}

impl<'a> Records<'a> {
    /// The records of `senders` ranks, each `m` partitions long, starting `at` bytes into
    /// each sender's `chunk` of `buf`.
    fn read(buf: &'a [u8], chunk: usize, at: usize, plan: QgzPlan, m: usize, senders: usize) -> Records<'a> {
        let (mut codes, mut scales) = (Vec::with_capacity(senders), Vec::with_capacity(senders));
        for j in 0..senders {
            let (c, s) = buf[j * chunk + at..][..plan.record_bytes(m)].split_at(m * plan.code_bytes());
            let mut sc = vec![0f32; m * plan.gpp];
            bytemuck::cast_slice_mut::<f32, u8>(&mut sc).copy_from_slice(s);
            codes.push(c);
            scales.push(sc);
        }
        Records { codes, scales, plan }
    }

    /// Groups `groups` (counted across the record's partitions) of every sender, as
    /// `(codes, scales)` inputs of the [`quant`] sum kernels, into `into`.
    fn groups<'s>(&'s self, groups: Range<usize>, into: &mut Vec<(&'s [u8], &'s [f32])>) {
        let bytes = quant::quantized_len(groups.start * self.plan.e, BITS)
            ..quant::quantized_len(groups.end * self.plan.e, BITS);
        into.clear();
        into.extend(self.codes.iter().zip(&self.scales).map(|(c, s)| (&c[bytes.clone()], &s[groups.clone()])));
    }
}

/// Quantizes `partitions` (each `plan.p` elements, in order) into one record: their codes,
/// then their scales as bytes. `scales` is scratch.
fn quantize_record<'x, T: QuantFloat>(
    partitions: impl Iterator<Item = &'x [T]>,
    plan: QgzPlan,
    rec: &mut [u8],
    scales: &mut Vec<f32>,
) -> Result<()> {
    let m = rec.len() / (plan.code_bytes() + 4 * plan.gpp);
    let (codes, sc_bytes) = rec.split_at_mut(m * plan.code_bytes());
    scales.clear();
    scales.resize(m * plan.gpp, 0.0);
    for ((x, q), sc) in partitions.zip(codes.chunks_exact_mut(plan.code_bytes())).zip(scales.chunks_exact_mut(plan.gpp))
    {
        quant::quantize(x, plan.e, BITS, TY, q, sc)?;
    }
    sc_bytes.copy_from_slice(bytemuck::cast_slice(scales));
    Ok(())
}

fn delta(before: LinkStats, after: LinkStats) -> LinkStats {
    LinkStats {
        bytes_sent: after.bytes_sent - before.bytes_sent,
        bytes_read_directly: after.bytes_read_directly - before.bytes_read_directly,
        bytes_received: after.bytes_received - before.bytes_received,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_sizes() {
        let p = QgzPlan { p: 4096, e: 64, gpp: 64 };
        assert_eq!(p.code_bytes(), 2048);
        assert_eq!(p.record_bytes(2), 2 * (2048 + 256));
    }
}
