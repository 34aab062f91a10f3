//! The atomics and futex calls the doorbell protocol (`futex.rs`) uses, in one place so the
//! protocol can be checked: `std`'s atomics and the kernel's futex normally; under
//! `cfg(loom)` loom's atomics and a model futex (so loom explores every interleaving and
//! reports a lost wake-up as a deadlock); under `cfg(miri)` std's atomics with the futex calls
//! skipped (Miri cannot run rustix's raw syscalls: a wait becomes a yield, a spurious wake-up
//! that every caller already tolerates, and a wake does nothing).
//!
//! This file owns no protocol: only what the primitives are.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicU32};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{fence, AtomicU32};

use std::time::Duration;

/// How a futex wait ended; every outcome means "re-check the word".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Woke {
    /// Woken, the word had changed already, the timeout passed or a signal came.
    Recheck,
    /// The kernel has no usable futex: the caller sleeps briefly instead.
    NoFutex,
}

/// Sleeps while `word` holds `expected`, at most `timeout`, until a [`wake`] on it.
#[cfg(not(any(loom, miri)))]
pub(crate) fn wait(word: &AtomicU32, expected: u32, timeout: Duration) -> Woke {
    use rustix::io::Errno;
    use rustix::thread::futex;
    let ts = futex::Timespec {
        tv_sec: timeout.as_secs().min(i64::MAX as u64) as i64,
        tv_nsec: i64::from(timeout.subsec_nanos()),
    };
    match futex::wait(word, futex::Flags::empty(), expected, Some(&ts)) {
        Ok(()) | Err(Errno::AGAIN) | Err(Errno::TIMEDOUT) | Err(Errno::INTR) => Woke::Recheck,
        Err(_) => Woke::NoFutex,
    }
}

/// Wakes every thread (of any process) sleeping in [`wait`] on `word`.
#[cfg(not(any(loom, miri)))]
pub(crate) fn wake(word: &AtomicU32) {
    // Errors (none expected for a valid, mapped address) leave sleepers to their timeout,
    // which is bounded by their deadline.
    let _ = rustix::thread::futex::wake(word, rustix::thread::futex::Flags::empty(), u32::MAX >> 1);
}

/// Miri: a yield (a spurious wake-up).
#[cfg(all(miri, not(loom)))]
pub(crate) fn wait(_word: &AtomicU32, _expected: u32, _timeout: Duration) -> Woke {
    std::thread::yield_now();
    Woke::Recheck
}

/// Miri: nothing to wake (waits do not block).
#[cfg(all(miri, not(loom)))]
pub(crate) fn wake(_word: &AtomicU32) {}

/// The model futex: one wait queue for the whole model (a wake-up of another word's sleeper is
/// a spurious wake-up, which callers tolerate). Like the kernel, it checks the word under the
/// queue's lock, so a wake that follows the ringer's store cannot slip between the sleeper's
/// check and its sleep. It ignores the timeout: a sleeper nobody wakes blocks for good, and
/// loom reports the deadlock.
#[cfg(loom)]
mod model {
    use loom::sync::{Condvar, Mutex};

    pub(super) struct Queue {
        pub(super) wakes: Mutex<u64>,
        pub(super) cv: Condvar,
    }

    loom::lazy_static! {
        pub(super) static ref QUEUE: Queue = Queue { wakes: Mutex::new(0), cv: Condvar::new() };
    }
}

/// loom: sleeps until a [`wake`] if `word` still holds `expected` (checked under the queue's
/// lock); the timeout is ignored.
#[cfg(loom)]
pub(crate) fn wait(word: &AtomicU32, expected: u32, _timeout: Duration) -> Woke {
    let q = &*model::QUEUE;
    let mut wakes = q.wakes.lock().expect("model futex");
    if word.load(std::sync::atomic::Ordering::SeqCst) != expected {
        return Woke::Recheck;
    }
    let seen = *wakes;
    while *wakes == seen {
        wakes = q.cv.wait(wakes).expect("model futex");
    }
    Woke::Recheck
}

/// loom: wakes every sleeper of the model futex.
#[cfg(loom)]
pub(crate) fn wake(_word: &AtomicU32) {
    let q = &*model::QUEUE;
    *q.wakes.lock().expect("model futex") += 1;
    q.cv.notify_all();
}
