//! The 1-bit error-compensated all-reduce (DeepSpeed's `compressed_allreduce`, spec §2) and
//! 1-bit Adam (spec §2.5), built only on the public [`Communicator`] API, so they run on every
//! transport.
//!
//! One file over the usual ~600 lines because it is one algorithm: the all-reduce's phases,
//! the error-feedback state they update and the 1-bit Adam step that drives them read as one
//! piece of math.
//!
//! This module owns the algorithm (scales, error feedback, which collective moves which
//! bytes), the per-buffer state ([`OneBitState`]) and the optimizer ([`Adam`]). The bit
//! format is [`pack`]'s; moving bytes, ordering ops and deadlines are the
//! [`Communicator`]'s. It does not know about transports or algorithms.
//!
//! # Vocabulary and cost
//!
//! `n` is the group size, `L` the caller's buffer length, `N ≥ L` the *padded length* (the
//! length of the worker error, a multiple of `8n`; [`padded_len`] gives DeepSpeed's choice,
//! a multiple of `n · lcm(n, 8)`), and `C = N / n` the *server chunk*: rank `r` is the
//! server of elements `[r·C, (r+1)·C)`. One call is two collectives; each scale rides at the
//! end of its row of sign bytes (an `f32`, little-endian), where DeepSpeed all-gathers the
//! scales separately:
//!
//! | step | op | bytes sent per rank |
//! |---|---|---|
//! | worker signs and `α` | `all_to_all::<u8>` of `n` rows of `C/8 + 4` | `(n−1)·(C/8 + 4)` |
//! | server signs and `β` | `all_gather::<u8>` of `C/8 + 4` | `(n−1)·(C/8 + 4)` (ring) |
//!
//! so about `N/4 · (n−1)/n` bytes against `8N · (n−1)/n` for a ring all-reduce of f32: 32×
//! less, minus the scales and each op's fixed cost.
//!
//! Over TCP links, calls whose chunks hold at least 128 KiB of signs overlap the wire with
//! the arithmetic ([`OneBitState::with_overlap`]): each peer's worker signs leave point to
//! point (pairwise) as soon as they are computed, the scales follow in a 4-byte all-gather,
//! and the servers' rows are exchanged point to point while this rank unpacks its own chunk
//! of the output. Same bytes (plus message headers), same bits.
//!
//! The arithmetic takes three passes over memory, each a fused kernel of [`pack`]:
//! [`pack::add_pack_squares`] over `N` floats (`e ← u − α·sgn(u)` left by the last call, `u =
//! x + e`, its signs and `Σu²`), [`pack::unpack_sum_pack_squares`] over the server's `C` (`s ←
//! m − β·sgn(m)` left by the last call, every rank's signs with its scale, `m`, its signs and
//! `Σm²`), and the output unpacked straight into the caller's buffer. The error updates of a
//! call are done by the next one (see [`OneBitState`]).
//!
//! # The algorithm (spec §2.2)
//!
//! `sgn(v) = −1` if `v < 0`, else `+1` (so `sgn(±0) = sgn(NaN) = +1`). On every rank: `u =
//! pad(x) + e` (zeros up to `N`), `α = ‖u‖₂ / √N` over all `N` entries, `e ← u − α·sgn(u)`,
//! signs of `u` sent chunk `j` to rank `j`. On server `r`: `m = Σᵢ (αᵢ · (1/n)) · sgnᵢ` over
//! the chunks received (the **mean** of the compressed vectors), `m ← m + s`, `β = ‖m‖₂ /
//! √C`, `s ← m − β·sgn(m)`, signs of `m` all-gathered with every `β`. Every rank then holds
//! the same `y`, `y[j·C + k] = β_j · sgn_j[k]`, and the caller's buffer gets `y[..L]`.
//!
//! Sums of squares are accumulated in f64 from f32 partials over blocks of 64 elements (within
//! 2.4·10⁻⁷ of the exact sum, closer than DeepSpeed's f32 norm; [`pack::SQUARE_LANES`]
//! gives the order and the exact fallback) and the norm is rounded to f32 once; everything
//! else is f32 in DeepSpeed's order of operations.
//!
//! # Non-finite values
//!
//! As in DeepSpeed, nothing is checked: a NaN anywhere in a rank's `u` makes its `α` NaN,
//! and since every server chunk mixes every rank's `α`, **the whole output is NaN on every
//! rank**, and both errors become NaN (call [`OneBitState::reset`] to recover). An infinity
//! gives `α = ∞` and non-finite outputs. A NaN element is sent as `+` (its sign bit is
//! ignored), as in the reference cupy path.
//!
//! # Example
//!
//! ```
//! use oxcomm::compression::onebit::{self, OneBitState};
//!
//! let out = oxcomm::threads::run(2, |comm| {
//!     let mut state = OneBitState::new(13, comm.size())?; // N = 16, C = 8
//!     let mut x: Vec<f32> = (0..13).map(|k| k as f32 - 6.0).collect();
//!     onebit::all_reduce(&comm, &mut x, &mut state)?;
//!     Ok::<_, oxcomm::Error>(x)
//! })
//! .unwrap();
//! assert_eq!(out[0].as_ref().unwrap(), out[1].as_ref().unwrap()); // identical on every rank
//! ```

