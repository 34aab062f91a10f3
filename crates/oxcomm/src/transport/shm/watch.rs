//! The death watcher: one thread per process that holds a pidfd of every peer process its
//! shared-memory links talk to and sleeps in `poll` on them, so that a peer's exit (SIGKILL
//! included) is known the moment the kernel reaps it, as a TCP reset tells a socket at once.
//!
//! This file owns that thread and its registrations. On a death it marks the peer gone (the
//! flag [`PeerProcess::gone`](super::link::PeerProcess) reads), bumps the process-local death
//! count of the waiting rank's segment ([`Segment::deaths`]) and rings that segment's bell:
//! a rank asleep in an op wakes, sees the count move ([`Doorbell::deaths`]) and checks its
//! peers at once instead of at its next periodic check (`engine::PEER_CHECK_INTERVAL`). It
//! knows nothing about links, errors or ops; what the rank reports is the link's business.
//!
//! Costs: nothing on the data path (no flag is read there that was not before); one thread
//! per process that has shared-memory peers in other processes, asleep in `poll`; one pidfd
//! per registered peer. Threads-as-ranks register nothing.
//!
//! Not guaranteed: where the thread cannot start or `pidfd_open`/`eventfd`/`poll` fail (old
//! kernels, seccomp), nothing is watched and deaths are found as before, by the periodic
//! check. A process forked from one that registered peers does not inherit the thread: its
//! own registrations start a new one.
//!
//! [`Doorbell::deaths`]: crate::transport::Doorbell::deaths

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use rustix::event::{eventfd, poll, EventfdFlags, PollFd, PollFlags};
use rustix::fd::OwnedFd;
use rustix::io::Errno;

use super::segment::Segment;

/// A watched peer process, held by its link: [`Watched::dead`] turns true (and stays so)
/// once the watcher has seen the process exit. Dropping it stops the watch.
pub(super) struct Watched {
    dead: Arc<AtomicBool>,
    watcher: Arc<Watcher>,
}

impl Watched {
    /// `true` once the watcher has seen the process exit. One load.
    pub(super) fn dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        // The watcher holds only a weak reference: wake it so that it closes its pidfd now.
        self.watcher.nudge();
    }
}

/// Watches the process behind `pidfd` (a pidfd of a peer, duplicated here) for the rank whose
/// own segment is `own`: on its exit, the returned handle's flag is set, `own`'s death count
/// bumped and `own`'s bell rung. `None` where the watcher cannot run (the caller then relies on
/// the periodic check alone).
pub(super) fn watch(pidfd: &OwnedFd, own: &Arc<Segment>) -> Option<Watched> {
    let watcher = watcher()?;
    let pidfd = pidfd.try_clone().ok()?;
    let dead = Arc::new(AtomicBool::new(false));
    let entry = Entry { pidfd, dead: Arc::downgrade(&dead), own: Arc::downgrade(own) };
    watcher.added.lock().unwrap_or_else(|e| e.into_inner()).push(entry);
    watcher.nudge();
    Some(Watched { dead, watcher })
}

/// One registration, as the watcher thread holds it.
struct Entry {
    pidfd: OwnedFd,
    /// The link's flag; gone once the link is dropped (then the entry is dropped too).
    dead: Weak<AtomicBool>,
    /// The segment whose bell to ring; weak, so the watcher never keeps a mapping alive.
    own: Weak<Segment>,
}

impl Entry {
    /// Announces the death: flag, count, bell, in that order (a waiter that sees the bell
    /// move sees the count, and one that sees the count sees the flag).
    fn announce(&self) {
        if let Some(dead) = self.dead.upgrade() {
            dead.store(true, Ordering::Release);
        }
        if let Some(own) = self.own.upgrade() {
            own.deaths().fetch_add(1, Ordering::AcqRel);
            own.bell().ring();
        }
    }
}

