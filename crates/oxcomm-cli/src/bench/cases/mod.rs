//! One case of a collective: one op ([`BenchOp`]), in one mode, at one size, on this rank
//! ([`Case`]): how it runs ([`Case::run_once`]), how it is timed ([`Case::time`]) and how its
//! result is verified ([`Case::check`]), with the buffers it runs on ([`Buffers`]) and the
//! values it is checked with ([`Pattern`]). This is the interface `oxcomm check` shares with
//! `oxcomm bench`, so both agree on what "right" means; it knows nothing of flags, processes
//! or reports.
//!
//! # What is timed
//!
//! For each op, size and mode (out-of-place, in-place): a barrier, `-w` warm-up ops, a
//! barrier, then `-n` ops back to back, timed as a whole with `Instant` (time = total / n) and
//! one by one (for the median). Each rank measures its own mean and median; the table shows
//! the **maximum over ranks** of each (the op is done when the slowest rank is; nccl-tests
//! prints the average over ranks by default). Buffers are allocated and touched once, at the
//! largest size, and reused for every size (first-touch page faults are slow).
//!
//! With `--fresh-inputs`, every op (warm-up and timed) is preceded, untimed, by a rewrite of
//! the bytes this rank contributes ([`Case::input_range`]) and a barrier, and time = the sum of
//! the per-op times / n. The op then reads what the producing step just wrote, as in a
//! training step; without it, a transport that reads peers' memory in place finds the last
//! op's lines still in its cache.
//!
//! # Out-of-place and in-place
//!
//! oxcomm's all_reduce, all_gather and reduce_scatter have both modes (`all_reduce_into` and
//! `all_reduce`, `all_gather` and `all_gather_in_place`, `reduce_scatter` and
//! `reduce_scatter_in_place`, and likewise all_to_all, gather and scatter; `reduce_into` and
//! `reduce`); broadcast works in place. The mode the API lacks is emulated with one extra copy, which is *inside*
//! the timed region (it is what a caller of our API pays):
//!
//! | op | out-of-place | in-place |
//! | --- | --- | --- |
//! | all_reduce | `all_reduce_into(input, output)` | `all_reduce(buffer)` |
//! | reduce | `reduce_into(input, output)` | `reduce(buffer)` |
//! | broadcast | root copies input → output, then broadcast of the output | broadcast of the buffer |
//! | all_gather | `all_gather(input, output)` | `all_gather_in_place(buffer)` (this rank's block already in place) |
//! | reduce_scatter | `reduce_scatter(input, output)` | `reduce_scatter_in_place(buffer)` (the result lands in this rank's block) |
//! | all_to_all | `all_to_all(send, recv)` | `all_to_all_in_place(buffer)` |
//! | gather | `gather(input, output)` | `gather_in_place(buffer, root)` (the root's block already in place) |
//! | scatter | `scatter(input, output)` | `scatter_in_place(buffer, root)` (the root's block stays in its input) |
//!
//! | onebit_all_reduce | copy input → output, then the op on the output | the op on the buffer |
//! | quant_reduce_scatter | the op, then copy its result (a new vector) to the output | the op, then copy its result to this rank's block of the input |
//!
//! JSON and CSV rows carry `emulated: true` for the emulated mode.
//!
//! # The compressed ops
//!
//! `onebit_all_reduce` is [`oxcomm::compression::onebit::all_reduce`] (f32 only; DeepSpeed's
//! 1-bit error-compensated all-reduce). One [`OneBitState`] per size is made before the
//! warm-up and kept through both modes, so timed iterations run with the error feedback a
//! training loop would carry. Its count is rounded down to a multiple of DeepSpeed's padding
//! granularity `n · lcm(n, 8)` ([`onebit::padded_len`]`(1, n)`), so no padding is sent.
//! `algbw`/`busbw` are computed from the **uncompressed** f32 bytes with all_reduce's bus
//! factor, so its line compares directly with all_reduce's: a higher busbw means the same
//! gradient was averaged faster.
//!
//! `quant_reduce_scatter` is ZeRO++'s qgZ,
//! [`oxcomm::compression::qgz::all_to_all_quant_reduce`] (f32, f16, bf16), with one
//! tensor per call. Sizes follow reduce_scatter (size = the full input of `n · P` elements,
//! `P` per rank, rounded down to even so the int4 codes pack); the tensor's shape is
//! `[N / E, E]` with `E` the largest power of two that divides `P`, at most 2048 and at most
//! `√N`, so every line takes the quantized path (one int4 group per row). The host layout comes
//! from `--ranks-per-host K` (hosts are runs of `K` ranks, [`HostGroups::uniform`]); without
//! it, from the job's real hosts ([`HostGroups::from_topology`]: a multi-host launch with
//! several ranks per host), else all ranks form one host (no cross-host phase). Bandwidths use reduce_scatter's factor
//! on the uncompressed bytes.
//!
//! # Bytes on the wire
//!
//! `wire(B)` (JSON/CSV `wire_bytes`) is the number of bytes this rank handed to its links per
//! op during the timed iterations ([`Communicator::stats`]`().bytes_sent` before and after,
//! divided by `-n`), the maximum over ranks; the table shows the larger of the two modes. It
//! counts payload and headers, including each op's agreement messages. The shared-memory
//! direct paths (all_reduce, broadcast and barrier on `--transport shm`, where ranks read each
//! other's memory) send nothing through links, so those ops show little or nothing there.
//!
//! # Check (`-c 1`, the default)
//!
//! The compressed ops are lossy, so they are checked on inputs they reproduce exactly, with
//! a fresh state: for `onebit_all_reduce` every element of rank `r` is
//! `c_r = [1, −2, 4, −8][r mod 4]` (each rank's scale is then `|c_r|`, every sign is `c_r`'s, the
//! compressed mean is the exact mean, and the result must match it within 8 f32 units in the
//! last place, for the rounding of the f32 norms); for `quant_reduce_scatter` every element
//! of rank `r` is `−2^(r mod 3)` (a power of two at the bottom of the int4 range quantizes
//! exactly; the host sums are requantized with a rounded scale), and the result must match the
//! exact mean within 4 units in the last place of the dtype. Such inputs do not measure the
//! compression error; they check that every rank's contribution arrives, is scaled and is
//! placed right.
//!
//! After timing each mode, every rank fills its inputs with small integers chosen so that the
//! reduced value is exact in every dtype and independent of the reduction order (the idea of
//! nccl-tests' `verifiable`), fills outputs with a sentinel, runs the op once, and counts the
//! elements that differ from the value computed here; `#wrong` is the sum over ranks. Only
//! `avg` on floats is compared with a tolerance (2 units in the last place of the dtype), since
//! the division rounds. For a reduce only the root's output is checked.
//!