use std::borrow::Cow;
use std::time::Duration;

use super::pack::{self, BitOrder};
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::reduce::ReduceOp;

/// The name errors of this module carry as their op.
const OP: &str = "onebit::all_reduce";

/// DeepSpeed's padded length: `len` rounded up to a multiple of `n · lcm(n, 8)` (16 for
/// `n = 2`, 72 for 3, 32 for 4, 64 for 8; spec §2.5). Always a multiple of `8n`; `0` stays
/// `0`.
///
/// [`InvalidArgument`](crate::ErrorKind::InvalidArgument) if `world_size == 0` or the result overflows `usize`.
pub fn padded_len(len: usize, world_size: usize) -> Result<usize> {
    if world_size == 0 {
        return Err(Error::invalid("padded_len: the world size must be at least 1"));
    }
    let lcm = world_size / gcd(world_size, 8) * 8;
    world_size
        .checked_mul(lcm)
        .and_then(|multiple| len.checked_next_multiple_of(multiple))
        .ok_or_else(|| Error::invalid(format!("padded_len: {len} elements cannot be padded for {world_size} ranks")))
}

fn gcd(mut a: usize, mut b: usize) -> usize {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// What one rank keeps between calls of [`all_reduce`] on one buffer: the worker error
/// (length `N`), the server error (length `C = N / n`), the bit order, and scratch space so
/// that calls after the first do not allocate.
///
/// The errors are per rank (never identical across ranks) and belong to one buffer and one
/// group: use one state per buffer, and a new one if the group changes.
///
/// A call leaves its last step, the error updates `e ← u − α·sgn(u)` and `s ← m − β·sgn(m)`,
/// to the next call, which does them on the fly in its own pass over the buffers (the same f32
/// operations, so the same bits; one pass over `N + C` floats fewer per call). So the state
/// holds `u`, `m`, `α` and `β`, and [`OneBitState::worker_error`] and
/// [`OneBitState::server_error`] compute the errors when asked.
#[derive(Clone)]
pub struct OneBitState {
    world_size: usize,
    order: BitOrder,
    /// `u` of the last call (the worker error is `u − carry.0 · sgn(u)`); length `N`.
    worker: Vec<f32>,
    /// `m` of the last call (the server error is `m − carry.1 · sgn(m)`); length `C`.
    server: Vec<f32>,
    /// `(α, β)` of the last call; `(0, 0)` when the buffers hold the errors themselves.
    carry: (f32, f32),
    /// Whether large calls overlap the exchanges with the arithmetic (`None`: when the
    /// communicator has TCP links).
    overlap: Option<bool>,
    scratch: Scratch,
}

/// Buffers reused by every call (allocated on the first one).
#[derive(Clone, Default)]
struct Scratch {
    /// `n` rows of `C/8` sign bytes and a scale: the worker's rows (row `j` for rank `j`),
    /// later the server's row in the first.
    send: Vec<u8>,
    /// The rows received: every worker's signs for this chunk, later every server's.
    recv: Vec<u8>,
    /// `αᵢ · (1/n)` of every rank.
    scales: Vec<f32>,
}

impl std::fmt::Debug for OneBitState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OneBitState")
            .field("world_size", &self.world_size)
            .field("order", &self.order)
            .field("padded_len", &self.worker.len())
            .field("chunk_len", &self.server.len())
            .finish_non_exhaustive()
    }
}

impl OneBitState {
    /// Zero errors for buffers of up to `len` elements on a group of `world_size` ranks, with
    /// `N = padded_len(len, world_size)`, as DeepSpeed's optimizers allocate them.
    /// Bit order [`BitOrder::Big`] (the reference NCCL/cupy wire format).
    pub fn new(len: usize, world_size: usize) -> Result<OneBitState> {
        let n_padded = padded_len(len, world_size)?;
        Self::from_errors(vec![0.0; n_padded], vec![0.0; n_padded / world_size], world_size)
    }

