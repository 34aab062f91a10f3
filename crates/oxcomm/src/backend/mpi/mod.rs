//! The MPI backend (cargo feature `mpi`): a [`crate::Communicator`] whose ops are MPI calls.
//!
//! [`crate::mpi::init`] initialises MPI (or joins an MPI the application already initialised), and
//! returns a world communicator whose every op maps onto one MPI collective on a duplicate of
//! `MPI_COMM_WORLD` (or of the group's communicator):
//!
//! | oxcomm | MPI |
//! | --- | --- |
//! | `all_reduce`, `all_reduce_coalesced` | `MPI_Allreduce` (in place) |
//! | `reduce` | `MPI_Reduce` (in place at the root) |
//! | `broadcast` | `MPI_Bcast` |
//! | `all_gather`, `all_gather_coalesced` | `MPI_Allgather` (`all_gather_in_place`: with `MPI_IN_PLACE`) |
//! | `reduce_scatter` | `MPI_Reduce_scatter_block` (`reduce_scatter_in_place`: with `MPI_IN_PLACE`, then the result moved from the first block to this rank's) |
//! | `all_to_all` / `all_to_all_v` | `MPI_Alltoall` / `MPI_Alltoallv` (after an exchange of counts) |
//! | `gather` / `scatter` | `MPI_Gather` / `MPI_Scatter` |
//! | `barrier` / `monitored_barrier` | `MPI_Barrier` / `MPI_Iallreduce` polled until the deadline |
//! | `send`, `recv`, `isend`, `irecv` | `MPI_Isend`/`MPI_Irecv` of a header, then of the payload |
//! | `new_group`, `split` | `MPI_Comm_split` of the parent group's communicator |
//!
//! What stays oxcomm's: argument validation, the order of ops on one rank (sync and async
//! alike), sequence numbers, error context, the comms logger and flight recorder, and the
//! abort-on-first-error rule ([`crate::comm`]); this backend is one `Backend` among two. MPI picks its own algorithms and segment sizes: the algorithm and
//! segment settings of [`crate::OpOptions`] and [`crate::CommConfig`] are ignored. [`crate::compression`] works unchanged on top, since it only uses the
//! public [`crate::Communicator`] API.
//!
//! # Types and reduce ops
//!
//! f32, f64, i8, u8, i16, u16, i32, u32, i64 and u64 travel as the matching MPI types and
//! reduce with MPI's built-in `SUM`, `PROD`, `MIN`, `MAX`, `BAND`, `BOR`, `BXOR`. **bool**
//! (`MPI_C_BOOL`) and **complex** (`MPI_C_FLOAT_COMPLEX`, `MPI_C_DOUBLE_COMPLEX`) reduce with
//! oxcomm's kernels as user-defined ops (torch's logical ops; oxcomm's complex product bit for
//! bit); **float8** types travel as bytes and are never reduced. **f16 and bf16** travel as
//! 16-bit words (half the bytes of an f32 staging copy) and reduce with a *user-defined MPI
//! op* that runs oxcomm's own kernel ([`crate::reduce::reduce_into`]: widen each pair to f32,
//! combine, round once), the same arithmetic as the native transports. Float `MIN`/`MAX` use a
//! user-defined op too, so NaN propagates as it does natively (MPI leaves NaN unspecified).
//! [`ReduceOp::Avg`], which MPI lacks, reaches this backend as `SUM` (its combiner); the
//! communicator then divides by the group size ([`crate::reduce::finish_avg`], truncating for
//! integers), in the same place as for the native backend. Results of float
//! sums can differ from the native transports' in the last bit, since MPI picks its own
//! reduction order; integer-valued data gives identical results.
//!
//! # Fingerprint check
//!
//! Before each collective, ranks compare fingerprints (op, dtype, count, reduce op, root,
//! group, sequence number) with one `MPI_Allreduce(MAX)` of `[h, !h]` (16 bytes), where `h`
//! hashes the fingerprint: equal hashes everywhere iff `max(h) == h == min(h)`. On a
//! mismatch every rank gathers all fingerprints and fails with [`ErrorKind::Mismatch`]
//! naming a rank whose fingerprint differs from its own. Turn it off with
//! [`ENV_MPI_CHECK`]`=0` to save that round trip. Point-to-point messages carry the
//! fingerprint as a 48-byte header that the receiver checks before receiving the payload.
//!
//! # Deadlines and errors
//!
//! MPI has no deadlines: a rank that never calls a collective makes the others wait in MPI
//! for ever (or until the MPI launcher kills the job), which is MPI's behaviour, not
//! oxcomm's. [`crate::CommConfig::timeout`] still bounds waiting for this rank's earlier async ops,
//! and [`crate::Communicator::monitored_barrier`] keeps its deadline (it polls a non-blocking
//! allreduce). The backend's communicators use `MPI_ERRORS_RETURN`, so a failing MPI call
//! comes back as an [`ErrorKind::Io`] error naming the call and MPI's message (and aborts
//! the communicator) instead of killing the process. rsmpi's safe wrappers discard return
//! codes, so the calls go through `mpi::ffi` directly.
//!
//! # Threads
//!
//! MPI is initialised with `MPI_THREAD_MULTIPLE` when the library offers it, else at least
//! `MPI_THREAD_SERIALIZED` is required ([`crate::mpi::init`] fails otherwise). oxcomm needs no more than
//! serialized access: every op of a process, including async ops that run on the
//! communicator's worker thread, runs only when its turn comes, one at a time. Multiple
//! is asked for so that the application may use MPI itself from other threads.
//!
//! # Byte counts
//!
//! [`crate::Communicator::stats`] counts, per op, the bytes each rank would hand to links in
//! oxcomm's bandwidth-optimal native algorithm for that op (ring / pairwise), since MPI
//! does not report what it moved. With `S` the bytes of the local buffer and `n` ranks:
//! all-reduce `2(n−1)S/n` each way; reduce-scatter and all-to-all `(n−1)S/n` of the input;
//! all-gather `(n−1)S` of the input; all-to-all-v the bytes to and from other ranks;
//! broadcast, reduce, gather and scatter as a flat tree (the root moves `(n−1)` blocks, every
//! other rank one); send/recv the 48-byte header plus the payload. The fingerprint check and
//! barriers are not counted.
//!
//! # Lifetime
//!
//! MPI is finalised when the last communicator of the last [`crate::mpi::init`] is dropped (if oxcomm
//! initialised it): drop it on the thread that called [`crate::mpi::init`], before the process exits.
//! A process cannot initialise MPI again after that. Group communicators live until the
//! world communicator is dropped.

