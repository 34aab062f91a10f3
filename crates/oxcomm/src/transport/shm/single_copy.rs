//! Single-copy reads from another process's memory: Linux's cross-memory attach
//! (`process_vm_readv`), which copies straight from the peer's pages into ours, once, where a
//! copy through shared memory copies twice. Open MPI's shared-memory transport uses the same
//! call (CMA) for large messages.
//!
//! The kernel allows it where this process may ptrace the peer (same user, and Yama's
//! `ptrace_scope` 0, or the peer made this process its tracer) and seccomp lets the call
//! through; [`super::workspace::ShmDirect::probe_peer`] finds out before any op relies on it.
//! A bad address from a peer fails the call (`EFAULT`), never this process.

use rustix::io::Errno;

/// Copies `dst.len()` bytes from address `remote` of process `pid` into `dst`.
pub(crate) fn read(pid: u32, remote: u64, dst: &mut [u8]) -> Result<(), Errno> {
    let pid = libc::pid_t::try_from(pid).map_err(|_| Errno::INVAL)?;
    let mut done = 0;
    while done < dst.len() {
        let local = libc::iovec { iov_base: dst[done..].as_mut_ptr().cast(), iov_len: dst.len() - done };
        let from = remote.checked_add(done as u64).ok_or(Errno::FAULT)?;
        let theirs = libc::iovec { iov_base: from as usize as *mut libc::c_void, iov_len: dst.len() - done };
        // SAFETY: `local` describes `dst[done..]`, memory of this process that we hold
        // mutably; `theirs` is only an address in the other process, which the kernel checks
        // (a bad one is EFAULT, not a fault here).
        let got = unsafe { libc::process_vm_readv(pid, &local, 1, &theirs, 1, 0) };
        match got {
            n if n > 0 => done += n as usize,
            0 => return Err(Errno::FAULT),
            _ => return Err(Errno::from_raw_os_error(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg_attr(miri, ignore = "process_vm_readv is a syscall Miri cannot run")]
    fn reads_this_process_and_refuses_bad_addresses() {
        let src: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        let me = rustix::process::getpid().as_raw_nonzero().get() as u32;
        read(me, src.as_ptr() as u64, &mut dst).unwrap();
        assert_eq!(dst, src);
        assert_eq!(read(me, 8, &mut dst[..8]), Err(Errno::FAULT));
        assert_eq!(read(me, u64::MAX - 2, &mut dst[..8]), Err(Errno::FAULT));
    }
}
