//! The MPI backend (cargo feature `mpi`): a [`Communicator`] whose ops are MPI calls.
//!
//! [`init`] initialises MPI (or joins an MPI the application already initialised), and
//! returns a world communicator whose every op maps onto one MPI collective on a duplicate of
//! `MPI_COMM_WORLD` (or of the group's communicator):
//!
//! | oxcomm | MPI |
//! | --- | --- |
//! | `all_reduce`, `all_reduce_coalesced` | `MPI_Allreduce` (in place) |
//! | `reduce` | `MPI_Reduce` (in place at the root) |
//! | `broadcast` | `MPI_Bcast` |
//! | `all_gather`, `all_gather_coalesced` | `MPI_Allgather` |
//! | `reduce_scatter` | `MPI_Reduce_scatter_block` |
//! | `all_to_all` / `all_to_all_v` | `MPI_Alltoall` / `MPI_Alltoallv` (after an exchange of counts) |
//! | `gather` / `scatter` | `MPI_Gather` / `MPI_Scatter` |
//! | `barrier` / `monitored_barrier` | `MPI_Barrier` / `MPI_Iallreduce` polled until the deadline |
//! | `send`, `recv`, `isend`, `irecv` | `MPI_Isend`/`MPI_Irecv` of a header, then of the payload |
//! | `new_group`, `split` | `MPI_Comm_split` of the parent group's communicator |
//!
//! What stays oxcomm's: argument validation, the order of ops on one rank (sync and async
//! alike), sequence numbers, error context, and the abort-on-first-error rule
//! ([`crate::comm`]). MPI picks its own algorithms and segment sizes: the algorithm and
//! segment settings of [`OpOptions`] and [`CommConfig`] are ignored. [`crate::compression`] works unchanged on top, since it only uses the
//! public [`Communicator`] API.
//!
//! # Types and reduce ops
//!
//! f32, f64, i8, u8, i32 and i64 travel as the matching MPI types and reduce with MPI's
//! built-in `SUM`, `PROD`, `MIN`, `MAX`, `BAND`, `BOR`, `BXOR`. **f16 and bf16** travel as
//! 16-bit words (half the bytes of an f32 staging copy) and reduce with a *user-defined MPI
//! op* that runs oxcomm's own kernel ([`crate::reduce::reduce_into`]: widen each pair to f32,
//! combine, round once), the same arithmetic as the native transports. Float `MIN`/`MAX` use a
//! user-defined op too, so NaN propagates as it does natively (MPI leaves NaN unspecified).
//! [`ReduceOp::Avg`], which MPI lacks, is `SUM` followed by a division by the group size
//! ([`crate::reduce::finish_avg`], truncating for integers), as natively. Results of float
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
//! oxcomm's. [`CommConfig::timeout`] still bounds waiting for this rank's earlier async ops,
//! and [`Communicator::monitored_barrier`] keeps its deadline (it polls a non-blocking
//! allreduce). The backend's communicators use `MPI_ERRORS_RETURN`, so a failing MPI call
//! comes back as an [`ErrorKind::Io`] error naming the call and MPI's message (and aborts
//! the communicator) instead of killing the process. rsmpi's safe wrappers discard return
//! codes, so the calls go through `mpi::ffi` directly.
//!
//! # Threads
//!
//! MPI is initialised with `MPI_THREAD_MULTIPLE` when the library offers it, else at least
//! `MPI_THREAD_SERIALIZED` is required ([`init`] fails otherwise). oxcomm needs no more than
//! serialized access: every op of a process, including async ops that run on the
//! communicator's worker thread, runs only when its turn comes, one at a time. Multiple
//! is asked for so that the application may use MPI itself from other threads.
//!
//! # Byte counts
//!
//! [`Communicator::stats`] counts, per op, the bytes each rank would hand to links in
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
//! MPI is finalised when the last communicator of the last [`init`] is dropped (if oxcomm
//! initialised it): drop it on the thread that called [`init`], before the process exits.
//! A process cannot initialise MPI again after that. Group communicators live until the
//! world communicator is dropped.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use mpi::environment::{Threading, Universe};
use mpi::ffi;