mod ops;
mod ulfm;

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use mpi::environment::{Threading, Universe};
use mpi::ffi;

use crate::backend::GroupView;
use crate::dtype::{DType, Element};
use crate::engine::LinkStats;
use crate::error::{Error, ErrorKind, Result};
use crate::reduce::{self, ReduceOp};
use crate::wire::{Fingerprint, FP_BYTES};

/// Environment variable: `0` (or `false`, `off`) turns the per-op fingerprint check off.
/// Default: on.
pub const ENV_MPI_CHECK: &str = "OXCOMM_MPI_CHECK";

/// MPI tag of point-to-point headers on the backend's point-to-point communicator.
const TAG_HEADER: c_int = 0;
/// MPI tag of point-to-point payloads (a separate tag, so headers and payloads each match
/// in order whatever batches the two sides group them in).
const TAG_PAYLOAD: c_int = 1;

extern "C" {
    /// `MPI_IN_PLACE`, from `in_place.c` (compiled by the build script).
    fn oxcomm_mpi_in_place() -> *mut c_void;
}

/// An MPI handle (communicator, op, request) that may cross threads.
#[derive(Clone, Copy)]
struct Handle<T>(T);

// SAFETY: MPI handles are opaque identifiers with no thread affinity. MPI is initialised with
// at least MPI_THREAD_SERIALIZED, and oxcomm calls MPI for a process only from inside an op,
// and ops of one process run one at a time (the communicator's turn), so no two threads use
// a handle at once.
unsafe impl<T> Send for Handle<T> {}
// SAFETY: as for `Send`: shared references only copy the handle out, under a mutex.
unsafe impl<T> Sync for Handle<T> {}

type Comm = Handle<ffi::MPI_Comm>;

