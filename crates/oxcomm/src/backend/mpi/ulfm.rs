//! ULFM, MPI's fault-tolerance extension (`MPIX_Comm_revoke`, `MPIX_Comm_agree`,
//! `MPIX_Comm_shrink`, `MPIX_Comm_failure_ack`, `MPIX_Comm_failure_get_acked`), found at run
//! time: [`Ulfm::get`] looks the five functions up in the process (`dlsym(RTLD_DEFAULT)`), so
//! one build runs on an MPI library with ULFM and on one without, and building needs no ULFM
//! header. The backend's revoke, agree and shrink call them ([`super::ops`]); without them,
//! they are [`crate::ErrorKind::Unsupported`] errors naming ULFM and why.
//!
//! A library that exports the names is not enough: MPICH's `ch4` device (Debian's and most
//! distributions' MPICH 4) exports all five, and each aborts the process
//! (`MPID_Comm_revoke` and its siblings are `MPIR_Assert(0)` in `src/mpid/ch4/src/ch4_comm.c`;
//! measured with MPICH 4.0.2, `ch4:ucx`). So an MPICH whose version string names a `ch4`
//! device counts as one without ULFM; MPICH's `ch3` device and Open MPI 5's ULFM build are
//! the libraries that have it.

use std::ffi::{c_int, CStr};
use std::sync::atomic::Ordering;
use std::sync::OnceLock;

use mpi::environment::Threading;
use mpi::ffi;

use super::{mpi_call, Comm, Handle, MpiBackend};
use crate::error::{Error, ErrorKind, Result};

type CommFn = unsafe extern "C" fn(ffi::MPI_Comm) -> c_int;
type AgreeFn = unsafe extern "C" fn(ffi::MPI_Comm, *mut c_int) -> c_int;
type ShrinkFn = unsafe extern "C" fn(ffi::MPI_Comm, *mut ffi::MPI_Comm) -> c_int;
type AckedFn = unsafe extern "C" fn(ffi::MPI_Comm, *mut ffi::MPI_Group) -> c_int;

/// The ULFM functions of the MPI library this process runs on.
pub(super) struct Ulfm {
    /// `MPIX_Comm_revoke(comm)`.
    pub revoke: CommFn,
    /// `MPIX_Comm_agree(comm, &mut flag)`: the bitwise AND of the live members' flags.
    pub agree: AgreeFn,
    /// `MPIX_Comm_shrink(comm, &mut newcomm)`: the survivors, in the old order.
    pub shrink: ShrinkFn,
    /// `MPIX_Comm_failure_ack(comm)`.
    pub failure_ack: CommFn,
    /// `MPIX_Comm_failure_get_acked(comm, &mut group)`: the failed members acknowledged.
    pub failure_get_acked: AckedFn,
}

/// What [`Ulfm::get`] found, looked up once per process (after MPI is initialised).
static FOUND: OnceLock<std::result::Result<Ulfm, String>> = OnceLock::new();

impl Ulfm {
    /// The library's ULFM functions, or why there are none (a sentence for the error).
    /// Call only while MPI is initialised (it reads the library's version string).
    pub(super) fn get() -> std::result::Result<&'static Ulfm, &'static str> {
        FOUND.get_or_init(find).as_ref().map_err(String::as_str)
    }
}

/// Looks the five functions up, unless the library is one whose ULFM aborts (see the module
/// docs).
fn find() -> std::result::Result<Ulfm, String> {
    let version = mpi::environment::library_version().unwrap_or_default();
    if let Some(device) = mpich_ch4_device(&version) {
        return Err(format!(
            "MPICH's {device} device exports the MPIX_Comm_* names but aborts the process in each of them \
             (they are unimplemented there); ULFM needs MPICH built with the ch3 device or Open MPI 5"
        ));
    }
    // SAFETY: each named function, if the library has it, has the signature of the ULFM
    // specification that its type spells with the MPI_Comm and MPI_Group of the bindings this
    // crate is built against, which are the same library's.
    let ulfm = unsafe {
        Ulfm {
            revoke: lookup(c"MPIX_Comm_revoke")?,
            agree: lookup(c"MPIX_Comm_agree")?,
            shrink: lookup(c"MPIX_Comm_shrink")?,
            failure_ack: lookup(c"MPIX_Comm_failure_ack")?,
            failure_get_acked: lookup(c"MPIX_Comm_failure_get_acked")?,
        }
    };
    Ok(ulfm)
}

