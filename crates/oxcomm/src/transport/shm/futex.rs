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

use super::layout::Bell;
use super::segment::Segment;
use super::sync::{self, fence, Woke};
use crate::transport::Doorbell;

/// Yields after the spin phase, before sleeping, at least this many times.
const MIN_YIELDS: u32 = 4;

impl Bell {
    /// Increments the counter; wakes sleepers if any are registered.
    pub(crate) fn ring(&self) {
        self.epoch.fetch_add(1, Ordering::SeqCst);
        // loom models SeqCst accesses as AcqRel, which lets this load and the sleeper's both
        // miss the other's store (it reported exactly that as a deadlock). The real program is
        // safe: SeqCst operations have one total order (and the locked RMW is a full barrier on
        // x86), so the model gets that order spelled as a fence; the real build pays nothing.
        #[cfg(loom)]
        fence(Ordering::SeqCst);
        if self.waiters.load(Ordering::SeqCst) > 0 {
            sync::wake(&self.epoch);
        }
    }

    /// Rings only if the owner is (about to be) asleep: for events the owner also checks
    /// directly before sleeping ([`Bell::wait_ready`]). The caller has published the event
    /// before calling; the fence orders that store before the load of `waiters`, against the
    /// sleeper's "register, then check" (one of the two sees the other).
    pub(crate) fn ring_if_sleeping(&self) {
        fence(Ordering::SeqCst);
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
        self.sleep(seen, until, ready);
    }