    /// A state over caller-sized error buffers (for example restored ones): `worker_error`
    /// has `N` elements with `N % (8 · world_size) == 0`, and `server_error` has
    /// `N / world_size`. Any other sizes are [`InvalidArgument`](crate::ErrorKind::InvalidArgument).
    pub fn from_errors(worker_error: Vec<f32>, server_error: Vec<f32>, world_size: usize) -> Result<OneBitState> {
        if world_size == 0 {
            return Err(Error::invalid("OneBitState: the world size must be at least 1"));
        }
        let n_padded = worker_error.len();
        if n_padded % (8 * world_size) != 0 {
            return Err(Error::invalid(format!(
                "OneBitState: a worker error of {n_padded} elements is not a multiple of 8 × {world_size} ranks \
                 (see padded_len)"
            )));
        }
        if server_error.len() != n_padded / world_size {
            return Err(Error::invalid(format!(
                "OneBitState: the server error has {} elements, expected {n_padded} / {world_size} = {}",
                server_error.len(),
                n_padded / world_size
            )));
        }
        Ok(OneBitState {
            world_size,
            order: BitOrder::Big,
            worker: worker_error,
            server: server_error,
            carry: (0.0, 0.0),
            overlap: None,
            scratch: Scratch::default(),
        })
    }

    /// The same state with another bit order. Every rank must use the same one; the result
    /// does not depend on it (it is only the wire format).
    pub fn with_bit_order(mut self, order: BitOrder) -> OneBitState {
        self.order = order;
        self
    }

    /// The same state with the overlap of large calls chosen: `Some(true)` always overlaps
    /// the exchanges with the arithmetic once a chunk has 128 KiB of signs (the worker signs
    /// of each peer's chunk leave point to point as soon as they are computed, the scales
    /// follow in a 4-byte all-gather, and this rank's chunk of the output is unpacked while
    /// the other servers' rows arrive), `Some(false)` never does, and `None` (the default)
    /// does where the communicator's transport has TCP links, whose slow wire it hides; over
    /// shared memory the wire is as fast as the arithmetic and the background exchanges only
    /// compete with it for the cores. Every rank must choose the same. The result is the
    /// same bits either way. The overlapped path sends point-to-point messages with tag
    /// `0x1b17`: do not have `isend`/`irecv`s of your own between the same ranks in flight
    /// during the call.
    pub fn with_overlap(mut self, overlap: Option<bool>) -> OneBitState {
        self.overlap = overlap;
        self
    }

    /// The bit order of the sign bytes on the wire.
    pub fn bit_order(&self) -> BitOrder {
        self.order
    }

    /// The group size this state is for.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// `N`: the longest buffer this state serves, and the length scales are computed over.
    pub fn padded_len(&self) -> usize {
        self.worker.len()
    }

    /// `C = N / n`: the length of each rank's server chunk.
    pub fn chunk_len(&self) -> usize {
        self.server.len()
    }

    /// This rank's worker error `e` (length `N`; the tail past the buffer takes part too).
    /// After a call it is computed here (a new vector of `N` floats; see the type's docs).
    pub fn worker_error(&self) -> Cow<'_, [f32]> {
        settled(&self.worker, self.carry.0)
    }

    /// This rank's server error `s` for its chunk (length `C`), computed as
    /// [`OneBitState::worker_error`] is.
    pub fn server_error(&self) -> Cow<'_, [f32]> {
        settled(&self.server, self.carry.1)
    }

    /// Zeroes both errors (what an empty input does, and the way back from NaN errors).
    pub fn reset(&mut self) {
        self.worker.fill(0.0);
        self.server.fill(0.0);
        self.carry = (0.0, 0.0);
    }

    /// The error buffers `(worker, server)`, for saving.
    pub fn into_errors(mut self) -> (Vec<f32>, Vec<f32>) {
        pack::subtract_signs(&mut self.worker, self.carry.0);
        pack::subtract_signs(&mut self.server, self.carry.1);
        (self.worker, self.server)
    }

    /// Checks this state against the group and a buffer of `len` elements.
    fn check(&self, comm: &Communicator, len: usize) -> Result<()> {
        let fail = |msg: String| Err(Error::invalid(msg).with_op(OP).with_rank(comm.world_rank()));
        if self.world_size != comm.size() {
            return fail(format!(
                "the state is for {} ranks but the group has {} (make a new OneBitState)",
                self.world_size,
                comm.size()
            ));
        }
        if len > self.padded_len() {
            return fail(format!(
                "the buffer has {len} elements but the state's padded length is {} (size it with padded_len)",
                self.padded_len()
            ));
        }
        Ok(())
    }

    fn prepare_scratch(&mut self) {
        let (n, row) = (self.world_size, self.chunk_len() / 8 + SCALE_BYTES);
        let s = &mut self.scratch;
        s.send.resize(n * row, 0);
        s.recv.resize(n * row, 0);
        s.scales.resize(n, 0.0);
    }
}