/// The device of an MPICH whose version string names a `ch4` one (`ch4:ucx`, `ch4:ofi`).
fn mpich_ch4_device(version: &str) -> Option<String> {
    if !version.contains("MPICH") {
        return None;
    }
    let device = version.lines().find_map(|l| l.trim().strip_prefix("MPICH Device:"))?.trim();
    device.starts_with("ch4").then(|| device.to_string())
}

/// The function `name` of the process's libraries, as a `F`.
///
/// # Safety
///
/// `F` must be a function-pointer type matching the C function `name` where it exists.
#[cfg(target_os = "linux")]
unsafe fn lookup<F: Copy>(name: &CStr) -> std::result::Result<F, String> {
    // SAFETY: dlsym with RTLD_DEFAULT searches the loaded libraries for a NUL-terminated name.
    let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
    if p.is_null() {
        return Err(format!("this MPI library does not export {}", name.to_string_lossy()));
    }
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut libc::c_void>());
    // SAFETY: `p` is the non-null address of `name`, whose type the caller guarantees is `F`
    // (a function pointer, the size of a data pointer: checked above).
    Ok(unsafe { std::mem::transmute_copy::<*mut libc::c_void, F>(&p) })
}

#[cfg(not(target_os = "linux"))]
unsafe fn lookup<F: Copy>(name: &CStr) -> std::result::Result<F, String> {
    Err(format!("oxcomm looks {} up only on Linux", name.to_string_lossy()))
}