/// The process's watcher: registrations not yet taken by the thread, and the eventfd that
/// wakes it for them.
struct Watcher {
    added: Mutex<Vec<Entry>>,
    wake: OwnedFd,
}

impl Watcher {
    /// Wakes the thread (new registrations, or dropped ones to close).
    fn nudge(&self) {
        let _ = rustix::io::write(&self.wake, &1u64.to_ne_bytes());
    }

    /// The thread: polls the eventfd and every pidfd; announces each exit once, then drops
    /// the entry; drops entries whose link is gone.
    fn run(self: Arc<Watcher>) {
        let mut entries: Vec<Entry> = Vec::new();
        loop {
            let mut fds = Vec::with_capacity(entries.len() + 1);
            fds.push(PollFd::new(&self.wake, PollFlags::IN));
            fds.extend(entries.iter().map(|e| PollFd::new(&e.pidfd, PollFlags::IN)));
            match poll(&mut fds, None) {
                Ok(_) | Err(Errno::INTR) => {}
                // Cannot poll (should not happen with valid fds): the periodic check remains.
                Err(e) => {
                    tracing::warn!(target: "oxcomm::shm", error = %e,
                        "the peer death watcher stopped; peer deaths are found by the periodic check");
                    return;
                }
            }
            let woken = !fds[0].revents().is_empty();
            let exited: Vec<bool> = fds[1..].iter().map(|f| !f.revents().is_empty()).collect();
            drop(fds);
            let mut i = 0;
            entries.retain(|e| {
                let gone = exited[i];
                i += 1;
                if gone {
                    e.announce();
                }
                !gone && e.dead.strong_count() > 0
            });
            if woken {
                let mut buf = [0u8; 8];
                let _ = rustix::io::read(&self.wake, &mut buf);
                entries.append(&mut self.added.lock().unwrap_or_else(|e| e.into_inner()));
                entries.retain(|e| e.dead.strong_count() > 0);
            }
        }
    }
}

/// The process's watcher, started on first use (again in a forked child, which has no
/// thread); `None` where it cannot start.
fn watcher() -> Option<Arc<Watcher>> {
    if cfg!(miri) {
        return None;
    }
    static WATCHER: Mutex<Option<(rustix::process::Pid, Arc<Watcher>)>> = Mutex::new(None);
    let me = rustix::process::getpid();
    let mut slot = WATCHER.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((pid, w)) = slot.as_ref() {
        if *pid == me {
            return Some(w.clone());
        }
    }
    let wake = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK).ok()?;
    let w = Arc::new(Watcher { added: Mutex::new(Vec::new()), wake });
    let thread = w.clone();
    std::thread::Builder::new().name("oxcomm-shm-watch".into()).spawn(move || thread.run()).ok()?;
    tracing::debug!(target: "oxcomm::shm", "started the peer death watcher");
    *slot = Some((me, w.clone()));
    Some(w)
}

#[cfg(all(test, not(miri), not(loom)))]
mod tests {
    use super::*;

    /// A child process that exits when told: its death is announced on the flag at once,
    /// without anyone polling for it.
    #[test]
    fn a_death_sets_the_flag() {
        let mut child = std::process::Command::new("sleep").arg("600").spawn().expect("spawn sleep");
        let pid = rustix::process::Pid::from_raw(child.id() as i32).unwrap();
        let Ok(pidfd) = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()) else {
            // No pidfd on this kernel: nothing to watch (the link falls back likewise).
            child.kill().unwrap();
            child.wait().unwrap();
            return;
        };
        let dead = Arc::new(AtomicBool::new(false));
        let w = watcher().expect("watcher");
        w.added.lock().unwrap().push(Entry { pidfd, dead: Arc::downgrade(&dead), own: Weak::new() });
        w.nudge();
        assert!(!dead.load(Ordering::Acquire));
        child.kill().unwrap();
        child.wait().unwrap();
        let until = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while !dead.load(Ordering::Acquire) {
            assert!(std::time::Instant::now() < until, "the watcher did not see the exit");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}
