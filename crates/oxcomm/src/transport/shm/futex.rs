//! The shared-memory doorbell: a counter in a mapped segment that peers ring and the owner
//! sleeps on with a process-shared futex.
//!
//! This file owns the wait/ring protocol on a [`Bell`]; it does not know where the bell lives
//! (the segment does) or which links ring it.
//!
//! # Protocol
//!
//! Ringing increments `epoch` and, only when `waiters` is non-zero, issues `FUTEX_WAKE`. The
//! owner waits by spinning briefly on `epoch`, yielding a few times, then registering in
//! `waiters` and calling `FUTEX_WAIT(epoch, expected)` with a timeout bounded by the deadline.
//! Both sides use `SeqCst` for "store mine, then load theirs" (ringer: `epoch` then `waiters`;
//! sleeper: `waiters` then `epoch`), so at least one of them sees the other: either the ringer
//! sees a waiter and wakes it, or the sleeper sees the new epoch and does not sleep (and the
//! kernel re-checks `epoch` atomically inside `FUTEX_WAIT` anyway). The futex is *shared* (no
//! `FUTEX_PRIVATE_FLAG`) because ringers live in other processes.
//!
//! Events the owner can check directly (the direct collectives' stamps and counters) may skip
//! the ring while the owner is awake ([`Bell::ring_if_sleeping`]: store the event, fence, ring
//! only if `waiters` is non-zero); the owner then waits with [`Bell::wait_ready`], which checks
//! the event in every phase and once more after registering in `waiters` (behind a fence), so
//! again one of the two sees the other.
//!
//! The spin phase is short (a few µs, [`super::ShmConfig::spin`]) because ranks often
//! outnumber cores: a long spin would steal the core from the very peer we wait for.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::io::Errno;
use rustix::thread::futex;

use super::layout::Bell;
use super::segment::Segment;
use crate::transport::Doorbell;

/// Yields after the spin phase, before sleeping, at least this many times.
const MIN_YIELDS: u32 = 4;

impl Bell {
    /// Increments the counter; wakes sleepers if any are registered.
    pub(crate) fn ring(&self) {
        self.epoch.fetch_add(1, Ordering::SeqCst);
        if self.waiters.load(Ordering::SeqCst) > 0 {
            // Errors (none expected for a valid, mapped address) leave sleepers to their
            // timeout, which is bounded by their deadline.
            let _ = futex::wake(&self.epoch, futex::Flags::empty(), u32::MAX >> 1);
        }
    }

    /// Rings only if the owner is (about to be) asleep: for events the owner also checks
    /// directly before sleeping ([`Bell::wait_ready`]). The caller has published the event
    /// before calling; the fence orders that store before the load of `waiters`, against the
    /// sleeper's "register, then check" (one of the two sees the other).
    pub(crate) fn ring_if_sleeping(&self) {
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.waiters.load(Ordering::SeqCst) > 0 {
            self.ring();
        }
    }

    /// Sleeps until `epoch` differs from `seen` or `until` passes (see the module docs).
    pub(crate) fn wait(&self, seen: u32, until: Instant, spin: Duration, yield_for: Duration) {
        self.wait_ready(seen, until, spin, yield_for, &mut || false);
    }