/// `v − carry · sgn(v)`, borrowed when `carry` is zero (then it is `v` exactly).
fn settled(v: &[f32], carry: f32) -> Cow<'_, [f32]> {
    if carry == 0.0 {
        return Cow::Borrowed(v);
    }
    let mut e = v.to_vec();
    pack::subtract_signs(&mut e, carry);
    Cow::Owned(e)
}

/// The 1-bit error-compensated all-reduce: on return every rank's `buf` holds the same
/// compressed **mean** of the group's buffers, and `state`'s errors are updated (spec §2.2).
///
/// `buf` may be shorter than the state's padded length `N` (the rest is taken as zeros, and
/// its error is kept); every rank must use a state of the same `N` and bit order. An empty
/// `buf` zeroes both errors and communicates nothing (as DeepSpeed since PR #7769), so either
/// every rank or no rank must pass an empty buffer. Non-finite input: see the module docs.
///
/// Unlike DeepSpeed, the result is always written into `buf` (whether or not it needed
/// padding), and `buf` is untouched on error. Errors: [`InvalidArgument`](crate::ErrorKind::InvalidArgument) if the
/// state is for another group size or `buf.len() > N` (nothing is sent); any error of the
/// two collectives (then the communicator is aborted and the state's errors are garbage).
pub fn all_reduce(comm: &Communicator, buf: &mut [f32], state: &mut OneBitState) -> Result<()> {
    let start = comm.logger().now_ns();
    all_reduce_inner(comm, buf, state)?;
    let bytes = std::mem::size_of_val(buf) as u64;
    comm.log_op("onebit_all_reduce", Some(crate::DType::F32), buf.len(), bytes, start);
    Ok(())
}