/// The MPI environment, shared by every [`init`] of a process; MPI is finalised when the last
/// holder drops it (only if oxcomm initialised it).
struct MpiEnv {
    _universe: Option<Universe>,
}

/// The process's MPI environment while some communicator holds it.
static ENV: Mutex<Weak<MpiEnv>> = Mutex::new(Weak::new());

/// What a communicator over MPI holds: its MPI communicators and reduce ops.
pub(crate) struct MpiBackend {
    /// The MPI communicator of each oxcomm group, by group id (0: the world, whatever its
    /// epoch's id).
    comms: Mutex<HashMap<u64, Comm>>,
    /// A duplicate of the world for point-to-point messages.
    p2p: Comm,
    /// Headers a receive from any source took off a peer's stream and left for another
    /// receive (another tag's or group's), by world rank: at most one per peer, always older
    /// than any header still in MPI, so the next receive from that peer takes it first.
    p2p_held: Mutex<HashMap<usize, [u8; FP_BYTES]>>,
    /// User-defined reduce ops, created on first use.
    ops: Mutex<HashMap<(DType, ReduceOp), Handle<ffi::MPI_Op>>>,
    /// Whether ranks compare fingerprints before each collective.
    check: bool,
    threading: Threading,
    /// Whether ULFM revoked this backend's communicators ([`ulfm`]).
    revoked: AtomicBool,
    /// World ranks an agreement or a shrink found failed ([`ulfm`]).
    failed: Mutex<Vec<usize>>,
    /// Dropped last, after the communicators and ops above are freed.
    _env: Arc<MpiEnv>,
}

impl std::fmt::Debug for MpiBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiBackend").field("check", &self.check).field("threading", &self.threading).finish()
    }
}

impl Drop for MpiBackend {
    fn drop(&mut self) {
        if mpi::environment::is_finalized() {
            return;
        }
        let comms = self.comms.get_mut().unwrap_or_else(|e| e.into_inner());
        for (_, mut c) in comms.drain().chain(std::iter::once((0, self.p2p))) {
            // SAFETY: each handle is a communicator this backend created and nothing else
            // uses once the backend is dropped; MPI is still initialised.
            unsafe { ffi::MPI_Comm_free(&mut c.0) };
        }
        let ops = self.ops.get_mut().unwrap_or_else(|e| e.into_inner());
        for (_, mut op) in ops.drain() {
            // SAFETY: as above, for the ops this backend created.
            unsafe { ffi::MPI_Op_free(&mut op.0) };
        }
    }
}

/// Initialises MPI (or joins the running environment) and builds the backend of a world
/// communicator: `(rank, size, backend)`. Reads [`ENV_MPI_CHECK`].
pub(crate) fn start() -> Result<(usize, usize, MpiBackend)> {
    let check = match std::env::var(ENV_MPI_CHECK) {
        Err(_) => true,
        Ok(v) => match v.trim().to_ascii_lowercase().as_str() {
            "" | "1" | "true" | "on" => true,
            "0" | "false" | "off" => false,
            _ => return Err(Error::invalid(format!("{ENV_MPI_CHECK}={v}: expected 0 or 1"))),
        },
    };
    let (env, threading) = acquire_env()?;
    // SAFETY: MPI is initialised; RSMPI_COMM_WORLD is a constant set by rsmpi's C shim.
    let world = dup(unsafe { ffi::RSMPI_COMM_WORLD })?;
    let (rank, size, backend) = MpiBackend::over(world, env, threading, check)?;
    tracing::info!(target: "oxcomm::mpi", rank, size, ?threading, check, "joined over MPI");
    Ok((rank, size, backend))
}

impl MpiBackend {
    /// The backend whose world is `world` (a communicator that returns errors, which the
    /// backend frees when dropped): `(rank, size, backend)`.
    fn over(world: Comm, env: Arc<MpiEnv>, threading: Threading, check: bool) -> Result<(usize, usize, MpiBackend)> {
        let backend = MpiBackend {
            comms: Mutex::new(HashMap::from([(0, world)])),
            p2p: dup(world.0)?,
            p2p_held: Mutex::new(HashMap::new()),
            ops: Mutex::new(HashMap::new()),
            check,
            threading,
            revoked: AtomicBool::new(false),
            failed: Mutex::new(Vec::new()),
            _env: env,
        };
        let (mut rank, mut size): (c_int, c_int) = (0, 0);
        // SAFETY: `world` is a valid communicator; the out-pointers are valid.
        mpi_call("MPI_Comm_rank", unsafe { ffi::MPI_Comm_rank(world.0, &mut rank) })?;
        // SAFETY: as above.
        mpi_call("MPI_Comm_size", unsafe { ffi::MPI_Comm_size(world.0, &mut size) })?;
        Ok((rank as usize, size as usize, backend))
    }
}