mod op;
mod pattern;

use std::ops::Range;
use std::time::{Duration, Instant};

use anyhow::anyhow;
use oxcomm::compression::host_groups::HostGroups;
use oxcomm::compression::onebit::{self, OneBitState};
use oxcomm::compression::qgz::{self, TensorView};
use oxcomm::{Communicator, DType, Element, OpOptions, ReduceOp};

use op::qgz_group;
pub(crate) use op::{BenchOp, Layout};
pub(crate) use pattern::{Pattern, SENTINEL};

/// An element type of the bench: every [`Element`], with the compressed ops where the type
/// has them.
pub(crate) trait BenchElement: Element {
    /// `all_to_all_quant_reduce` of one tensor, or `None` when the type is not quantizable.
    fn quant_reduce(
        comm: &Communicator,
        data: &[Self],
        shape: &[usize],
        groups: Option<&HostGroups>,
    ) -> Option<oxcomm::Result<Vec<Self>>>;
}

macro_rules! bench_element {
    (quant: $($q:ty),*; plain: $($p:ty),*) => {
        $(impl BenchElement for $q {
            fn quant_reduce(
                comm: &Communicator,
                data: &[Self],
                shape: &[usize],
                groups: Option<&HostGroups>,
            ) -> Option<oxcomm::Result<Vec<Self>>> {
                let run = || {
                    let view = TensorView::new(data, shape)?;
                    let mut out = qgz::all_to_all_quant_reduce(comm, &[view], groups)?;
                    Ok(out.pop().unwrap_or_default())
                };
                Some(run())
            }
        })*
        $(impl BenchElement for $p {
            fn quant_reduce(
                _: &Communicator,
                _: &[Self],
                _: &[usize],
                _: Option<&HostGroups>,
            ) -> Option<oxcomm::Result<Vec<Self>>> {
                None
            }
        })*
    };
}