impl MpiBackend {
    /// The library's ULFM, or an [`ErrorKind::Unsupported`] error naming ULFM and why not.
    /// ULFM revokes from whichever thread fails first, so it also needs `MPI_THREAD_MULTIPLE`.
    pub(super) fn ulfm(&self, what: &str) -> Result<&'static Ulfm> {
        let ulfm = Ulfm::get().map_err(|why| no_ulfm(what, why))?;
        if self.threading < Threading::Multiple {
            let why = format!(
                "this MPI gives thread level {:?}, and revoking from the thread that fails needs MPI_THREAD_MULTIPLE",
                self.threading
            );
            return Err(no_ulfm(what, &why));
        }
        Ok(ulfm)
    }

    /// `MPIX_Comm_revoke` of every communicator of this backend (its world, its groups, its
    /// point-to-point one), once; nothing without ULFM.
    pub(super) fn ulfm_revoke(&self) {
        let Ok(ulfm) = self.ulfm("revoke") else { return };
        if self.revoked.swap(true, Ordering::SeqCst) || mpi::environment::is_finalized() {
            return;
        }
        let comms: Vec<Comm> = self.comms.lock().unwrap_or_else(|e| e.into_inner()).values().copied().collect();
        for c in comms.into_iter().chain(std::iter::once(self.p2p)) {
            // SAFETY: `c` is a communicator of this backend, not yet freed (the backend is
            // alive); MPI is initialised with MPI_THREAD_MULTIPLE (checked by `ulfm`).
            let rc = unsafe { (ulfm.revoke)(c.0) };
            if let Err(e) = mpi_call("MPIX_Comm_revoke", rc) {
                tracing::debug!(target: "oxcomm::mpi", error = %e, "revoke");
            }
        }
    }

    /// ULFM's agreement over this backend's world (`n` members): acknowledges the failures
    /// this rank knows, then agrees (`MPIX_Comm_agree`, a bitwise AND of 32-bit words) on the
    /// two halves of `flag` and on one bit per member that no survivor has acknowledged as
    /// failed, so every survivor returns the same flag and the same failed world ranks. An
    /// agreement that reports a new failure is run again (at most `n` times).
    pub(super) fn ulfm_agree(&self, members: &[usize], flag: u64) -> Result<(u64, Vec<usize>)> {
        let ulfm = self.ulfm("agree")?;
        let world = self.world()?;
        let n = members.len();
        let mut last = None;
        for _ in 0..=n {
            // SAFETY: `world` is this backend's world communicator.
            mpi_call("MPIX_Comm_failure_ack", unsafe { (ulfm.failure_ack)(world.0) })?;
            let acked = acked_failed(ulfm, world.0)?;
            let mut words = vec![flag as u32, (flag >> 32) as u32];
            words.extend((0..n).step_by(32).map(|start| {
                (start..n.min(start + 32)).filter(|r| !acked.contains(r)).fold(0u32, |w, r| w | 1 << (r - start))
            }));
            let agreed = words.iter_mut().try_for_each(|w| {
                let mut v = *w as c_int;
                // SAFETY: `world` is valid and `v` a valid in/out flag.
                mpi_call("MPIX_Comm_agree", unsafe { (ulfm.agree)(world.0, &mut v) })?;
                *w = v as u32;
                Ok(())
            });
            match agreed {
                Ok(()) => {
                    let failed: Vec<usize> =
                        (0..n).filter(|r| words[2 + r / 32] & (1 << (r % 32)) == 0).map(|r| members[r]).collect();
                    self.note_failed(&failed);
                    return Ok((u64::from(words[0]) | u64::from(words[1]) << 32, failed));
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| Error::new(ErrorKind::Io, "MPIX_Comm_agree did not settle")))
    }

    /// `MPIX_Comm_shrink` of this backend's world: the survivors' backend, this rank among
    /// them, and their old world ranks in their (old) order.
    pub(super) fn ulfm_shrink(&self) -> Result<(usize, Vec<usize>, MpiBackend)> {
        let ulfm = self.ulfm("shrink")?;
        let world = self.world()?;
        // SAFETY: a null handle is a valid place for MPI to write the new communicator.
        let mut out: ffi::MPI_Comm = unsafe { ffi::RSMPI_COMM_NULL };
        // SAFETY: `world` is valid and `out` a valid out-pointer.
        mpi_call("MPIX_Comm_shrink", unsafe { (ulfm.shrink)(world.0, &mut out) })?;
        // SAFETY: `out` is the communicator just created; RSMPI_ERRORS_RETURN is a constant.
        mpi_call("MPI_Comm_set_errhandler", unsafe { ffi::MPI_Comm_set_errhandler(out, ffi::RSMPI_ERRORS_RETURN) })?;
        let (rank, _, backend) = MpiBackend::over(Handle(out), self._env.clone(), self.threading, self.check)?;
        let survivors = translate_all(out, world.0)?;
        let mut old_size: c_int = 0;
        // SAFETY: `world` is valid; the out-pointer is valid.
        mpi_call("MPI_Comm_size", unsafe { ffi::MPI_Comm_size(world.0, &mut old_size) })?;
        self.note_failed(&(0..old_size.max(0) as usize).filter(|r| !survivors.contains(r)).collect::<Vec<_>>());
        Ok((rank, survivors, backend))
    }

    /// The world ranks an agreement or a shrink found failed, and those acknowledged here.
    pub(super) fn ulfm_failed(&self) -> Vec<usize> {
        let mut failed = self.failed.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if let (Ok(ulfm), Ok(world)) = (Ulfm::get(), self.world()) {
            if self.threading == Threading::Multiple && !mpi::environment::is_finalized() {
                failed.extend(acked_failed(ulfm, world.0).unwrap_or_default());
            }
        }
        failed.sort_unstable();
        failed.dedup();
        failed
    }

    fn note_failed(&self, ranks: &[usize]) {
        let mut failed = self.failed.lock().unwrap_or_else(|e| e.into_inner());
        failed.extend_from_slice(ranks);
        failed.sort_unstable();
        failed.dedup();
    }

    /// This backend's world communicator.
    fn world(&self) -> Result<Comm> {
        let comms = self.comms.lock().unwrap_or_else(|e| e.into_inner());
        comms.get(&0).copied().ok_or_else(|| Error::invalid("the MPI backend has no world communicator"))
    }
}

/// The ranks in `comm` of the failed members this rank acknowledged
/// (`MPIX_Comm_failure_get_acked`).
fn acked_failed(ulfm: &Ulfm, comm: ffi::MPI_Comm) -> Result<Vec<usize>> {
    let mut group = std::mem::MaybeUninit::<ffi::MPI_Group>::uninit();
    // SAFETY: `comm` is valid; MPI writes the group handle.
    mpi_call("MPIX_Comm_failure_get_acked", unsafe { (ulfm.failure_get_acked)(comm, group.as_mut_ptr()) })?;
    // SAFETY: the call succeeded, so the handle is written.
    let mut group = unsafe { group.assume_init() };
    let ranks = translate(group, comm);
    free_group(&mut group);
    ranks
}