use crate::comm::{CommConfig, Communicator, OpOptions, P2pJob};
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
    /// The MPI communicator of each oxcomm group, by group id (0: the world).
    comms: Mutex<HashMap<u64, Comm>>,
    /// A duplicate of the world for point-to-point messages.
    p2p: Comm,
    /// User-defined reduce ops, created on first use.
    ops: Mutex<HashMap<(DType, ReduceOp), Handle<ffi::MPI_Op>>>,
    /// Whether ranks compare fingerprints before each collective.
    check: bool,
    threading: Threading,
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

/// Starts a world communicator over MPI with the default [`CommConfig`]. Run the program
/// with `mpirun -n N` or `srun -n N`; see the [module docs](self).
///
/// ```no_run
/// let comm = oxcomm::mpi::init()?;
/// let mut grads = vec![1.0f32; 1024];
/// comm.all_reduce(&mut grads, oxcomm::ReduceOp::Avg)?;
/// # Ok::<(), oxcomm::Error>(())
/// ```
pub fn init() -> Result<Communicator> {
    init_with(CommConfig::default())
}

/// [`init`] with explicit settings (only `timeout` matters: it bounds waiting for earlier
/// async ops and [`Communicator::monitored_barrier`]; MPI picks its own algorithms and
/// segments).
pub fn init_with(config: CommConfig) -> Result<Communicator> {
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
    let p2p = dup(world.0)?;
    let (mut rank, mut size): (c_int, c_int) = (0, 0);
    // SAFETY: `world` is a valid communicator; the out-pointers are valid.
    mpi_call("MPI_Comm_rank", unsafe { ffi::MPI_Comm_rank(world.0, &mut rank) })?;
    // SAFETY: as above.
    mpi_call("MPI_Comm_size", unsafe { ffi::MPI_Comm_size(world.0, &mut size) })?;
    tracing::info!(target: "oxcomm::mpi", rank, size, ?threading, check, "joined over MPI");
    let backend = Arc::new(MpiBackend {
        comms: Mutex::new(HashMap::from([(0, world)])),
        p2p,
        ops: Mutex::new(HashMap::new()),
        check,
        threading,
        _env: env,
    });
    Ok(Communicator::from_mpi(rank as usize, size as usize, backend, config))
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

/// The MPI datatype that carries `d` (f16 and bf16 as 16-bit words).
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
    /// The MPI communicator of `comm`'s group.
    fn comm_of(&self, comm: &Communicator) -> Result<Comm> {
        let comms = self.comms.lock().unwrap_or_else(|e| e.into_inner());
        comms
            .get(&comm.group_id())
            .copied()
            .ok_or_else(|| Error::invalid(format!("group {:x} has no MPI communicator", comm.group_id())))
    }

    /// The MPI reduce op for `T` and `op` (`Avg` reduces as `Sum`); see the module docs.
    fn op<T: Element>(&self, op: ReduceOp) -> Result<ffi::MPI_Op> {
        let op = op.combiner();
        let d = T::DTYPE;
        let user =
            matches!(d, DType::F16 | DType::BF16) || (d.is_float() && matches!(op, ReduceOp::Min | ReduceOp::Max));
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
    fn prepare(&self, comm: &Communicator, fp: &Fingerprint) -> Result<ffi::MPI_Comm> {
        let c = self.comm_of(comm)?.0;
        if self.check && comm.size() > 1 {
            let mine = fp.encode();
            let h = fnv1a(&mine);
            let send = [h, !h];
            let mut got = [0u64; 2];
            // SAFETY: two u64 in, two out, distinct buffers; `c` is the group's communicator.
            mpi_call("MPI_Allreduce (fingerprint check)", unsafe {
                ffi::MPI_Allreduce(send.as_ptr().cast(), got.as_mut_ptr().cast(), 2, u64_type(), ffi::RSMPI_MAX, c)
            })?;
            if got[0] != h || !got[1] != h {
                return Err(self.mismatch(comm, c, fp));
            }
        }
        Ok(c)
    }

    /// After hashes differed: gathers every rank's fingerprint and names one that differs.
    fn mismatch(&self, comm: &Communicator, c: ffi::MPI_Comm, fp: &Fingerprint) -> Error {
        let n = comm.size();
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
                let who = comm.members()[r];
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

    // ---------------------------------------------------------------- collectives

    pub(crate) fn all_reduce<T: Element>(
        &self,
        comm: &Communicator,
        fp: Fingerprint,
        buf: &mut [T],
        op: ReduceOp,
        opts: &OpOptions,
    ) -> Result<()> {
        comm.run_backend(fp, opts, |fp, stats| {
            let c = self.prepare(comm, fp)?;
            self.all_reduce_in(comm, c, buf, op, stats)
        })
    }

    /// `MPI_Allreduce` in place, then the division of `Avg`.
    fn all_reduce_in<T: Element>(
        &self,
        comm: &Communicator,
        c: ffi::MPI_Comm,
        buf: &mut [T],
        op: ReduceOp,
        stats: &mut LinkStats,
    ) -> Result<()> {
        let (n, mop, len) = (comm.size(), self.op::<T>(op)?, count(buf.len())?);
        // SAFETY: in place on `buf`, `len` elements of the datatype of T; `c` is valid.
        mpi_call("MPI_Allreduce", unsafe { ffi::MPI_Allreduce(in_place(), rp(buf), len, datatype(T::DTYPE), mop, c) })?;
        reduce::finish_avg(buf, op, n);
        let share = ring_share(2 * std::mem::size_of_val(buf), n);
        add(stats, share, share);
        Ok(())
    }

    pub(crate) fn reduce<T: Element>(
        &self,
        comm: &Communicator,
        fp: Fingerprint,
        buf: &mut [T],
        root: usize,
        op: ReduceOp,
        opts: &OpOptions,
    ) -> Result<()> {
        let (n, me) = (comm.size(), comm.rank());
        comm.run_backend(fp, opts, |fp, stats| {
            let c = self.prepare(comm, fp)?;
            let (mop, len, bytes) = (self.op::<T>(op)?, count(buf.len())?, std::mem::size_of_val(buf));
            let (send, recv): (*const c_void, *mut c_void) =
                if me == root { (in_place(), rp(buf)) } else { (sp(buf), std::ptr::null_mut()) };
            // SAFETY: at the root in place on `buf`; elsewhere `buf` is only read and the
            // receive buffer is ignored. `len` elements of T's datatype.
            mpi_call("MPI_Reduce", unsafe {
                ffi::MPI_Reduce(send, recv, len, datatype(T::DTYPE), mop, root as c_int, c)
            })?;
            if me == root {
                reduce::finish_avg(buf, op, n);
                add(stats, 0, (n - 1) * bytes);
            } else {
                add(stats, bytes, 0);
            }
            Ok(())
        })
    }

    pub(crate) fn broadcast<T: Element>(
        &self,
        comm: &Communicator,
        fp: Fingerprint,
        buf: &mut [T],
        root: usize,
        opts: &OpOptions,
    ) -> Result<()> {
        let (n, me) = (comm.size(), comm.rank());
        comm.run_backend(fp, opts, |fp, stats| {
            let c = self.prepare(comm, fp)?;
            let (len, bytes) = (count(buf.len())?, std::mem::size_of_val(buf));
            // SAFETY: `buf` holds `len` elements of T's datatype.
            mpi_call("MPI_Bcast", unsafe { ffi::MPI_Bcast(rp(buf), len, datatype(T::DTYPE), root as c_int, c) })?;
            if me == root {
                add(stats, (n - 1) * bytes, 0);
            } else {
                add(stats, 0, bytes);
            }
            Ok(())
        })
    }

    pub(crate) fn all_gather<T: Element>(
        &self,
        comm: &Communicator,
        fp: Fingerprint,
        input: &[T],
        output: &mut [T],
        opts: &OpOptions,
    ) -> Result<()> {
        comm.run_backend(fp, opts, |fp, stats| {
            let c = self.prepare(comm, fp)?;
            all_gather_in(comm, c, input, output, stats)
        })
    }

    pub(crate) fn reduce_scatter<T: Element>(
        &self,
        comm: &Communicator,
        fp: Fingerprint,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
        opts: &OpOptions,
    ) -> Result<()> {
        let n = comm.size();
        comm.run_backend(fp, opts, |fp, stats| {
            let c = self.prepare(comm, fp)?;
            let (mop, len) = (self.op::<T>(op)?, count(output.len())?);
            count(input.len())?;
            // SAFETY: `input` holds n × `len` elements, `output` `len`, of T's datatype; the
            // two are distinct.
            mpi_call("MPI_Reduce_scatter_block", unsafe {
                ffi::MPI_Reduce_scatter_block(sp(input), rp(output), len, datatype(T::DTYPE), mop, c)
            })?;
            reduce::finish_avg(output, op, n);
            let share = ring_share(std::mem::size_of_val(input), n);
            add(stats, share, share);
            Ok(())
        })
    }

    pub(crate) fn all_to_all<T: Element>(
        &self,
        comm: &Communicator,
        fp: Fingerprint,
        send: &[T],
        recv: &mut [T],
        opts: &OpOptions,
    ) -> Result<()> {
        let n = comm.size();
        comm.run_backend(fp, opts, |fp, stats| {
            let c = self.prepare(comm, fp)?;
            let block = count(send.len() / n)?;
            count(send.len())?;
            let dt = datatype(T::DTYPE);
            // SAFETY: `send` and `recv` each hold n blocks of `block` elements of T's datatype
            // and are distinct.
            mpi_call("MPI_Alltoall", unsafe { ffi::MPI_Alltoall(sp(send), block, dt, rp(recv), block, dt, c) })?;
            let share = ring_share(std::mem::size_of_val(send), n);
            add(stats, share, share);
            Ok(())
        })
    }

    /// Ranks first exchange their send counts (`MPI_Alltoall`) and agree (`MPI_Allreduce`)
    /// on whether any receiver expects a different count, so a disagreement fails on every
    /// rank, naming the peer, before any payload moves.
    pub(crate) fn all_to_all_v<T: Element>(
        &self,
        comm: &Communicator,
        fp: Fingerprint,
        send: &[T],
        send_counts: &[usize],
        recv: &mut [T],
        recv_counts: &[usize],
    ) -> Result<()> {
        let (n, me) = (comm.size(), comm.rank());
        comm.run_backend(fp, &OpOptions::default(), |fp, stats| {
            let c = self.prepare(comm, fp)?;
            count(send.len())?;
            count(recv.len())?;
            let mine: Vec<u64> = send_counts.iter().map(|&x| x as u64).collect();
            let mut theirs = vec![0u64; n];
            // SAFETY: one u64 to and from each rank; buffers of n u64, distinct.
            mpi_call("MPI_Alltoall (counts)", unsafe {
                ffi::MPI_Alltoall(mine.as_ptr().cast(), 1, u64_type(), theirs.as_mut_ptr().cast(), 1, u64_type(), c)
            })?;
            let bad = (0..n).find(|&p| theirs[p] != recv_counts[p] as u64);
            let flag = [bad.map_or(0u64, |_| me as u64 + 1)];
            let mut worst = [0u64];
            // SAFETY: one u64 in, one out.
            mpi_call("MPI_Allreduce (counts)", unsafe {
                ffi::MPI_Allreduce(flag.as_ptr().cast(), worst.as_mut_ptr().cast(), 1, u64_type(), ffi::RSMPI_MAX, c)
            })?;
            if let Some(p) = bad {
                let who = comm.members()[p];
                return Err(Error::new(
                    ErrorKind::Mismatch,
                    format!(
                        "rank {who} sends {} elements to this rank but recv_counts[{p}] = {}",
                        theirs[p], recv_counts[p]
                    ),
                )
                .with_peer(who));
            }
            if worst[0] > 0 {
                let who = comm.members()[worst[0] as usize - 1];
                return Err(Error::new(
                    ErrorKind::Mismatch,
                    format!("rank {who} found that a peer's send count differs from its recv count (see its error)"),
                )
                .with_peer(who));
            }
            let layout = |counts: &[usize]| -> (Vec<c_int>, Vec<c_int>) {
                let mut at = 0;
                counts
                    .iter()
                    .map(|&k| {
                        at += k;
                        (k as c_int, (at - k) as c_int)
                    })
                    .unzip()
            };
            let ((sc, sd), (rc, rd)) = (layout(send_counts), layout(recv_counts));
            let dt = datatype(T::DTYPE);
            // SAFETY: counts and displacements describe `send` and `recv` exactly (their
            // totals equal the lengths, checked by the caller, and fit a C int).
            mpi_call("MPI_Alltoallv", unsafe {
                ffi::MPI_Alltoallv(sp(send), sc.as_ptr(), sd.as_ptr(), dt, rp(recv), rc.as_ptr(), rd.as_ptr(), dt, c)
            })?;
            let size = std::mem::size_of::<T>();
            let others =
                |counts: &[usize]| counts.iter().enumerate().filter(|(p, _)| *p != me).map(|(_, k)| k).sum::<usize>();
            add(stats, others(send_counts) * size, others(recv_counts) * size);
            Ok(())
        })
    }

    pub(crate) fn gather<T: Element>(
        &self,
        comm: &Communicator,
        fp: Fingerprint,
        input: &[T],
        output: Option<&mut [T]>,
        root: usize,
    ) -> Result<()> {
        let n = comm.size();
        comm.run_backend(fp, &OpOptions::default(), |fp, stats| {
            let c = self.prepare(comm, fp)?;
            let (len, dt, bytes) = (count(input.len())?, datatype(T::DTYPE), std::mem::size_of_val(input));
            let out: *mut c_void = match output {
                Some(o) => {
                    count(o.len())?;
                    add(stats, 0, (n - 1) * bytes);
                    rp(o)
                }
                None => {
                    add(stats, bytes, 0);
                    std::ptr::null_mut()
                }
            };
            // SAFETY: `input` holds `len` elements; the root's `out` holds n × `len` (checked
            // by the caller) and is distinct; other ranks' receive buffer is ignored.
            mpi_call("MPI_Gather", unsafe { ffi::MPI_Gather(sp(input), len, dt, out, len, dt, root as c_int, c) })
        })
    }

    pub(crate) fn scatter<T: Element>(
        &self,
        comm: &Communicator,
        fp: Fingerprint,
        input: Option<&[T]>,
        output: &mut [T],
        root: usize,
    ) -> Result<()> {
        let n = comm.size();
        comm.run_backend(fp, &OpOptions::default(), |fp, stats| {
            let c = self.prepare(comm, fp)?;
            let (len, dt, bytes) = (count(output.len())?, datatype(T::DTYPE), std::mem::size_of_val(output));
            let inp: *const c_void = match input {
                Some(i) => {
                    count(i.len())?;
                    add(stats, (n - 1) * bytes, 0);
                    sp(i)
                }
                None => {
                    add(stats, 0, bytes);
                    std::ptr::null()
                }
            };
            // SAFETY: the root's `inp` holds n × `len` elements (checked by the caller) and
            // is distinct from `output`, which holds `len`; other ranks' send buffer is ignored.
            mpi_call("MPI_Scatter", unsafe { ffi::MPI_Scatter(inp, len, dt, rp(output), len, dt, root as c_int, c) })
        })
    }

    pub(crate) fn barrier(&self, comm: &Communicator, fp: Fingerprint, opts: &OpOptions) -> Result<()> {
        comm.run_backend(fp, opts, |fp, _| {
            let c = self.prepare(comm, fp)?;
            // SAFETY: `c` is the group's communicator.
            mpi_call("MPI_Barrier", unsafe { ffi::MPI_Barrier(c) })
        })
    }

    /// A barrier with a deadline: a non-blocking allreduce of the fingerprint hash (which is
    /// the fingerprint check too), polled until `timeout`. MPI cannot say who is missing.
    pub(crate) fn monitored_barrier(&self, comm: &Communicator, fp: Fingerprint, timeout: Duration) -> Result<()> {
        let opts = OpOptions { timeout: Some(timeout), ..OpOptions::default() };
        comm.run_backend(fp, &opts, |fp, _| {
            let deadline = Instant::now() + timeout;
            let c = self.comm_of(comm)?.0;
            let h = fnv1a(&fp.encode());
            // On the heap, and leaked if the deadline passes: MPI may still write them later.
            let mut bufs = Box::new(([h, !h], [0u64; 2]));
            // SAFETY: a null request is a valid place for MPI to write the new one.
            let mut req: ffi::MPI_Request = unsafe { ffi::RSMPI_REQUEST_NULL };
            // SAFETY: two u64 in and out, in a heap block that outlives the request (it is
            // leaked when the request is abandoned).
            mpi_call("MPI_Iallreduce (monitored barrier)", unsafe {
                ffi::MPI_Iallreduce(
                    bufs.0.as_ptr().cast(),
                    bufs.1.as_mut_ptr().cast(),
                    2,
                    u64_type(),
                    ffi::RSMPI_MAX,
                    c,
                    &mut req,
                )
            })?;
            match wait_until(&mut req, deadline, "MPI_Test (monitored barrier)") {
                Ok(true) => {}
                Ok(false) => {
                    std::mem::forget(bufs);
                    return Err(Error::new(
                        ErrorKind::Timeout,
                        format!(
                            "timed out after {timeout:?}: not every rank of the group reached the barrier \
                             (MPI cannot tell which)"
                        ),
                    ));
                }
                Err(e) => {
                    std::mem::forget(bufs);
                    return Err(e);
                }
            }
            let got = bufs.1;
            if self.check && (got[0] != h || !got[1] != h) {
                return Err(self.mismatch(comm, c, fp));
            }
            Ok(())
        })
    }

    pub(crate) fn all_reduce_coalesced<T: Element>(
        &self,
        comm: &Communicator,
        fp: Fingerprint,
        bufs: &mut [&mut [T]],
        op: ReduceOp,
    ) -> Result<()> {
        comm.run_backend(fp, &OpOptions::default(), |fp, stats| {
            let c = self.prepare(comm, fp)?;
            let mut flat: Vec<T> = bufs.iter().flat_map(|b| b.iter().copied()).collect();
            self.all_reduce_in(comm, c, &mut flat, op, stats)?;
            let mut at = 0;
            for b in bufs.iter_mut() {
                b.copy_from_slice(&flat[at..at + b.len()]);
                at += b.len();
            }
            Ok(())
        })
    }

    pub(crate) fn all_gather_coalesced<T: Element>(
        &self,
        comm: &Communicator,
        fp: Fingerprint,
        inputs: &[&[T]],
        outputs: &mut [&mut [T]],
    ) -> Result<()> {
        let n = comm.size();
        comm.run_backend(fp, &OpOptions::default(), |fp, stats| {
            let c = self.prepare(comm, fp)?;
            let flat: Vec<T> = inputs.iter().flat_map(|b| b.iter().copied()).collect();
            let total = flat.len();
            let mut all = vec![T::default(); total * n];
            all_gather_in(comm, c, &flat, &mut all, stats)?;
            for (p, block) in all.chunks(total.max(1)).enumerate().take(n) {
                let mut at = 0;
                for (i, out) in outputs.iter_mut().enumerate() {
                    let k = inputs[i].len();
                    out[p * k..(p + 1) * k].copy_from_slice(&block[at..at + k]);
                    at += k;
                }
            }
            Ok(())
        })
    }

    // ---------------------------------------------------------------- groups

    /// `MPI_Comm_split` of the parent's communicator: members get color 0 and their index in
    /// `ranks` as key, so MPI ranks equal group ranks.
    pub(crate) fn new_group(
        &self,
        comm: &Communicator,
        fp: Fingerprint,
        ranks: &[usize],
    ) -> Result<Option<Communicator>> {
        let pos = ranks.iter().position(|&r| r == comm.rank());
        let salt = fp.extra;
        let new = comm.run_backend(fp, &OpOptions::default(), |fp, _| {
            let c = self.prepare(comm, fp)?;
            split_comm(c, pos.map(|_| 0), pos.unwrap_or(0))
        })?;
        Ok(self.register(comm.subgroup(ranks, salt), new))
    }

    /// Gathers colors and keys (as the native `split`), orders each group by key then rank,
    /// and splits the parent's MPI communicator with the color's index among the colors
    /// present and the position in that order.
    pub(crate) fn split(
        &self,
        comm: &Communicator,
        fp: Fingerprint,
        color: Option<u32>,
        key: i64,
    ) -> Result<Option<Communicator>> {
        let mine = [color.map_or(-1, i64::from), key];
        let mut all = vec![0i64; 2 * comm.size()];
        comm.all_gather(&mine, &mut all)?;
        let (ranks, mpi_color) = match color {
            None => (Vec::new(), None),
            Some(color) => {
                let mut members: Vec<(i64, usize)> = all
                    .chunks(2)
                    .enumerate()
                    .filter(|(_, ck)| ck[0] == i64::from(color))
                    .map(|(r, ck)| (ck[1], r))
                    .collect();
                members.sort();
                let mut colors: Vec<i64> = all.chunks(2).map(|ck| ck[0]).filter(|&c| c >= 0).collect();
                colors.sort();
                colors.dedup();
                let index = colors.iter().position(|&c| c == i64::from(color)).unwrap_or(0);
                (members.into_iter().map(|(_, r)| r).collect(), Some(index))
            }
        };
        let pos = ranks.iter().position(|&r| r == comm.rank()).unwrap_or(0);
        let new = comm.run_backend(fp, &OpOptions::default(), |fp, _| {
            let c = self.prepare(comm, fp)?;
            split_comm(c, mpi_color, pos)
        })?;
        let Some(color) = color else { return Ok(None) };
        Ok(self.register(comm.subgroup(&ranks, 0x5eed_0000_0000 ^ u64::from(color)), new))
    }

    /// Records `new` as the MPI communicator of `sub`'s group.
    fn register(&self, sub: Option<Communicator>, new: Option<Comm>) -> Option<Communicator> {
        if let (Some(sub), Some(new)) = (&sub, new) {
            self.comms.lock().unwrap_or_else(|e| e.into_inner()).insert(sub.group_id(), new);
        }
        sub
    }

    // ---------------------------------------------------------------- point to point

    /// Runs a batch of sends and receives (world ranks) on the point-to-point communicator:
    /// every header both ways at once, a check of the received ones, then every payload.
    pub(crate) fn p2p(&self, jobs: &mut [P2pJob], stats: &mut LinkStats) -> Result<()> {
        let c = self.p2p.0;
        // Headers live on the heap, and are leaked (with the payloads) if a call fails while
        // requests are posted: MPI may still touch them.
        let mut headers: Vec<[u8; FP_BYTES]> =
            jobs.iter().map(|j| if j.is_send { j.header } else { [0u8; FP_BYTES] }).collect();
        let posted =
            post(c, jobs.iter().zip(headers.iter_mut()).map(|(j, h)| (j.peer, j.is_send, &mut h[..])), TAG_HEADER)
                .and_then(|mut reqs| wait_all(&mut reqs, "MPI_Waitall (p2p headers)"));
        if let Err(e) = posted {
            std::mem::forget(headers);
            leak_payloads(jobs);
            return Err(e);
        }
        for (job, got) in jobs.iter().zip(&headers) {
            if !job.is_send {
                job.check_header(got)?;
            }
        }
        let posted = post(c, jobs.iter_mut().map(|j| (j.peer, j.is_send, &mut j.bytes[..])), TAG_PAYLOAD)
            .and_then(|mut reqs| wait_all(&mut reqs, "MPI_Waitall (p2p payloads)"));
        if let Err(e) = posted {
            leak_payloads(jobs);
            return Err(e);
        }
        for job in jobs.iter() {
            let bytes = FP_BYTES + job.bytes.len();
            if job.is_send {
                add(stats, bytes, 0);
            } else {
                add(stats, 0, bytes);
            }
        }
        Ok(())
    }
}

/// Posts one `MPI_Isend` or `MPI_Irecv` of bytes per item; returns the requests.
fn post<'a>(
    c: ffi::MPI_Comm,
    items: impl Iterator<Item = (usize, bool, &'a mut [u8])>,
    tag: c_int,
) -> Result<Vec<ffi::MPI_Request>> {
    let mut reqs = Vec::new();
    for (peer, is_send, buf) in items {
        let len = count(buf.len())?;
        // SAFETY: a null request is a valid place for MPI to write the new one.
        let mut req: ffi::MPI_Request = unsafe { ffi::RSMPI_REQUEST_NULL };
        // SAFETY: `buf` holds `len` bytes and outlives the request (the caller waits for it,
        // or leaks the buffer); `peer` is a rank of `c`.
        let rc = unsafe {
            if is_send {
                ffi::MPI_Isend(sp(buf), len, bytes_type(), peer as c_int, tag, c, &mut req)
            } else {
                ffi::MPI_Irecv(rp(buf), len, bytes_type(), peer as c_int, tag, c, &mut req)
            }
        };
        mpi_call(if is_send { "MPI_Isend" } else { "MPI_Irecv" }, rc)?;
        reqs.push(req);
    }
    Ok(reqs)
}

/// Leaks every payload buffer of `jobs` (MPI may still write them after a failed call).
fn leak_payloads(jobs: &mut [P2pJob]) {
    for job in jobs {
        std::mem::forget(std::mem::take(&mut job.bytes));
    }
}

/// `MPI_Allgather` of `input` into `output` (n × input).
fn all_gather_in<T: Element>(
    comm: &Communicator,
    c: ffi::MPI_Comm,
    input: &[T],
    output: &mut [T],
    stats: &mut LinkStats,
) -> Result<()> {
    let (len, dt) = (count(input.len())?, datatype(T::DTYPE));
    count(output.len())?;
    // SAFETY: `input` holds `len` elements, `output` n × `len` (checked by the caller), of
    // T's datatype; the two are distinct.
    mpi_call("MPI_Allgather", unsafe { ffi::MPI_Allgather(sp(input), len, dt, rp(output), len, dt, c) })?;
    let share = (comm.size() - 1) * std::mem::size_of_val(input);
    add(stats, share, share);
    Ok(())
}

/// `MPI_Comm_split(c, color or MPI_UNDEFINED, key)`; the new communicator returns errors.
fn split_comm(c: ffi::MPI_Comm, color: Option<usize>, key: usize) -> Result<Option<Comm>> {
    // SAFETY: a read-only constant set by rsmpi's C shim.
    let undefined = unsafe { ffi::RSMPI_UNDEFINED };
    let color = match color {
        Some(k) => c_int::try_from(k).map_err(|_| Error::invalid("too many colors for MPI"))?,
        None => undefined,
    };
    let key = c_int::try_from(key).map_err(|_| Error::invalid("too many ranks for MPI"))?;
    // SAFETY: a null handle is a valid place for MPI to write the new communicator.
    let mut out: ffi::MPI_Comm = unsafe { ffi::RSMPI_COMM_NULL };
    // SAFETY: `c` is a valid communicator and `out` a valid out-pointer.
    mpi_call("MPI_Comm_split", unsafe { ffi::MPI_Comm_split(c, color, key, &mut out) })?;
    if color == undefined {
        return Ok(None);
    }
    // SAFETY: `out` is the communicator just created; RSMPI_ERRORS_RETURN is a constant.
    mpi_call("MPI_Comm_set_errhandler", unsafe { ffi::MPI_Comm_set_errhandler(out, ffi::RSMPI_ERRORS_RETURN) })?;
    Ok(Some(Handle(out)))
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
