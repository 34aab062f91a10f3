//! The host's monotonic clock as one number: what heartbeats are stamped with (transports) and
//! what the flight recorder times ops with (logging).
//!
//! A values-level module: it imports nothing from the crate, so every layer that needs the
//! clock takes it from here instead of from a sibling layer. It knows nothing about links,
//! peers or ops.

use std::time::Duration;

/// Nanoseconds of the host's monotonic clock (comparable across processes on one host), at
/// the resolution of the scheduler tick (a few ms) where the OS has a cheaper coarse clock:
/// heartbeats are stamped at most once per tick of it by back-to-back ops (and as a wait goes)
/// and compared against thresholds of half a second.
pub fn monotonic_ns() -> u64 {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    let clock = rustix::time::ClockId::MonotonicCoarse;
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    let clock = rustix::time::ClockId::Monotonic;
    let t = rustix::time::clock_gettime(clock);
    (t.tv_sec as u64).saturating_mul(1_000_000_000).saturating_add(t.tv_nsec as u64)
}

/// How long ago a heartbeat stamped `stamp` (0: never) was.
pub fn idle_since(stamp: u64) -> Option<Duration> {
    (stamp != 0).then(|| Duration::from_nanos(monotonic_ns().saturating_sub(stamp)))
}
