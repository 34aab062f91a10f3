//! How a chunk step copies this rank's parts into its half, and an arrival its payload into
//! its slot: plain stores or non-temporal ones, chosen per copy by this rank alone (readers do
//! not depend on it), and the watch for cores that the host has placed far apart.
//!
//! **Far cores.** On the test VM (2 vCPUs) the host at times places the two vCPUs far apart:
//! a cache line's round trip between them then takes 230–540 ns instead of 80–140 (or ~40
//! where the two vCPUs share a core), for seconds to minutes. Plain stores into the half must
//! first take each line back from the reader that read it last; far apart, that ran at 2.3
//! GB/s instead of 20–35, and a 2-rank all_gather of 1 MiB took 250–330 µs instead of 33
//! (`bench/floor_cma.c`, which prints the round trip beside each scheme;
//! docs/perf_large_fresh.md). Non-temporal stores skip taking the lines back: 23 µs for the
//! same 512 KiB copy-in far apart. So a step that copies in with plain stores times its
//! copy-in; after [`FAR_AFTER`] in a row below [`FAR_BELOW_BYTES_PER_US`] every copy-in of
//! this process streams for the next [`FAR_FOR`], after which the steps try plain stores
//! again. This is the only state: process-wide, since it is the cores' placement that it
//! tracks, and a wrong guess costs speed, never correctness.
//!
//! Every chunk step's copy-in takes part: all_gather's, broadcast's, the exchange's
//! (all_to_all, gather, scatter), reduce_scatter's, and all_reduce's and reduce's, whose
//! reduced slice, written into the half after the copy-in, follows the copy-in's choice (the
//! peers read those lines last too). So do the slot payloads ([`CopyIn::for_slot`]): one in
//! [`SLOT_TIMED_EVERY`] from [`TIMED_FROM`] bytes is timed, so that small ops alone find far
//! cores, and while far apart every payload from [`SLOT_STREAM_FAR_FROM`] bytes streams. The
//! workspace's pages are mapped when it is created (`transport/shm/segment.rs`): a page fault
//! on a place's first use made near copy-ins look far.
//!
//! `OXCOMM_SHM_STREAM_IN` (default `auto`: as above) set to `always` streams every copy-in
//! where every rank has a core, `never` none above the size limit (`copy_in_for` in
//! `shm_direct`); each rank reads its own, and the ranks need not agree.
//!
//! It does not watch where ranks share cores (`own_core` false): a rank preempted in its
//! copy-in would look far, and there plain stores into lines a rank on the same core holds
//! are the right choice anyway.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::wire::OpKind;

/// Plain copy-in rate (bytes per µs, = MB/s) below which a copy-in counts as slow: 4 GB/s.
/// Far apart the test VM copied in at 2.3 GB/s; near, 20–35 GB/s from an input in the caches
/// and 4–16 GB/s from one in memory (64 MiB ops), and the first op (pages not yet touched)
/// now and then below 8.
const FAR_BELOW_BYTES_PER_US: u64 = 4_000;

/// Slow copy-ins in a row (no fast one between) that make the cores count as far apart: one
/// slow copy-in is as often a first touch or a preemption.
const FAR_AFTER: u32 = 2;

/// Slow timed copy-ins since the last fast one.
static SLOW_IN_A_ROW: AtomicU32 = AtomicU32::new(0);

/// Copy-ins (and slot payloads) shorter than this are not timed: at the rates above 16 KiB
/// take 0.5–0.8 µs near and ~7 far apart, against a clock read of tens of ns on this VM. With
/// slot payloads timed from 8 KiB, an A/B near showed all_gather and all_to_all of 4–16 KiB
/// 1.1–1.4× slower (not pinned down: a near copy taken for a far one streams this rank's
/// payloads for [`FAR_FOR`]), while far apart an 8 KiB all_reduce gained only 1.2× from
/// streaming (docs/perf_far_cores.md).
const TIMED_FROM: usize = 16 << 10;

/// How long copy-ins stream once the cores were found far apart, before plain stores are
/// tried again (one slow step per this long: at most ~0.3% of the time far apart).
const FAR_FOR: Duration = Duration::from_millis(100);

/// What `OXCOMM_SHM_STREAM_IN` asks for (read once per process).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Setting {
    /// Plain stores, and streaming while the cores look far apart (the default, `auto`).
    Auto,
    /// Streaming whenever every rank has a core (`always`).
    Always,
    /// Plain stores above the size limit, whatever the cores (`never`).
    Never,
}