/// Initialises MPI (asking for `MPI_THREAD_MULTIPLE`) or joins the running environment.
fn acquire_env() -> Result<(Arc<MpiEnv>, Threading)> {
    let mut held = ENV.lock().unwrap_or_else(|e| e.into_inner());
    let env = match held.upgrade() {
        Some(env) => env,
        None => {
            if mpi::environment::is_finalized() {
                return Err(Error::unsupported(
                    "MPI was already finalised in this process (the last MPI communicator was dropped); \
                     MPI cannot be initialised twice",
                ));
            }
            // `None` when the application initialised MPI itself: it also finalises it.
            let universe = mpi::initialize_with_threading(Threading::Multiple).map(|(u, _)| u);
            let env = Arc::new(MpiEnv { _universe: universe });
            *held = Arc::downgrade(&env);
            env
        }
    };
    let threading = mpi::environment::threading_support();
    if threading < Threading::Serialized {
        return Err(Error::unsupported(format!(
            "this MPI provides thread level {threading:?}; oxcomm needs at least MPI_THREAD_SERIALIZED \
             (async ops call MPI from a worker thread)"
        )));
    }
    Ok((env, threading))
}

/// Duplicates `comm` and makes errors on the duplicate return instead of aborting.
fn dup(comm: ffi::MPI_Comm) -> Result<Comm> {
    // SAFETY: a null handle is a valid place for MPI to write the new communicator.
    let mut out: ffi::MPI_Comm = unsafe { ffi::RSMPI_COMM_NULL };
    // SAFETY: `comm` is a valid communicator and `out` a valid out-pointer.
    mpi_call("MPI_Comm_dup", unsafe { ffi::MPI_Comm_dup(comm, &mut out) })?;
    // SAFETY: `out` is the communicator just created; RSMPI_ERRORS_RETURN is a constant.
    mpi_call("MPI_Comm_set_errhandler", unsafe { ffi::MPI_Comm_set_errhandler(out, ffi::RSMPI_ERRORS_RETURN) })?;
    Ok(Handle(out))
}

/// Turns an MPI return code into an error naming the call.
fn mpi_call(call: &str, rc: c_int) -> Result<()> {
    if rc == 0 {
        return Ok(());
    }
    let mut text = [0 as c_char; 1024];
    let mut len: c_int = 0;
    // SAFETY: the buffer holds more than MPI_MAX_ERROR_STRING (256 in Open MPI and MPICH)
    // characters; `len` is a valid out-pointer.
    unsafe { ffi::MPI_Error_string(rc, text.as_mut_ptr(), &mut len) };
    let bytes: Vec<u8> = text[..(len.clamp(0, 1024) as usize)].iter().map(|&c| c as u8).collect();
    Err(Error::new(ErrorKind::Io, format!("{call} failed: {} (MPI error code {rc})", String::from_utf8_lossy(&bytes))))
}

/// An element count as MPI's `int`.
fn count(n: usize) -> Result<c_int> {
    c_int::try_from(n).map_err(|_| {
        Error::invalid(format!("{n} elements in one MPI call: MPI counts are C ints (at most {})", c_int::MAX))
    })
}

/// What empty buffers point at (see [`sp`]).
static EMPTY: [u64; 1] = [0];

/// The send-buffer pointer of `s`. Rust points empty slices at their alignment (`0x1` for
/// bytes), which is Open MPI's `MPI_IN_PLACE`; empty slices get a real address instead.
fn sp<T>(s: &[T]) -> *const c_void {
    if s.is_empty() {
        EMPTY.as_ptr().cast()
    } else {
        s.as_ptr().cast()
    }
}