/// The rank in `to` of each member of `from` (a sub-communicator of `to`), in `from`'s order.
fn translate_all(from: ffi::MPI_Comm, to: ffi::MPI_Comm) -> Result<Vec<usize>> {
    let mut group = std::mem::MaybeUninit::<ffi::MPI_Group>::uninit();
    // SAFETY: `from` is valid; MPI writes the group handle.
    mpi_call("MPI_Comm_group", unsafe { ffi::MPI_Comm_group(from, group.as_mut_ptr()) })?;
    // SAFETY: the call succeeded, so the handle is written.
    let mut group = unsafe { group.assume_init() };
    let ranks = translate(group, to);
    free_group(&mut group);
    ranks
}

/// Frees a group MPI returned, unless it is the predefined empty group (which ULFM may return
/// for "no failures" and which must not be freed).
fn free_group(group: &mut ffi::MPI_Group) {
    // SAFETY: a read-only constant set by rsmpi's C shim.
    if *group != unsafe { ffi::RSMPI_GROUP_EMPTY } {
        // SAFETY: `group` is a group MPI returned to this rank, freed once.
        unsafe { ffi::MPI_Group_free(group) };
    }
}

/// The rank in `comm` of each member of `group` (all of them members of `comm`).
fn translate(group: ffi::MPI_Group, comm: ffi::MPI_Comm) -> Result<Vec<usize>> {
    let mut n: c_int = 0;
    // SAFETY: `group` is a valid group; `n` a valid out-pointer.
    mpi_call("MPI_Group_size", unsafe { ffi::MPI_Group_size(group, &mut n) })?;
    if n <= 0 {
        return Ok(Vec::new());
    }
    let mut to = std::mem::MaybeUninit::<ffi::MPI_Group>::uninit();
    // SAFETY: `comm` is valid; MPI writes the group handle.
    mpi_call("MPI_Comm_group", unsafe { ffi::MPI_Comm_group(comm, to.as_mut_ptr()) })?;
    // SAFETY: the call succeeded, so the handle is written.
    let mut to = unsafe { to.assume_init() };
    let from: Vec<c_int> = (0..n).collect();
    let mut out = vec![0 as c_int; n as usize];
    // SAFETY: `from` and `out` hold `n` ranks each; both groups are valid.
    let rc = unsafe { ffi::MPI_Group_translate_ranks(group, n, from.as_ptr(), to, out.as_mut_ptr()) };
    free_group(&mut to);
    mpi_call("MPI_Group_translate_ranks", rc)?;
    Ok(out.into_iter().filter(|&r| r >= 0).map(|r| r as usize).collect())
}

/// The error of a fault-tolerance call on the MPI backend without a usable ULFM (`why`),
/// naming the library by its version string.
pub(super) fn no_ulfm(what: &str, why: &str) -> Error {
    let library = mpi::environment::library_version().unwrap_or_else(|_| "an unknown MPI library".to_string());
    let library = library.lines().next().unwrap_or_default().trim().to_string();
    Error::unsupported(format!(
        "{what} on the MPI backend needs ULFM (MPIX_Comm_revoke, MPIX_Comm_agree, MPIX_Comm_shrink), which this MPI \
         library ({library}) does not offer: {why}; use the native backend (OXCOMM_BACKEND=native), which does"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mpich_ch4_is_told_from_ch3_and_open_mpi() {
        let ch4 = "MPICH Version:\t4.0.2\nMPICH Release date:\tThu Apr  7 2022\nMPICH Device:\tch4:ucx\n";
        assert_eq!(mpich_ch4_device(ch4).as_deref(), Some("ch4:ucx"));
        assert_eq!(mpich_ch4_device("MPICH Version:\t3.4\nMPICH Device:\tch3:sock\n"), None);
        assert_eq!(mpich_ch4_device("Open MPI v4.1.4, package: Debian OpenMPI"), None);
    }
}