fn all_reduce_inner(comm: &Communicator, buf: &mut [f32], state: &mut OneBitState) -> Result<()> {
    state.check(comm, buf.len())?;
    if buf.is_empty() {
        state.reset();
        return Ok(());
    }
    state.prepare_scratch();
    let n = comm.size();
    let order = state.order;
    let c = state.chunk_len();
    let signs = c / 8;
    let row = signs + SCALE_BYTES;
    let len = buf.len();
    // Inside `run_async` (the async form) the exchanges cannot be waited on as handles: the
    // blocking form gives the same bits.
    let wanted = !comm.in_held_turn() && state.overlap.unwrap_or_else(|| comm.transport().uses_tcp());
    let OneBitState { worker, server, carry, scratch: s, .. } = state;

    let (me, pipelined) =
        (comm.rank(), wanted && (2..=MAX_PIPELINED_RANKS).contains(&n) && signs >= PIPELINE_MIN_SIGN_BYTES);

    // Worker: e ← u − α·sgn(u) of the last call, then u = pad(x) + e with its signs in row j
    // of `send` and Σu², chunk by chunk, in place; then α. Pipelined, the peers' chunks come
    // first (in the pairwise order of the exchange) and each one's signs leave while the next
    // is computed; the sums are still added in chunk order, so the bits do not change.
    let mut sums = [0f64; MAX_PIPELINED_RANKS];
    let mut exchanges = Vec::new();
    let mut squares = 0.0;
    let order_of = |step: usize| if pipelined { (me + 1 + step) % n } else { step };
    for step in 0..n {
        let j = order_of(step);
        let (u, out) = (&mut worker[j * c..(j + 1) * c], &mut s.send[j * row..(j + 1) * row]);
        let x = &buf[(j * c).min(len)..((j + 1) * c).min(len)];
        let sum = pack::add_pack_squares(u, carry.0, x, &mut out[..signs], order)?;
        if !pipelined {
            squares += sum;
            continue;
        }
        sums[j] = sum;
        if j != me {
            // Pairwise: signs to rank j, and from rank 2·me − j, the one that sends to me now.
            let from = (2 * me + 2 * n - j) % n;
            exchanges.push((from, exchange(comm, &out[..signs], j, vec![0u8; signs], from)));
        }
    }
    if pipelined {
        squares = sums[..n].iter().fold(0.0, |t, v| t + v);
    }
    let alpha = scale_of(squares, worker.len());
    carry.0 = alpha;
    for out in s.send.chunks_exact_mut(row) {
        out[signs..].copy_from_slice(&alpha.to_le_bytes());
    }

    // Phase 1: signs of chunk j, with α, → rank j.
    if pipelined {
        // The scales follow the signs, which are on their way or there already.
        let mut alphas = vec![0f32; n];
        comm.all_gather(&[alpha], &mut alphas)?;
        s.recv[me * row..(me + 1) * row].copy_from_slice(&s.send[me * row..(me + 1) * row]);
        for (from, work) in exchanges {
            let got = work.wait()?;
            s.recv[from * row..][..signs].copy_from_slice(&got);
        }
        for (i, a) in alphas.iter().enumerate() {
            s.recv[i * row + signs..(i + 1) * row].copy_from_slice(&a.to_le_bytes());
        }
    } else {
        comm.all_to_all(&s.send, &mut s.recv)?;
    }

    // Server: s ← m − β·sgn(m) of the last call, then m = Σᵢ (αᵢ · 1/n) · sgnᵢ + s with its
    // signs and Σm², in place; then β.
    let inv_n = 1.0 / n as f32;
    for (scale, from) in s.scales.iter_mut().zip(s.recv.chunks_exact(row)) {
        *scale = scale_in(from) * inv_n;
    }
    let out = &mut s.send[..signs];
    let squares = pack::unpack_sum_pack_squares(&s.recv, row, &s.scales, server, carry.1, out, order)?;
    let beta = scale_of(squares, c);
    carry.1 = beta;
    s.send[signs..row].copy_from_slice(&beta.to_le_bytes());

    // Phase 2: every server's signs, with its β, to everyone. Pipelined, this rank's own
    // chunk of the output is unpacked while the others' rows travel.
    if pipelined {
        let mine = &s.send[..row];
        let mut works: Vec<_> = (1..n)
            .map(|step| {
                let (to, from) = ((me + step) % n, (me + n - step) % n);
                (from, exchange(comm, mine, to, vec![0u8; row], from))
            })
            .collect();
        let end = len.min((me + 1) * c);
        if me * c < end {
            unpack_output(&mut buf[me * c..end], mine, order)?;
        }
        for (from, work) in works.drain(..) {
            let got = work.wait()?;
            let end = len.min((from + 1) * c);
            if from * c < end {
                unpack_output(&mut buf[from * c..end], &got, order)?;
            }
        }
        return Ok(());
    }
    comm.all_gather(&s.send[..row], &mut s.recv)?;

    // Output: y[j·C + k] = β_j · sgn_j[k], straight into the caller's buffer up to its length.
    for (out, from) in buf.chunks_mut(c).zip(s.recv.chunks_exact(row)) {
        unpack_output(out, from, order)?;
    }
    Ok(())
}

/// Rank counts up to which large calls overlap the exchanges with the arithmetic (beyond,
/// per-chunk sums would need a heap array; the plain collectives serve them).
const MAX_PIPELINED_RANKS: usize = 64;

/// Sign bytes per chunk from which a call may overlap the exchanges with the arithmetic (see
/// [`OneBitState::with_overlap`]). Below, the two plain collectives cost less.
const PIPELINE_MIN_SIGN_BYTES: usize = 128 * 1024;

/// Tag of the 1-bit all-reduce's point-to-point messages.
const EXCHANGE_TAG: u32 = 0x1b17;

/// Starts sending `data` to `to` and receiving `buf.len()` bytes from `from` (one batch, so
/// the two progress together in the background).
fn exchange(comm: &Communicator, data: &[u8], to: usize, buf: Vec<u8>, from: usize) -> crate::comm::Work<Vec<u8>> {
    let send = comm.isend(data.to_vec(), to, EXCHANGE_TAG);
    let recv = comm.irecv(buf, from, EXCHANGE_TAG);
    // Polling starts the batch; the send's result comes with the receive's (a failed send
    // aborts the communicator, which fails the receive too).
    let _ = send.is_completed();
    recv
}