/// The receive-buffer pointer of `s` (see [`sp`]). For an empty slice MPI writes nothing.
fn rp<T>(s: &mut [T]) -> *mut c_void {
    if s.is_empty() {
        EMPTY.as_ptr().cast_mut().cast()
    } else {
        s.as_mut_ptr().cast()
    }
}

/// `MPI_IN_PLACE`.
fn in_place() -> *mut c_void {
    // SAFETY: a C function without arguments that returns a constant.
    unsafe { oxcomm_mpi_in_place() }
}

/// The MPI datatype that carries `d` (f16 and bf16 as 16-bit words, float8 as bytes: they
/// are only moved).
fn datatype(d: DType) -> ffi::MPI_Datatype {
    // SAFETY: read-only constants set by rsmpi's C shim.
    unsafe {
        match d {
            DType::F32 => ffi::RSMPI_FLOAT,
            DType::F64 => ffi::RSMPI_DOUBLE,
            DType::F16 | DType::BF16 => ffi::RSMPI_UINT16_T,
            DType::I8 => ffi::RSMPI_INT8_T,
            DType::U8 => ffi::RSMPI_UINT8_T,
            DType::I32 => ffi::RSMPI_INT32_T,
            DType::I64 => ffi::RSMPI_INT64_T,
            DType::Bool => ffi::RSMPI_C_BOOL,
            DType::I16 => ffi::RSMPI_INT16_T,
            DType::U16 => ffi::RSMPI_UINT16_T,
            DType::U32 => ffi::RSMPI_UINT32_T,
            DType::U64 => ffi::RSMPI_UINT64_T,
            DType::C64 => ffi::RSMPI_FLOAT_COMPLEX,
            DType::C128 => ffi::RSMPI_DOUBLE_COMPLEX,
            DType::F8E4M3Fn | DType::F8E5M2 | DType::F8E4M3Fnuz | DType::F8E5M2Fnuz | DType::F8E8M0Fnu => {
                ffi::RSMPI_UINT8_T
            }
        }
    }
}

fn bytes_type() -> ffi::MPI_Datatype {
    datatype(DType::U8)
}

fn u64_type() -> ffi::MPI_Datatype {
    // SAFETY: a read-only constant set by rsmpi's C shim.
    unsafe { ffi::RSMPI_UINT64_T }
}

/// `MPI_User_function` applying oxcomm's kernel for `T` and the op with tag `OP`:
/// `inout[i] = OP(inout[i], in[i])`. Registered as commutative (every oxcomm op is).
unsafe extern "C" fn combine<T: Element, const OP: u8>(
    invec: *mut c_void,
    inoutvec: *mut c_void,
    len: *mut c_int,
    _datatype: *mut ffi::MPI_Datatype,
) {
    let Some(op) = ReduceOp::from_tag(OP) else { return };
    // SAFETY: MPI passes a valid pointer to the element count.
    let n = unsafe { *len }.max(0) as usize;
    if n == 0 {
        return;
    }
    let bytes = n * std::mem::size_of::<T>();
    // SAFETY: MPI passes two distinct buffers of `n` elements of the datatype this op was
    // created for, which `MpiBackend::op` only ever pairs with `T` (same size and layout).
    let (src, dst) = unsafe {
        (
            std::slice::from_raw_parts(invec as *const u8, bytes),
            std::slice::from_raw_parts_mut(inoutvec as *mut u8, bytes),
        )
    };
    match (bytemuck::try_cast_slice::<u8, T>(src), bytemuck::try_cast_slice_mut::<u8, T>(dst)) {
        (Ok(s), Ok(d)) => reduce::reduce_into(d, s, op),
        // MPI's temporary buffers may be less aligned than T: combine through aligned copies.
        _ => {
            let s: Vec<T> = bytemuck::pod_collect_to_vec(src);
            let mut d: Vec<T> = bytemuck::pod_collect_to_vec(dst);
            reduce::reduce_into(&mut d, &s, op);
            dst.copy_from_slice(bytemuck::cast_slice(&d));
        }
    }
}