bench_element!(quant: f32, half::f16, half::bf16; plain: f64, i8, u8, i32, i64, i16, u16, u32, u64,
    oxcomm::dtype::Bool, oxcomm::dtype::Complex64, oxcomm::dtype::Complex128, oxcomm::dtype::F8E4M3Fn,
    oxcomm::dtype::F8E5M2, oxcomm::dtype::F8E4M3Fnuz, oxcomm::dtype::F8E5M2Fnuz, oxcomm::dtype::F8E8M0Fnu);

/// `buf` as f32, when `T` is f32.
fn as_f32<T: Element>(buf: &mut [T]) -> Option<&mut [f32]> {
    (T::DTYPE == DType::F32).then(|| bytemuck::cast_slice_mut(buf))
}

/// This rank's buffers, allocated once at the largest size, and the 1-bit state of the
/// current size.
pub(crate) struct Buffers<T> {
    pub(crate) a: Vec<T>,
    pub(crate) b: Vec<T>,
    pub(crate) onebit: Option<OneBitState>,
}

impl<T: Element> Buffers<T> {
    /// Two buffers of `len` elements, every page touched.
    pub(crate) fn new(len: usize) -> anyhow::Result<Buffers<T>> {
        Ok(Buffers { a: allocate(len)?, b: allocate(len)?, onebit: None })
    }
}

fn allocate<T: Element>(len: usize) -> anyhow::Result<Vec<T>> {
    let mut v: Vec<T> = Vec::new();
    v.try_reserve_exact(len)
        .map_err(|_| anyhow!("cannot allocate {} for a buffer", human((len * std::mem::size_of::<T>()) as u64)))?;
    // Touch every page now, outside any timed region.
    v.resize(len, T::from_f64(1.0));
    Ok(v)
}

/// A byte count for people: `512 B`, `1.5 MiB`.
pub(crate) fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// What [`Case::time`] measured, each the maximum over ranks, and the algorithm the last
/// timed op ran.
#[derive(Debug, Clone)]
pub(crate) struct Timed {
    /// Mean time per op, µs.
    pub(crate) mean_us: f64,
    /// Median of the per-op times, µs.
    pub(crate) median_us: f64,
    /// Bytes handed to links per op.
    pub(crate) wire_bytes: u64,
    /// The algorithm this rank's last timed op ran, from the flight recorder (`ring` where
    /// the planner chose it); `None` for the ops built from others (1-bit, quantized).
    pub(crate) ran: Option<String>,
}

/// The `algorithm` of the last entry of a flight record (JSON Lines, oldest first).
fn last_algorithm(record: &str) -> Option<String> {
    let last: serde_json::Value = serde_json::from_str(record.lines().last()?).ok()?;
    last.get("algorithm")?.as_str().map(str::to_string)
}

/// One op in one mode at one size on this rank.
pub(crate) struct Case<'a> {
    pub(crate) comm: &'a Communicator,
    pub(crate) op: BenchOp,
    pub(crate) in_place: bool,
    pub(crate) layout: Layout,
    pub(crate) redop: ReduceOp,
    pub(crate) root: usize,
    pub(crate) opts: &'a OpOptions,
    /// quant_reduce_scatter's host layout (`None`: one host).
    pub(crate) groups: Option<&'a HostGroups>,
}