impl Setting {
    fn parse(v: Option<&str>) -> Setting {
        match v.map(str::trim) {
            Some("always") => Setting::Always,
            Some("never") => Setting::Never,
            Some("auto") | Some("") | None => Setting::Auto,
            Some(other) => {
                tracing::warn!(target: "oxcomm::shm", value = other,
                    "OXCOMM_SHM_STREAM_IN is auto, always or never; using auto");
                Setting::Auto
            }
        }
    }

    fn get() -> Setting {
        static SETTING: OnceLock<Setting> = OnceLock::new();
        *SETTING.get_or_init(|| Setting::parse(std::env::var("OXCOMM_SHM_STREAM_IN").ok().as_deref()))
    }
}

/// The host's coarse monotonic clock ([`crate::clock::monotonic_ns`], a few ms per tick) until
/// which copy-ins stream (0: not far, as far as we know). Coarse, because every slot write from
/// 4 KiB reads it: on the precise clock, 4–8 KiB ops ran 5–10% slower near (an A/B of the two
/// builds, docs/perf_far_cores.md); the timing of a copy itself takes the precise one.
static FAR_UNTIL_NS: AtomicU64 = AtomicU64::new(0);

/// One chunk step's copy-in (see the module docs): [`CopyIn::copy`] each part, then
/// [`CopyIn::done`].
pub(crate) struct CopyIn {
    stream: bool,
    /// When a plain copy-in that this step times began, and the bytes it has copied.
    timed: Option<(Instant, usize)>,
}

/// Whether the cores were found far apart less than [`FAR_FOR`] ago.
fn far_now() -> bool {
    let until = FAR_UNTIL_NS.load(Ordering::Relaxed);
    until != 0 && crate::clock::monotonic_ns() < until
}

impl CopyIn {
    /// The copy-in of a step: `stream` where the size alone asks for non-temporal stores;
    /// otherwise plain stores, unless the cores were found far apart less than [`FAR_FOR`] ago
    /// (only where every rank has a core, `own_core`).
    pub(super) fn new(stream: bool, own_core: bool) -> CopyIn {
        if stream || !own_core {
            return CopyIn { stream, timed: None };
        }
        match Setting::get() {
            Setting::Always => return CopyIn { stream: true, timed: None },
            Setting::Never => return CopyIn { stream: false, timed: None },
            Setting::Auto => {}
        }
        if far_now() {
            return CopyIn { stream: true, timed: None };
        }
        CopyIn { stream: false, timed: Some((Instant::now(), 0)) }
    }

    /// The copy of the slot payload of direct op `op`, `len` bytes of an op of `kind`:
    /// streamed as [`slot_streams`] says; where it goes in by plain stores, every
    /// [`SLOT_TIMED_EVERY`]th from [`TIMED_FROM`] bytes is timed for the watch (the small
    /// ops alone, with no chunk step, must find far cores too).
    pub(super) fn for_slot(kind: OpKind, len: usize, own_core: bool, op: u64) -> CopyIn {
        if !own_core || len < SLOT_STREAM_FAR_FROM {
            return CopyIn { stream: false, timed: None };
        }
        let setting = Setting::get();
        let auto = setting == Setting::Auto;
        let stream = slot_streams(kind, len, setting, auto && far_now());
        let timed = auto && !stream && len >= TIMED_FROM && op % SLOT_TIMED_EVERY == 0;
        CopyIn { stream, timed: timed.then(|| (Instant::now(), 0)) }
    }

    /// Whether this step's parts go in with non-temporal stores.
    pub(super) fn streams(&self) -> bool {
        self.stream
    }

    /// Copies one part into the half.
    pub(super) fn copy(&mut self, dst: &mut [u8], src: &[u8]) {
        if self.stream {
            crate::copy::copy_streaming(dst, src);
        } else {
            crate::copy::copy(dst, src);
        }
        if let Some((_, bytes)) = &mut self.timed {
            *bytes += src.len();
        }
    }