/// The user function for `T` and `op` (`Avg` combines as `Sum`).
fn user_function<T: Element>(op: ReduceOp) -> ffi::MPI_User_function {
    const SUM: u8 = ReduceOp::Sum as u8;
    const PROD: u8 = ReduceOp::Prod as u8;
    const MIN: u8 = ReduceOp::Min as u8;
    const MAX: u8 = ReduceOp::Max as u8;
    const BAND: u8 = ReduceOp::BAnd as u8;
    const BOR: u8 = ReduceOp::BOr as u8;
    const BXOR: u8 = ReduceOp::BXor as u8;
    Some(match op {
        ReduceOp::Sum | ReduceOp::Avg => combine::<T, SUM>,
        ReduceOp::Prod => combine::<T, PROD>,
        ReduceOp::Min => combine::<T, MIN>,
        ReduceOp::Max => combine::<T, MAX>,
        ReduceOp::BAnd => combine::<T, BAND>,
        ReduceOp::BOr => combine::<T, BOR>,
        ReduceOp::BXor => combine::<T, BXOR>,
    })
}

/// FNV-1a: a hash that is the same in every process (unlike the std hasher's contract).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// `(n−1)/n` of `bytes`: what one rank of a ring sends of a buffer of `bytes`.
fn ring_share(bytes: usize, n: usize) -> usize {
    bytes * (n - 1) / n
}

fn add(stats: &mut LinkStats, sent: usize, received: usize) {
    stats.bytes_sent += sent as u64;
    stats.bytes_received += received as u64;
}

/// Polls `req` until it completes or `deadline` passes (sleeping between polls, up to 1 ms).
/// Returns whether it completed.
fn wait_until(req: &mut ffi::MPI_Request, deadline: Instant, call: &str) -> Result<bool> {
    let mut pause = Duration::from_micros(20);
    loop {
        let mut done: c_int = 0;
        // SAFETY: `req` is an active request; STATUS_IGNORE is accepted for the status.
        mpi_call(call, unsafe { ffi::MPI_Test(req, &mut done, ffi::RSMPI_STATUS_IGNORE) })?;
        if done != 0 {
            return Ok(true);
        }
        let now = Instant::now();
        if now >= deadline {
            return Ok(false);
        }
        std::thread::sleep(pause.min(deadline - now));
        pause = (pause * 2).min(Duration::from_millis(1));
    }
}

/// Waits for every request in `reqs`.
fn wait_all(reqs: &mut [ffi::MPI_Request], call: &str) -> Result<()> {
    let n = count(reqs.len())?;
    // SAFETY: `reqs` holds `n` requests (active or null); STATUSES_IGNORE is accepted.
    mpi_call(call, unsafe { ffi::MPI_Waitall(n, reqs.as_mut_ptr(), ffi::RSMPI_STATUSES_IGNORE) })
}

impl MpiBackend {
    /// The MPI communicator of group `g`. Even ids are the world's (0, then a new one per
    /// shrink: `comm/ft.rs`), kept under 0; odd ones are groups made from it.
    fn comm_of(&self, g: &GroupView<'_>) -> Result<Comm> {
        let key = if g.id % 2 == 0 { 0 } else { g.id };
        let comms = self.comms.lock().unwrap_or_else(|e| e.into_inner());
        comms.get(&key).copied().ok_or_else(|| Error::invalid(format!("group {:x} has no MPI communicator", g.id)))
    }