impl Case<'_> {
    /// Runs the op once (with the emulation copy where the mode needs one). Inputs are in
    /// `a`; outputs in `b` (out-of-place) or `a` (in-place).
    pub(crate) fn run_once<T: BenchElement>(&self, bufs: &mut Buffers<T>) -> oxcomm::Result<()> {
        let Layout { input, output, block } = self.layout;
        let (c, me) = (self.comm, self.comm.rank());
        let Buffers { a, b, onebit } = bufs;
        let o = self.opts;
        match (self.op, self.in_place) {
            (BenchOp::AllReduce, true) => c.all_reduce_with(&mut a[..input], self.redop, o),
            (BenchOp::AllReduce, false) => c.all_reduce_into_with(&a[..input], &mut b[..input], self.redop, o),
            (BenchOp::Reduce, true) => c.reduce_with(&mut a[..input], self.root, self.redop, o),
            (BenchOp::Reduce, false) => {
                let out = (me == self.root).then_some(&mut b[..input]);
                c.reduce_into_with(&a[..input], out, self.root, self.redop, o)
            }
            (BenchOp::Broadcast, true) => c.broadcast_with(&mut a[..input], self.root, o),
            (BenchOp::Broadcast, false) => {
                if me == self.root {
                    b[..input].copy_from_slice(&a[..input]);
                }
                c.broadcast_with(&mut b[..input], self.root, o)
            }
            (BenchOp::AllGather, false) => c.all_gather_with(&a[..input], &mut b[..output], o),
            (BenchOp::AllGather, true) => c.all_gather_in_place_with(&mut a[..output], o),
            (BenchOp::ReduceScatter, false) => c.reduce_scatter_with(&a[..input], &mut b[..output], self.redop, o),
            (BenchOp::ReduceScatter, true) => c.reduce_scatter_in_place_with(&mut a[..input], self.redop, o),
            (BenchOp::AllToAll, false) => c.all_to_all_with(&a[..input], &mut b[..output], o),
            (BenchOp::AllToAll, true) => c.all_to_all_in_place_with(&mut a[..input], o),
            (BenchOp::Gather, false) => {
                let out = (me == self.root).then_some(&mut b[..output]);
                c.gather_with(&a[..input], out, self.root, o)
            }
            (BenchOp::Gather, true) => {
                let buf = if me == self.root { &mut a[..output] } else { &mut a[..input] };
                c.gather_in_place_with(buf, self.root, o)
            }
            (BenchOp::Scatter, false) => {
                let src = (me == self.root).then_some(&a[..input]);
                c.scatter_with(src, &mut b[..output], self.root, o)
            }
            (BenchOp::Scatter, true) => {
                let buf = if me == self.root { &mut a[..input] } else { &mut a[..output] };
                c.scatter_in_place_with(buf, self.root, o)
            }
            (BenchOp::OnebitAllReduce, in_place) => {
                let state = onebit.as_mut().ok_or_else(|| oxcomm::Error::invalid("no 1-bit state for this size"))?;
                let buf = if in_place {
                    &mut a[..input]
                } else {
                    b[..input].copy_from_slice(&a[..input]);
                    &mut b[..input]
                };
                let buf = as_f32(buf).ok_or_else(|| oxcomm::Error::invalid("onebit_all_reduce takes f32 only"))?;
                onebit::all_reduce(c, buf, state)
            }
            (BenchOp::QuantReduceScatter, in_place) => {
                let shape = match qgz_group(block, c.size()) {
                    Some(e) => vec![input / e, e],
                    None => vec![input],
                };
                let out = T::quant_reduce(c, &a[..input], &shape, self.groups)
                    .ok_or_else(|| oxcomm::Error::invalid("quant_reduce_scatter takes f32, f16 and bf16 only"))??;
                let dst = if in_place { &mut a[me * block..(me + 1) * block] } else { &mut b[..output] };
                if out.len() != dst.len() {
                    return Err(oxcomm::Error::invalid(format!(
                        "quant_reduce_scatter returned {} elements, expected {}",
                        out.len(),
                        dst.len()
                    )));
                }
                dst.copy_from_slice(&out);
                Ok(())
            }
        }
    }

    /// Warm-up, then `iters` timed ops back to back (with `fresh`, each after rewriting this
    /// rank's inputs and a barrier, untimed): mean and median in µs and the bytes sent per op,
    /// each the maximum over ranks.
    pub(crate) fn time<T: BenchElement>(
        &self,
        bufs: &mut Buffers<T>,
        warmup: usize,
        iters: usize,
        fresh: bool,
    ) -> oxcomm::Result<Timed> {
        self.comm.barrier()?;
        for i in 0..warmup {
            if fresh {
                self.rewrite_inputs(bufs, i)?;
            }
            self.run_once(bufs)?;
        }
        self.comm.barrier()?;
        let mut each: Vec<Duration> = Vec::with_capacity(iters);
        let sent = self.comm.stats().bytes_sent;
        let start = Instant::now();
        for i in 0..iters {
            if fresh {
                self.rewrite_inputs(bufs, i)?;
            }
            let t = Instant::now();
            self.run_once(bufs)?;
            each.push(t.elapsed());
        }
        // Fresh inputs: the rewrites and barriers between the ops are not the op's time.
        let total = if fresh { each.iter().sum() } else { start.elapsed() };
        let wire = (self.comm.stats().bytes_sent - sent) as f64 / iters.max(1) as f64;
        let composite = matches!(self.op, BenchOp::OnebitAllReduce | BenchOp::QuantReduceScatter);
        let ran = if composite || iters == 0 { None } else { last_algorithm(&self.comm.flight_record()) };
        let mut stats =
            [total.as_secs_f64() * 1e6 / iters.max(1) as f64, median(&mut each).as_secs_f64() * 1e6, wire.round()];
        self.comm.all_reduce(&mut stats, ReduceOp::Max)?;
        Ok(Timed { mean_us: stats[0], median_us: stats[1], wire_bytes: stats[2] as u64, ran })
    }

    /// The elements of `a` this rank contributes to the op (its input; at the root of an
    /// in-place gather, its own block), or `None` when it contributes nothing (a broadcast's
    /// or scatter's non-root).
    pub(crate) fn input_range(&self) -> Option<Range<usize>> {
        let Layout { input, block, .. } = self.layout;
        let me = self.comm.rank();
        let root = me == self.root;
        match self.op {
            BenchOp::Broadcast | BenchOp::Scatter if !root => None,
            BenchOp::AllGather if self.in_place => Some(me * block..(me + 1) * block),
            BenchOp::Gather if self.in_place && root => Some(me * block..(me + 1) * block),
            _ => Some(0..input),
        }
    }

    /// Rewrites this rank's input ([`Case::input_range`]) with a value that changes with `i`,
    /// then waits at a barrier, so the next op starts on every rank with its inputs just
    /// written (`--fresh-inputs`).
    fn rewrite_inputs<T: BenchElement>(&self, bufs: &mut Buffers<T>, i: usize) -> oxcomm::Result<()> {
        if let Some(range) = self.input_range() {
            bufs.a[range].fill(T::from_f64((i % 3) as f64));
        }
        self.comm.barrier()
    }

    /// Fills the inputs with the check pattern and the outputs with a sentinel, runs the op
    /// once and returns the wrong elements summed over ranks.
    pub(crate) fn check<T: BenchElement>(&self, bufs: &mut Buffers<T>, pattern: &Pattern) -> oxcomm::Result<u64> {
        let wrong = self.check_local(bufs, pattern, false)?;
        let mut total = [wrong as i64];
        self.comm.all_reduce(&mut total, ReduceOp::Sum)?;
        Ok(total[0].max(0) as u64)
    }

    /// [`Case::check`] on this rank only: the wrong elements of this rank's output. With
    /// `corrupt` (`oxcomm check --inject-failure`), the first output element is overwritten
    /// after the op, before it is compared.
    pub(crate) fn check_local<T: BenchElement>(
        &self,
        bufs: &mut Buffers<T>,
        pattern: &Pattern,
        corrupt: bool,
    ) -> oxcomm::Result<u64> {
        let Layout { input, output, block } = self.layout;
        let me = self.comm.rank();
        let sentinel = T::from_f64(SENTINEL);
        // Inputs: a[j] = value of (this rank, global index j).
        let fill = |buf: &mut [T], rank: usize, offset: usize, f: &dyn Fn(usize, usize) -> f64| {
            for (j, x) in buf.iter_mut().enumerate() {
                *x = T::from_f64(f(rank, offset + j));
            }
        };
        let plain = |r: usize, i: usize| pattern.plain(r, i);
        let input_of = |r: usize, i: usize| pattern.input(r, i);
        match self.op {
            BenchOp::AllReduce | BenchOp::Reduce => fill(&mut bufs.a[..input], me, 0, &input_of),
            BenchOp::ReduceScatter => fill(&mut bufs.a[..input], me, 0, &input_of),
            BenchOp::Broadcast => {
                if me == self.root || !self.in_place {
                    fill(&mut bufs.a[..input], self.root, 0, &plain);
                }
                if me != self.root && self.in_place {
                    bufs.a[..input].fill(sentinel);
                }
            }
            BenchOp::AllGather => {
                if self.in_place {
                    bufs.a[..output].fill(sentinel);
                    fill(&mut bufs.a[me * block..(me + 1) * block], me, me * block, &plain);
                } else {
                    fill(&mut bufs.a[..input], me, me * block, &plain);
                }
            }
            BenchOp::AllToAll => fill(&mut bufs.a[..input], me, 0, &plain),
            BenchOp::Gather => {
                if self.in_place && me == self.root {
                    bufs.a[..output].fill(sentinel);
                    fill(&mut bufs.a[me * block..(me + 1) * block], me, me * block, &plain);
                } else {
                    fill(&mut bufs.a[..input], me, me * block, &plain);
                }
            }
            BenchOp::Scatter => {
                if me == self.root {
                    for p in 0..self.comm.size() {
                        fill(&mut bufs.a[p * block..(p + 1) * block], p, p * block, &plain);
                    }
                } else if self.in_place {
                    bufs.a[..output].fill(sentinel);
                }
            }
            BenchOp::OnebitAllReduce => {
                bufs.a[..input].fill(T::from_f64(onebit_input(me)));
                bufs.onebit = Some(OneBitState::new(input, self.comm.size())?);
            }
            BenchOp::QuantReduceScatter => bufs.a[..input].fill(T::from_f64(qgz_input(me))),
        }
        if !self.in_place {
            bufs.b[..output].fill(sentinel);
        }
        self.run_once(bufs)?;
        if corrupt {
            let target = match (self.op, self.in_place) {
                (BenchOp::ReduceScatter | BenchOp::QuantReduceScatter, true) => {
                    &mut bufs.a[me * block..(me + 1) * block]
                }
                (_, true) => &mut bufs.a[..output],
                (_, false) => &mut bufs.b[..output],
            };
            if let Some(x) = target.first_mut() {
                *x = sentinel;
            }
        }

        let out: &[T] = if self.in_place { &bufs.a } else { &bufs.b };
        let exact = |got: T, want: f64| got.to_f64() == T::from_f64(want).to_f64();
        let n = self.comm.size();
        let wrong = match self.op {
            BenchOp::AllReduce => count_wrong(&out[..output], |i, g| pattern.matches(g.to_f64(), pattern.reduced(i))),
            BenchOp::Reduce if me == self.root => {
                count_wrong(&out[..output], |i, g| pattern.matches(g.to_f64(), pattern.reduced(i)))
            }
            BenchOp::Reduce => 0,
            BenchOp::Broadcast => count_wrong(&out[..output], |i, g| exact(g, pattern.plain(self.root, i))),
            BenchOp::AllGather => count_wrong(&out[..output], |i, g| exact(g, pattern.plain(i / block.max(1), i))),
            BenchOp::ReduceScatter => {
                let got = if self.in_place { &bufs.a[me * block..(me + 1) * block] } else { &bufs.b[..output] };
                count_wrong(got, |i, g| pattern.matches(g.to_f64(), pattern.reduced(me * block + i)))
            }
            BenchOp::Gather if me == self.root => {
                count_wrong(&out[..output], |i, g| exact(g, pattern.plain(i / block.max(1), i)))
            }
            BenchOp::Gather => 0,
            BenchOp::Scatter => {
                let got = if self.in_place && me == self.root {
                    &bufs.a[me * block..(me + 1) * block]
                } else {
                    &out[..output]
                };
                count_wrong(got, |k, g| exact(g, pattern.plain(me, me * block + k)))
            }
            BenchOp::AllToAll => {
                // Block p of the output came from rank p's block `me`.
                count_wrong(&out[..output], |i, g| {
                    let (p, k) = (i / block.max(1), i % block.max(1));
                    exact(g, pattern.plain(p, me * block + k))
                })
            }
            BenchOp::OnebitAllReduce => {
                let want = (0..n).map(onebit_input).sum::<f64>() / n as f64;
                let tol = 8.0 * f64::from(f32::EPSILON) * 8.0;
                count_wrong(&out[..output], |_, g| (g.to_f64() - want).abs() <= tol)
            }
            BenchOp::QuantReduceScatter => {
                let want = (0..n).map(qgz_input).sum::<f64>() / n as f64;
                let tol = 4.0 * ulp_of(T::DTYPE) * want.abs();
                let got = if self.in_place { &bufs.a[me * block..(me + 1) * block] } else { &bufs.b[..output] };
                count_wrong(got, |_, g| (g.to_f64() - want).abs() <= tol)
            }
        };
        Ok(wrong)
    }
}