    /// Ends the step: the [`FAR_AFTER`]th timed plain copy-in in a row slower than
    /// [`FAR_BELOW_BYTES_PER_US`] makes the copy-ins of the next [`FAR_FOR`] stream.
    pub(super) fn done(self) {
        let Some((start, bytes)) = self.timed else { return };
        if bytes < TIMED_FROM {
            return;
        }
        let now = Instant::now();
        if !looks_far(bytes, now.saturating_duration_since(start)) {
            SLOW_IN_A_ROW.store(0, Ordering::Relaxed);
            return;
        }
        if SLOW_IN_A_ROW.fetch_add(1, Ordering::Relaxed) + 1 >= FAR_AFTER {
            SLOW_IN_A_ROW.store(0, Ordering::Relaxed);
            let until = crate::clock::monotonic_ns().saturating_add(FAR_FOR.as_nanos() as u64);
            FAR_UNTIL_NS.store(until, Ordering::Relaxed);
            tracing::debug!(target: "oxcomm::shm", bytes, took_ns = now.saturating_duration_since(start).as_nanos() as u64,
                "plain copy-in slow: cores look far apart, streaming copy-ins for a while");
        }
    }
}

/// Slot payloads from this many bytes go in by non-temporal stores where every rank has a
/// core: a 32 KiB block written fresh and read by the peer took 3.9 µs streamed against 5.8
/// with plain stores, cores near; at 16 KiB plain stores won (2.1 against 2.3 µs), at 8 KiB
/// by more (0.9 against 1.7) (`bench/floor_parts.c`, block = part).
const SLOT_STREAM_FROM: usize = 24 << 10;

/// Slot payloads from this many bytes also stream while the cores look far apart (see the
/// module docs; the slots' lines, too, were last read by the peer).
const SLOT_STREAM_FAR_FROM: usize = 4 << 10;

/// One slot write in this many (by op number) is timed: a sample every few ops finds far
/// cores within a few ops, for a fraction of the clock reads.
const SLOT_TIMED_EVERY: u64 = 4;

/// Whether the slot payload of `len` bytes (at least [`SLOT_STREAM_FAR_FROM`], every rank
/// with a core) of an op of `kind` goes in by non-temporal stores, the cores being `far`
/// apart or not (as the watch found them; `setting` is `OXCOMM_SHM_STREAM_IN`).
///
/// While far apart, every op's payload streams: the plain stores would take back every line
/// the peers read last time, while reading lines a far core wrote costs no more than reading
/// memory (a 2-rank all_reduce of 16–32 KiB far apart took 7.2–9.6 µs with its payload
/// streamed, 12.6–29.4 plain; near 3.8–7.0, docs/perf_far_cores.md). Near, the copy-out ops'
/// payloads stream from [`SLOT_STREAM_FROM`] bytes; the reducing ops' never, since their
/// readers reduce from the payload rather than copy it out: a 32 KiB `reduce` on 2 ranks with
/// unchanged buffers took 6.9 µs with it streamed against 3.5, a `reduce_scatter` 5.2 against
/// 4.4, while `broadcast` and `scatter` took half the time. `always` streams every op's from
/// [`SLOT_STREAM_FAR_FROM`] bytes, `never` only the copy-out ops' by size.
fn slot_streams(kind: OpKind, len: usize, setting: Setting, far: bool) -> bool {
    let reduced_from = matches!(kind, OpKind::AllReduce | OpKind::Reduce | OpKind::ReduceScatter);
    match setting {
        Setting::Always => true,
        Setting::Auto if far => true,
        Setting::Auto | Setting::Never => !reduced_from && len >= SLOT_STREAM_FROM,
    }
}