/// `out[k] = β · sgn[k]` from a row of signs ending in its `β`, for the first `out.len()`
/// elements of the row.
fn unpack_output(out: &mut [f32], from: &[u8], order: BitOrder) -> Result<()> {
    let beta = scale_in(from);
    let whole = out.len() / 8;
    let (head, tail) = out.split_at_mut(8 * whole);
    pack::unpack_scaled(&from[..whole], head, beta, order)?;
    if !tail.is_empty() {
        let mut last = [0f32; 8];
        pack::unpack_scaled(&from[whole..whole + 1], &mut last, beta, order)?;
        tail.copy_from_slice(&last[..tail.len()]);
    }
    Ok(())
}

/// Bytes of the scale (`f32`, little-endian) that ends each row of signs on the wire.
const SCALE_BYTES: usize = 4;

/// The scale at the end of a row of signs.
fn scale_in(row: &[u8]) -> f32 {
    let mut bytes = [0u8; SCALE_BYTES];
    bytes.copy_from_slice(&row[row.len() - SCALE_BYTES..]);
    f32::from_le_bytes(bytes)
}

/// The scale from a sum of squares: the norm rounded to f32 once, then divided as DeepSpeed
/// divides a float32 norm by `√numel`.
fn scale_of(sum_squares: f64, len: usize) -> f32 {
    sum_squares.sqrt() as f32 / (len as f64).sqrt() as f32
}

// -------------------------------------------------------------------- async

/// The handle of [`all_reduce_async`], which hands `(buf, state)` back. Dropping the handle
/// does not cancel the call.
pub struct OneBitWork {
    work: crate::comm::Work<(Vec<f32>, OneBitState)>,
    rank: usize,
}

impl std::fmt::Debug for OneBitWork {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OneBitWork").field("rank", &self.rank).field("completed", &self.is_completed()).finish()
    }
}

/// [`all_reduce`] in the background: takes the buffer and the state, and gives both back
/// through [`OneBitWork::wait`].
///
/// It runs as one op in the communicator's issue order ([`Communicator::run_async`]): after
/// every op issued before it and before every op issued after it, on every rank, so other ops
/// may be issued while it runs. On TCP it does not pipeline its exchanges (same bits, less
/// overlap). Errors come from [`OneBitWork::wait`]; the `Result` here is kept for callers
/// written when starting the call could fail.
pub fn all_reduce_async(comm: &Communicator, buf: Vec<f32>, state: OneBitState) -> Result<OneBitWork> {
    let work = comm.run_async(move |c| {
        let (mut buf, mut state) = (buf, state);
        all_reduce(c, &mut buf, &mut state)?;
        Ok((buf, state))
    });
    Ok(OneBitWork { work, rank: comm.world_rank() })
}

impl OneBitWork {
    /// Whether the call has finished (successfully or not).
    pub fn is_completed(&self) -> bool {
        self.work.is_completed()
    }

    /// Waits for the call and returns `(buf, state)`. The ops' own deadlines bound the wait.
    pub fn wait(self) -> Result<(Vec<f32>, OneBitState)> {
        self.work.wait()
    }

    /// Waits at most `timeout`: `Ok(Some((buf, state)))` once done, `Ok(None)` if still
    /// running, `Err` if it failed. The result can be taken once.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Result<Option<(Vec<f32>, OneBitState)>> {
        self.work.wait_timeout(timeout)
    }
}

// -------------------------------------------------------------------- 1-bit Adam