    /// The MPI reduce op for `T` and `op` (`Avg` reduces as `Sum`); see the module docs.
    fn op<T: Element>(&self, op: ReduceOp) -> Result<ffi::MPI_Op> {
        let op = op.combiner();
        let d = T::DTYPE;
        // Bool (torch's logical ops on any non-zero byte) and complex (oxcomm's product, bit for
        // bit) reduce with oxcomm's kernels too.
        let user = matches!(d, DType::F16 | DType::BF16 | DType::Bool | DType::C64 | DType::C128)
            || (d.is_float() && matches!(op, ReduceOp::Min | ReduceOp::Max));
        if !user {
            // SAFETY: read-only constants set by rsmpi's C shim.
            return Ok(unsafe {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => ffi::RSMPI_SUM,
                    ReduceOp::Prod => ffi::RSMPI_PROD,
                    ReduceOp::Min => ffi::RSMPI_MIN,
                    ReduceOp::Max => ffi::RSMPI_MAX,
                    ReduceOp::BAnd => ffi::RSMPI_BAND,
                    ReduceOp::BOr => ffi::RSMPI_BOR,
                    ReduceOp::BXor => ffi::RSMPI_BXOR,
                }
            });
        }
        let mut ops = self.ops.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(h) = ops.get(&(d, op)) {
            return Ok(h.0);
        }
        // SAFETY: a read-only constant, only a placeholder that MPI_Op_create overwrites.
        let mut out: ffi::MPI_Op = unsafe { ffi::RSMPI_SUM };
        // SAFETY: `combine::<T, _>` has the MPI_User_function signature and stays valid for
        // the life of the program; `out` is a valid out-pointer.
        mpi_call("MPI_Op_create", unsafe { ffi::MPI_Op_create(user_function::<T>(op), 1, &mut out) })?;
        ops.insert((d, op), Handle(out));
        Ok(out)
    }

    /// The group's communicator, after checking that every rank runs the same op.
    fn prepare(&self, g: &GroupView<'_>, fp: &Fingerprint) -> Result<ffi::MPI_Comm> {
        let c = self.comm_of(g)?.0;
        if self.check && g.size() > 1 {
            let mine = fp.encode();
            let h = fnv1a(&mine);
            let send = [h, !h];
            let mut got = [0u64; 2];
            // SAFETY: two u64 in, two out, distinct buffers; `c` is the group's communicator.
            mpi_call("MPI_Allreduce (fingerprint check)", unsafe {
                ffi::MPI_Allreduce(send.as_ptr().cast(), got.as_mut_ptr().cast(), 2, u64_type(), ffi::RSMPI_MAX, c)
            })?;
            if got[0] != h || !got[1] != h {
                return Err(self.mismatch(g, c, fp));
            }
        }
        Ok(c)
    }

    /// After hashes differed: gathers every rank's fingerprint and names one that differs.
    fn mismatch(&self, g: &GroupView<'_>, c: ffi::MPI_Comm, fp: &Fingerprint) -> Error {
        let n = g.size();
        let mine = fp.encode();
        let mut all = vec![0u8; FP_BYTES * n];
        // SAFETY: FP_BYTES bytes in, FP_BYTES per rank out into a buffer of n × FP_BYTES.
        let rc = unsafe {
            ffi::MPI_Allgather(
                mine.as_ptr().cast(),
                FP_BYTES as c_int,
                bytes_type(),
                all.as_mut_ptr().cast(),
                FP_BYTES as c_int,
                bytes_type(),
                c,
            )
        };
        if let Err(e) = mpi_call("MPI_Allgather (fingerprints)", rc) {
            return e;
        }
        let other = all.chunks_exact(FP_BYTES).enumerate().find_map(|(r, b)| match Fingerprint::decode(b) {
            Ok(theirs) if theirs == *fp => None,
            theirs => Some((r, theirs)),
        });
        match other {
            Some((r, theirs)) => {
                let who = g.members[r];
                let what = theirs.map_or_else(|e| e.to_string(), |t| t.to_string());
                Error::new(
                    ErrorKind::Mismatch,
                    format!("ranks called different collectives: rank {who} called {what}, this rank called {fp}"),
                )
                .with_peer(who)
            }
            None => Error::new(ErrorKind::Mismatch, "ranks called different collectives (fingerprint hashes differ)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv_is_stable() {
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn ring_share_is_n_minus_one_over_n() {
        assert_eq!(ring_share(1024, 4), 768);
        assert_eq!(ring_share(1024, 1), 0);
    }

    #[test]
    fn user_function_reduces_f16_like_the_native_kernel() {
        use half::f16;
        let a: Vec<f16> = [1.0f32, 2.0, -3.0].iter().map(|&x| f16::from_f32(x)).collect();
        let mut b: Vec<f16> = [4.0f32, -1.0, 0.5].iter().map(|&x| f16::from_f32(x)).collect();
        let mut want = b.clone();
        reduce::reduce_into(&mut want, &a, ReduceOp::Max);
        let f = user_function::<f16>(ReduceOp::Max).expect("a function");
        let mut len: c_int = 3;
        // SAFETY: two buffers of 3 f16 and a valid count, as MPI would pass them.
        unsafe { f(a.as_ptr() as *mut c_void, b.as_mut_ptr().cast(), &mut len, std::ptr::null_mut()) };
        assert_eq!(b, want);
    }
}