/// Whether a plain copy-in of `bytes` that took `took` says the cores are far apart.
fn looks_far(bytes: usize, took: Duration) -> bool {
    let ns = took.as_nanos().max(1);
    (bytes as u128) * 1000 / ns < u128::from(FAR_BELOW_BYTES_PER_US)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn far_apart_is_below_four_gb_per_s() {
        // 512 KiB: 15 µs near (35 GB/s), 223 µs far apart (2.3 GB/s) on the test VM.
        assert!(!looks_far(512 << 10, Duration::from_micros(15)));
        assert!(looks_far(512 << 10, Duration::from_micros(223)));
        assert!(!looks_far(512 << 10, Duration::from_micros(120)));
        assert!(looks_far(512 << 10, Duration::from_micros(140)));
        // 16 KiB: 0.5–0.8 µs near, ~7 µs far; a copy faster than the clock's tick is near.
        assert!(!looks_far(16 << 10, Duration::from_nanos(1_100)));
        assert!(looks_far(16 << 10, Duration::from_micros(7)));
        assert!(!looks_far(64 << 10, Duration::ZERO));
    }

    #[test]
    fn the_setting_reads_three_words_and_defaults_to_auto() {
        assert_eq!(Setting::parse(None), Setting::Auto);
        assert_eq!(Setting::parse(Some("auto")), Setting::Auto);
        assert_eq!(Setting::parse(Some(" always ")), Setting::Always);
        assert_eq!(Setting::parse(Some("never")), Setting::Never);
        assert_eq!(Setting::parse(Some("sometimes")), Setting::Auto);
    }

    #[test]
    fn sizes_that_ask_for_streaming_stream_and_shared_cores_never_watch() {
        assert!(CopyIn::new(true, true).streams());
        assert!(CopyIn::new(true, false).streams());
        let shared = CopyIn::new(false, false);
        assert!(!shared.streams() && shared.timed.is_none());
    }

    #[test]
    fn a_slow_plain_copy_in_makes_the_next_ones_stream() {
        if Setting::get() != Setting::Auto {
            return; // OXCOMM_SHM_STREAM_IN set for this run: nothing is watched.
        }
        // Another test of this process may run a copy-in meanwhile: the state is only ever a
        // speed choice, so this test sets it and reads it back without assuming it alone.
        let slow = || CopyIn { stream: false, timed: Some((Instant::now() - Duration::from_millis(50), 1 << 20)) };
        slow().done();
        slow().done();
        assert!(CopyIn::new(false, true).streams(), "streams after two slow plain copy-ins in a row");
        assert!(!CopyIn::new(false, false).streams(), "never where ranks share cores");
        FAR_UNTIL_NS.store(0, Ordering::Relaxed);
        let plain = CopyIn::new(false, true);
        assert!(!plain.streams() && plain.timed.is_some(), "plain and timed once the while is over");
        let fast = CopyIn { stream: false, timed: Some((Instant::now(), 1 << 20)) };
        fast.done();
        assert!(!CopyIn::new(false, true).streams(), "a fast copy-in leaves plain stores on");
    }

    #[test]
    fn slot_payloads_stream_near_from_24_kib_and_far_apart_all() {
        let (gather, auto) = (OpKind::Gather, Setting::Auto);
        assert!(slot_streams(gather, SLOT_STREAM_FROM, auto, false));
        assert!(!slot_streams(gather, SLOT_STREAM_FROM - 1, auto, false));
        assert!(slot_streams(gather, SLOT_STREAM_FAR_FROM, auto, true));
        assert!(slot_streams(gather, SLOT_STREAM_FAR_FROM, Setting::Always, false));
        assert!(!slot_streams(gather, SLOT_STREAM_FROM - 1, Setting::Never, true));
        for kind in [OpKind::AllReduce, OpKind::Reduce, OpKind::ReduceScatter] {
            assert!(!slot_streams(kind, 32 << 10, auto, false), "near never for {kind:?}, whose readers reduce");
            assert!(!slot_streams(kind, 32 << 10, Setting::Never, true));
            assert!(slot_streams(kind, SLOT_STREAM_FAR_FROM, auto, true), "far apart every op's payload streams");
        }
    }

    #[test]
    fn slot_copies_below_4_kib_or_on_shared_cores_are_plain_and_untimed() {
        for (len, own_core) in [(64, true), (SLOT_STREAM_FAR_FROM - 1, true), (32 << 10, false)] {
            let c = CopyIn::for_slot(OpKind::Broadcast, len, own_core, 0);
            assert!(!c.streams() && c.timed.is_none(), "{len} B, own core {own_core}");
        }
        if Setting::get() != Setting::Auto {
            return; // OXCOMM_SHM_STREAM_IN set for this run: nothing is timed.
        }
        // Plain stores from TIMED_FROM are timed one op in SLOT_TIMED_EVERY (unless another
        // test of this process just found the cores far, which only makes them stream).
        let c = CopyIn::for_slot(OpKind::AllReduce, TIMED_FROM, true, SLOT_TIMED_EVERY);
        assert!(c.streams() || c.timed.is_some());
        assert!(CopyIn::for_slot(OpKind::AllReduce, TIMED_FROM, true, SLOT_TIMED_EVERY + 1).timed.is_none());
        assert!(CopyIn::for_slot(OpKind::AllReduce, TIMED_FROM - 1, true, 0).timed.is_none());
    }

    #[test]
    fn copies_exactly_either_way() {
        let src: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        for stream in [false, true] {
            let mut dst = vec![0u8; src.len()];
            let mut c = CopyIn { stream, timed: Some((Instant::now(), 0)) };
            c.copy(&mut dst[..40_000], &src[..40_000]);
            c.copy(&mut dst[40_000..], &src[40_000..]);
            assert_eq!(c.timed.map(|t| t.1), Some(src.len()));
            assert_eq!(dst, src);
        }
    }
}