/// DeepSpeed's `OnebitAdam` (spec §2.5) for one flat parameter buffer per rank.
///
/// Each [`Adam::step`] is one optimizer call with this rank's local gradient. Call `k`
/// (counting from 1):
///
/// * `k = 1`, the **initialization call**: DeepSpeed's first `step()` only allocates the
///   error buffers and applies no update. Here too: the gradient is averaged over the group
///   (the engine's backward all-reduce, [`ReduceOp::Avg`]) and then dropped; nothing else
///   changes.
/// * **Warm-up** (not yet frozen): `grads ← mean over ranks` (exact all-reduce, written
///   back into `grads`), `m ← β1·m + (1−β1)·g`, `v ← β2·v + (1−β2)·g²`, update. After the
///   update, if `k ≥ freeze_step` the optimizer freezes (so with `freeze_step ≤ 2` call 2 is
///   the only warm-up call).
/// * **Compression** (frozen): `m ← β1·m + (1−β1)·g_local` with the local, un-averaged
///   gradient (left untouched in `grads`), then `m ←` [`all_reduce`]`(m)` (skipped on one
///   rank, as DeepSpeed does), `v` frozen, update. The error buffers start at zero on the
///   first compressed call.
///
/// The update is `p ← p − lr · (m / (√v + eps) + weight_decay · p)` (the weight-decay term
/// only when `weight_decay > 0`). **There is no bias correction**: DeepSpeed's `OnebitAdam`
/// reads `bias_correction` but never applies it, so early updates are about
/// `(1−β1)/√(1−β2)` times larger than bias-corrected Adam's. With `freeze_step = u64::MAX`
/// this is exact (uncompressed) data-parallel Adam with the same conventions.
///
/// DeepSpeed's `exp_avg_mask` and `non_freeze` parameter groups are not provided.
#[derive(Debug, Clone)]
pub struct Adam {
    /// Learning rate (DeepSpeed default `1e-3`).
    pub lr: f32,
    /// `(β1, β2)`, the decay of the momentum and of the variance (default `(0.9, 0.999)`).
    pub betas: (f32, f32),
    /// Added to `√v` in the denominator (default `1e-8`).
    pub eps: f32,
    /// Weight decay added to the update, as `weight_decay · p` (default `0`).
    pub weight_decay: f32,
    /// The call after which the variance freezes and momenta are compressed (default
    /// `100000`).
    pub freeze_step: u64,
    /// The bit order of the compressed momenta on the wire (default [`BitOrder::Big`]).
    pub bit_order: BitOrder,
    step: u64,
    frozen: bool,
    exp_avg: Vec<f32>,
    exp_avg_sq: Vec<f32>,
    errors: Option<OneBitState>,
}

impl Default for Adam {
    /// DeepSpeed's defaults.
    fn default() -> Self {
        Adam {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            freeze_step: 100_000,
            bit_order: BitOrder::Big,
            step: 0,
            frozen: false,
            exp_avg: Vec::new(),
            exp_avg_sq: Vec::new(),
            errors: None,
        }
    }
}

impl Adam {
    /// DeepSpeed's defaults with this learning rate and freeze step.
    pub fn new(lr: f32, freeze_step: u64) -> Adam {
        Adam { lr, freeze_step, ..Adam::default() }
    }

    /// Optimizer calls so far (DeepSpeed's `state['step']`).
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// Whether the variance is frozen and momenta go through the 1-bit all-reduce.
    pub fn is_compressing(&self) -> bool {
        self.frozen
    }

    /// The momentum `m` (empty before the first call).
    pub fn exp_avg(&self) -> &[f32] {
        &self.exp_avg
    }

    /// The variance `v` (empty before the first call).
    pub fn exp_avg_sq(&self) -> &[f32] {
        &self.exp_avg_sq
    }

    /// The 1-bit error state (`None` before the first compressed call).
    pub fn onebit_state(&self) -> Option<&OneBitState> {
        self.errors.as_ref()
    }

    /// One optimizer call with this rank's gradient: see the type's docs for what each call
    /// does. Collective: every rank calls it, with the same parameter length.
    ///
    /// [`InvalidArgument`](crate::ErrorKind::InvalidArgument) (nothing sent, nothing changed) if `params` and `grads`
    /// differ in length, the length differs from the first call's, or a hyperparameter is
    /// not finite or out of range; otherwise the errors of the collectives.
    pub fn step(&mut self, comm: &Communicator, params: &mut [f32], grads: &mut [f32]) -> Result<()> {
        self.check(comm, params.len(), grads.len())?;
        if self.step == 0 {
            self.exp_avg = vec![0.0; params.len()];
            self.exp_avg_sq = vec![0.0; params.len()];
        }
        self.step += 1;
        let (beta1, beta2) = self.betas;
        let (one_minus_b1, one_minus_b2) = (1.0 - beta1, 1.0 - beta2);

        if self.step == 1 {
            return comm.all_reduce(grads, ReduceOp::Avg);
        }
        if !self.frozen {
            comm.all_reduce(grads, ReduceOp::Avg)?;
            for ((m, v), &g) in self.exp_avg.iter_mut().zip(self.exp_avg_sq.iter_mut()).zip(grads.iter()) {
                *m = *m * beta1 + one_minus_b1 * g;
                *v = *v * beta2 + one_minus_b2 * g * g;
            }
            self.apply(params);
            if self.step >= self.freeze_step {
                self.frozen = true;
            }
            return Ok(());
        }
        for (m, &g) in self.exp_avg.iter_mut().zip(grads.iter()) {
            *m = *m * beta1 + one_minus_b1 * g;
        }
        if comm.size() > 1 {
            if self.errors.is_none() {
                self.errors = Some(OneBitState::new(params.len(), comm.size())?.with_bit_order(self.bit_order));
            }
            let errors = self.errors.as_mut().expect("just set");
            all_reduce(comm, &mut self.exp_avg, errors)?;
        }
        self.apply(params);
        Ok(())
    }