    /// The last phase of [`Bell::wait_ready`]: registers in `waiters`, re-checks `epoch` and
    /// `ready` behind a fence, and sleeps on the futex while neither changed, until `until`.
    /// This is the sleeper's half of the no-lost-wake-up protocol (module docs), which the
    /// loom model below checks against [`Bell::ring`] and [`Bell::ring_if_sleeping`].
    pub(crate) fn sleep(&self, seen: u32, until: Instant, ready: &mut dyn FnMut() -> bool) {
        self.waiters.fetch_add(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        while self.epoch.load(Ordering::SeqCst) == seen && !ready() {
            let now = Instant::now();
            if now >= until {
                break;
            }
            let left = until - now;
            if sync::wait(&self.epoch, seen, left) == Woke::NoFutex {
                // No futex (seccomp, odd kernels): degrade to short sleeps, still bounded.
                std::thread::sleep(left.min(Duration::from_millis(1)));
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

    fn set_op(&self, op: u64) {
        self.seg.bell().last_op.store(op, Ordering::Relaxed);
    }

    fn ctrl_count(&self) -> u32 {
        self.seg.bell().ctrl.load(Ordering::Acquire)
    }

    fn wake(&self) {
        self.ring();
    }

    fn deaths(&self) -> u32 {
        self.seg.deaths().load(Ordering::Acquire)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// Deadlines of these tests: Miri's clock runs slower than the machine's.
    const SHORT: Duration = Duration::from_millis(if cfg!(miri) { 5 } else { 50 });

    #[test]
    fn wait_returns_at_deadline_and_on_ring() {
        let bell = Arc::new(Bell::default());
        let t0 = Instant::now();
        bell.wait(0, t0 + SHORT, Duration::from_micros(5), Duration::from_micros(50));
        let took = t0.elapsed();
        assert!(took >= SHORT && took < Duration::from_millis(1000) + SHORT * 20, "{took:?}");

        let b2 = bell.clone();
        let ringer = std::thread::spawn(move || {
            std::thread::sleep(SHORT / 2);
            b2.ring();
        });
        let t0 = Instant::now();
        bell.wait(0, t0 + Duration::from_secs(10), Duration::from_micros(5), Duration::from_micros(50));
        assert!(t0.elapsed() < Duration::from_secs(5));
        assert_eq!(bell.waiters.load(Ordering::SeqCst), 0);
        ringer.join().unwrap();
    }

    /// The direct collectives' pattern: publish an event, ring only if the owner sleeps; the
    /// owner checks the event in every phase. Many rounds, so some find the owner asleep.
    #[test]
    fn ring_if_sleeping_wakes_a_checked_wait() {
        let rounds: u32 = if cfg!(miri) { 20 } else { 2000 };
        let bell = Arc::new(Bell::default());
        let event = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let (b2, e2) = (bell.clone(), event.clone());
        let ringer = std::thread::spawn(move || {
            for i in 1..=rounds {
                e2.store(i, Ordering::Release);
                b2.ring_if_sleeping();
                while e2.load(Ordering::Acquire) == i {
                    std::thread::yield_now();
                }
            }
        });
        for i in 1..=rounds {
            let until = Instant::now() + Duration::from_secs(30);
            let seen = bell.epoch.load(Ordering::SeqCst);
            bell.wait_ready(seen, until, Duration::ZERO, Duration::ZERO, &mut || event.load(Ordering::Acquire) == i);
            assert!(Instant::now() < until, "round {i}: the wake-up was lost");
            event.store(0, Ordering::Release);
        }
        ringer.join().unwrap();
        assert_eq!(bell.waiters.load(Ordering::SeqCst), 0);
    }
}

/// A loom model of the no-lost-wake-up protocol (module docs): the ringer publishes, then
/// looks for sleepers; the sleeper registers, re-checks, then sleeps on the model futex
/// (`sync.rs`), which never times out, so a lost wake-up is a deadlock that loom reports. Run
/// with `RUSTFLAGS="--cfg loom" cargo test -p oxcomm --lib --release loom` (bench/miri.sh).
#[cfg(all(test, loom))]
mod loom_model {
    use super::*;
    use loom::sync::atomic::AtomicU32;

    fn far() -> Instant {
        Instant::now() + Duration::from_secs(3600)
    }

    /// A link's pattern: bump the epoch (`ring`), against a sleeper that saw the old epoch.
    #[test]
    fn loom_ring_wakes_a_sleeper() {
        loom::model(|| {
            let bell = Arc::new(Bell::default());
            let b = bell.clone();
            let ringer = loom::thread::spawn(move || b.ring());
            bell.sleep(0, far(), &mut || false);
            assert_eq!(bell.epoch.load(Ordering::SeqCst), 1);
            ringer.join().unwrap();
            assert_eq!(bell.waiters.load(Ordering::SeqCst), 0);
        });
    }

    /// The direct collectives' pattern: publish an event, ring only if the owner sleeps
    /// (`ring_if_sleeping`), against a sleeper that checks the event after registering.
    #[test]
    fn loom_ring_if_sleeping_wakes_a_checked_sleeper() {
        loom::model(|| {
            let bell = Arc::new(Bell::default());
            let event = Arc::new(AtomicU32::new(0));
            let (b, e) = (bell.clone(), event.clone());
            let ringer = loom::thread::spawn(move || {
                e.store(1, Ordering::Release);
                b.ring_if_sleeping();
            });
            let seen = bell.epoch.load(Ordering::SeqCst);
            bell.sleep(seen, far(), &mut || event.load(Ordering::Acquire) == 1);
            ringer.join().unwrap();
            assert_eq!(event.load(Ordering::Acquire), 1);
            assert_eq!(bell.waiters.load(Ordering::SeqCst), 0);
        });
    }

    /// Two ringers and one sleeper (ranks ring a shared owner): still no lost wake-up.
    #[test]
    fn loom_two_ringers() {
        loom::model(|| {
            let bell = Arc::new(Bell::default());
            let ringers: Vec<_> = (0..2)
                .map(|_| {
                    let b = bell.clone();
                    loom::thread::spawn(move || b.ring())
                })
                .collect();
            bell.sleep(0, far(), &mut || false);
            for r in ringers {
                r.join().unwrap();
            }
            assert_eq!(bell.epoch.load(Ordering::SeqCst), 2);
        });
    }
}