    /// [`Bell::wait`] that also returns as soon as `ready()` holds, checking it in every phase
    /// and once more after registering as a sleeper, so ringers may skip waking it
    /// ([`Bell::ring_if_sleeping`]) for events that `ready` sees.
    pub(crate) fn wait_ready(
        &self,
        seen: u32,
        until: Instant,
        spin: Duration,
        yield_for: Duration,
        ready: &mut dyn FnMut() -> bool,
    ) {
        // The clock is read only once a wait lasts (most end within the first few polls).
        let mut start = None;
        let mut i = 0u32;
        loop {
            if self.epoch.load(Ordering::Acquire) != seen || ready() {
                return;
            }
            i = i.wrapping_add(1);
            if i % 32 == 0 {
                let now = Instant::now();
                if now >= until {
                    return;
                }
                if now.duration_since(*start.get_or_insert(now)) >= spin {
                    break;
                }
            }
            std::hint::spin_loop();
        }
        let yield_start = Instant::now();
        let mut yields = 0u32;
        while yields < MIN_YIELDS || yield_start.elapsed() < yield_for {
            std::thread::yield_now();
            yields += 1;
            if self.epoch.load(Ordering::Acquire) != seen || ready() {
                return;
            }
            if Instant::now() >= until {
                return;
            }
        }
        self.waiters.fetch_add(1, Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
        while self.epoch.load(Ordering::SeqCst) == seen && !ready() {
            let now = Instant::now();
            if now >= until {
                break;
            }
            let left = until - now;
            let ts = futex::Timespec {
                tv_sec: left.as_secs().min(i64::MAX as u64) as i64,
                tv_nsec: i64::from(left.subsec_nanos()),
            };
            match futex::wait(&self.epoch, futex::Flags::empty(), seen, Some(&ts)) {
                // Woken, value changed (EAGAIN), timed out or interrupted: re-check above.
                Ok(()) | Err(Errno::AGAIN) | Err(Errno::TIMEDOUT) | Err(Errno::INTR) => {}
                // No futex (seccomp, odd kernels): degrade to short sleeps, still bounded.
                Err(_) => std::thread::sleep(left.min(Duration::from_millis(1))),
            }
        }
        self.waiters.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A rank's doorbell over the bell in its own shared-memory segment. Peers ring it from
/// their processes: an increment, plus a shared `FUTEX_WAKE` only when someone sleeps. A wait
/// spins for [`ShmConfig::spin`](super::ShmConfig::spin), yields a few times, then sleeps in
/// `FUTEX_WAIT` no later than its deadline.
pub struct ShmDoorbell {
    seg: Arc<Segment>,
    spin: Duration,
    yield_for: Duration,
}

impl std::fmt::Debug for ShmDoorbell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmDoorbell")
            .field("spin", &self.spin)
            .field("yield_for", &self.yield_for)
            .finish_non_exhaustive()
    }
}

impl ShmDoorbell {
    pub(crate) fn new(seg: Arc<Segment>, spin: Duration, yield_for: Duration) -> ShmDoorbell {
        ShmDoorbell { seg, spin, yield_for }
    }

    /// Increments the counter and wakes sleepers (as a peer would), e.g. to interrupt this
    /// rank's own wait from another thread.
    pub fn ring(&self) {
        self.seg.bell().ring();
    }
}

impl Doorbell for ShmDoorbell {
    fn epoch(&self) -> u32 {
        self.seg.bell().epoch.load(Ordering::SeqCst)
    }

    fn wait(&self, epoch: u32, until: Instant) {
        self.seg.bell().wait(epoch, until, self.spin, self.yield_for);
    }

    fn wait_checked(&self, epoch: u32, until: Instant, ready: &mut dyn FnMut() -> bool) {
        self.seg.bell().wait_ready(epoch, until, self.spin, self.yield_for, ready);
    }

    fn heartbeat(&self) {
        self.seg.bell().heartbeat.store(crate::transport::monotonic_ns(), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_returns_at_deadline_and_on_ring() {
        let bell = Arc::new(Bell::default());
        let t0 = Instant::now();
        bell.wait(0, t0 + Duration::from_millis(50), Duration::from_micros(5), Duration::from_micros(50));
        let took = t0.elapsed();
        assert!(took >= Duration::from_millis(50) && took < Duration::from_millis(1000), "{took:?}");

        let b2 = bell.clone();
        let ringer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            b2.ring();
        });
        let t0 = Instant::now();
        bell.wait(0, t0 + Duration::from_secs(10), Duration::from_micros(5), Duration::from_micros(50));
        assert!(t0.elapsed() < Duration::from_secs(5));
        assert_eq!(bell.waiters.load(Ordering::SeqCst), 0);
        ringer.join().unwrap();
    }
}