/// Every element of rank `r`'s onebit_all_reduce check input (see the module docs).
fn onebit_input(r: usize) -> f64 {
    [1.0, -2.0, 4.0, -8.0][r % 4]
}

/// Every element of rank `r`'s quant_reduce_scatter check input (see the module docs).
fn qgz_input(r: usize) -> f64 {
    -f64::from(1u32 << (r % 3))
}

/// One unit in the last place at 1.0 for a float dtype (the machine epsilon).
fn ulp_of(dtype: DType) -> f64 {
    match dtype {
        DType::F16 => 2f64.powi(-10),
        DType::BF16 => 2f64.powi(-7),
        DType::F32 => 2f64.powi(-23),
        _ => 2f64.powi(-52),
    }
}

fn count_wrong<T: Element>(got: &[T], ok: impl Fn(usize, T) -> bool) -> u64 {
    got.iter().enumerate().filter(|(i, g)| !ok(*i, **g)).count() as u64
}

fn median(v: &mut [Duration]) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    v.sort_unstable();
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `#wrong` comes from comparing real outputs: right data gives 0; an all_reduce max
    /// checked against the expected sums gives wrong elements.
    #[test]
    fn check_counts_real_mismatches() {
        let opts = OpOptions::default();
        let counts = oxcomm::threads::run(3, |comm| {
            let layout = BenchOp::AllReduce.layout(4096, 3, 4);
            let mut bufs = Buffers::<f32>::new(1024).unwrap();
            let case = |op, redop, root| Case {
                comm: &comm,
                op,
                in_place: true,
                layout,
                redop,
                root,
                opts: &opts,
                groups: None,
            };
            let sums = Pattern::new(ReduceOp::Sum, DType::F32, 3);
            let right = case(BenchOp::AllReduce, ReduceOp::Sum, 0).check(&mut bufs, &sums).unwrap();
            let max_as_sum = case(BenchOp::AllReduce, ReduceOp::Max, 0).check(&mut bufs, &sums).unwrap();
            let bcast = case(BenchOp::Broadcast, ReduceOp::Sum, 0).check(&mut bufs, &sums).unwrap();
            (right, max_as_sum, bcast)
        })
        .unwrap();
        for (right, max_as_sum, bcast) in counts {
            assert_eq!((right, bcast), (0, 0));
            assert!(max_as_sum > 1000, "only {max_as_sum} of 3 × 1024 elements differ");
        }
    }

    #[test]
    fn median_of_even_and_odd() {
        let ms = |v: &[u64]| v.iter().map(|m| Duration::from_millis(*m)).collect::<Vec<_>>();
        assert_eq!(median(&mut ms(&[3, 1, 2])), Duration::from_millis(2));
        assert_eq!(median(&mut ms(&[4, 1, 2, 3])), Duration::from_micros(2500));
        assert_eq!(median(&mut []), Duration::ZERO);
    }

    #[test]
    fn sizes_print_for_people() {
        assert_eq!(human(512), "512 B");
        assert_eq!(human(3 << 19), "1.5 MiB");
    }
}