    /// `p ← p + (−lr) · (m / (√v + eps) [+ weight_decay · p])`.
    fn apply(&self, params: &mut [f32]) {
        let (lr, eps, wd) = (self.lr, self.eps, self.weight_decay);
        for ((p, &m), &v) in params.iter_mut().zip(&self.exp_avg).zip(&self.exp_avg_sq) {
            let mut update = m / (v.sqrt() + eps);
            if wd > 0.0 {
                update += wd * *p;
            }
            *p += -lr * update;
        }
    }

    fn check(&self, comm: &Communicator, params: usize, grads: usize) -> Result<()> {
        let fail = |msg: String| Err(Error::invalid(msg).with_op("onebit::Adam::step").with_rank(comm.world_rank()));
        if params != grads {
            return fail(format!("{params} parameters but {grads} gradients"));
        }
        if self.step > 0 && params != self.exp_avg.len() {
            return fail(format!("{params} parameters, but the first call had {}", self.exp_avg.len()));
        }
        if let Some(e) = &self.errors {
            if e.world_size() != comm.size() {
                return fail(format!(
                    "the group has {} ranks, but the compressed calls had {}",
                    comm.size(),
                    e.world_size()
                ));
            }
        }
        let (b1, b2) = self.betas;
        let ok = self.lr.is_finite()
            && self.lr >= 0.0
            && (0.0..1.0).contains(&b1)
            && (0.0..1.0).contains(&b2)
            && self.eps.is_finite()
            && self.eps >= 0.0
            && self.weight_decay.is_finite()
            && self.weight_decay >= 0.0;
        if !ok {
            return fail(format!(
                "hyperparameters out of range: lr {}, betas ({b1}, {b2}), eps {}, weight_decay {} \
                 (need lr, eps, weight_decay finite and ≥ 0, betas in [0, 1))",
                self.lr, self.eps, self.weight_decay
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    #[test]
    fn padded_len_matches_deepspeed_multiples() {
        // spec §2.5: the rounding multiple n · lcm(n, 8).
        for (n, multiple) in [(1, 8), (2, 16), (3, 72), (4, 32), (8, 64), (16, 256), (64, 4096)] {
            assert_eq!(padded_len(1, n).unwrap(), multiple, "n={n}");
            assert_eq!(padded_len(multiple, n).unwrap(), multiple);
            assert_eq!(padded_len(multiple + 1, n).unwrap(), 2 * multiple);
            assert_eq!(padded_len(0, n).unwrap(), 0);
        }
        for n in 1..40 {
            for len in [1, 7, 100, 1000] {
                assert_eq!(padded_len(len, n).unwrap() % (8 * n), 0);
            }
        }
        assert!(padded_len(5, 0).is_err());
        assert!(padded_len(usize::MAX, 3).is_err());
    }

    #[test]
    fn state_sizes_are_checked() {
        let s = OneBitState::new(13, 2).unwrap();
        assert_eq!((s.padded_len(), s.chunk_len(), s.world_size(), s.bit_order()), (16, 8, 2, BitOrder::Big));
        assert!(OneBitState::from_errors(vec![0.0; 24], vec![0.0; 8], 3).is_ok());
        assert!(OneBitState::from_errors(vec![0.0; 20], vec![0.0; 10], 2).unwrap_err().is(ErrorKind::InvalidArgument));
        assert!(OneBitState::from_errors(vec![0.0; 16], vec![0.0; 16], 2).unwrap_err().is(ErrorKind::InvalidArgument));
        assert!(OneBitState::from_errors(vec![], vec![], 0).is_err());
        assert!(OneBitState::from_errors(vec![], vec![], 4).is_ok());
    }

    #[test]
    fn scales_ride_at_the_end_of_a_row() {
        assert_eq!(scale_of(25.0, 2), 5.0f32 / 2f64.sqrt() as f32);
        let mut row = vec![0xAAu8; 3];
        row.extend_from_slice(&(-1.5f32).to_le_bytes());
        assert_eq!(scale_in(&row), -1.5);
    }
}
