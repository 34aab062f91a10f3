//! Direct shared-memory collectives: ranks on one host read each other's workspaces
//! ([`ShmDirect`]) instead of sending bytes through rings.
//!
//! **Arrival** (every direct op starts with it): a rank writes its fingerprint (and, for small
//! messages, its payload) into its slot for the op and stamps it; it then waits for every
//! rank's stamp and compares every fingerprint with its own before touching the user's buffer,
//! so the agreement costs no extra round. Op `k` uses slot `k % SLOTS`.
//!
//! A *loose* arrival ([`Wait::Root`], [`Wait::Nobody`]) waits only for the slots the op reads
//! (a small broadcast's root publishes and returns; the others wait for the root), so a rank
//! can run ahead of its peers, as MPI's eager sends let it. How far is bounded by the slots:
//! before writing op `k`'s slot, a rank waits until every rank has stamped op `k − EAGER` and
//! checks their fingerprints of that op (unless an earlier arrival did), where
//! `EAGER = SLOTS − 1`. So a rank runs at most [`EAGER`] ops ahead of the slowest, and:
//!
//! - the slot it rewrites (op `k − SLOTS`) is no longer read: its payload and its check word
//!   were read before the readers stamped op `k − SLOTS + 1 = k − EAGER`, which this rank has
//!   just seen;
//! - the fingerprints it checks late are still there: every arrival also writes the op's check
//!   word and header into the rank's *history* (entry `k % HISTORY`, `HISTORY = 2 · SLOTS`;
//!   the check words side by side, so a late check of several ops reads a line or two),
//!   and a late check reads the history, not the slot (which the peer may have reused). A
//!   peer rewrites op `j`'s entry at op `j + HISTORY`, only after this rank has stamped op
//!   `j + HISTORY − EAGER > j + EAGER`, and this rank checks op `j` before it stamps op
//!   `j + EAGER`.
//!
//! Until this history existed the check read the slot, which bounded `EAGER` to `SLOTS / 2`
//! (a peer had to keep op `k − EAGER`'s slot until op `k + EAGER`).
//!
//! A full arrival ([`Wait::Everyone`]) at op `k` first waits for every rank's stamps of the
//! loose ops before it that no arrival has checked yet and checks them (their history entries
//! are still there by the second point), so a mismatch in a loose op is reported at the next
//! full arrival or at most [`EAGER`] ops later, and names the rank even if that rank never
//! arrives at op `k`. Back-to-back full arrivals pay nothing for this: each finds the ops
//! before it checked, and compares the check word on the stamp's own line.
//!
//! Each op's own steps are in its file: [`all_reduce`], [`broadcast`], [`all_gather`],
//! [`reduce_scatter`], `all_to_all.rs` (all_to_all, all_to_all_v and the exchange through the
//! halves), `rooted.rs` (gather, scatter, reduce); `single_copy.rs` holds the cross-memory
//! reads that all_gather and all_to_all use for large blocks.
//!
//! Progress counters (`copied_in`, `reduced`, `copied_out`) count chunks over the life of the
//! communicator; every rank moves each of them by the same amount in every op.
//!
//! **Parts.** Where one rank copies a chunk into its half and others copy it out (broadcast,
//! all_gather, and the exchange of all_to_all, gather and scatter), the writer copies it in
//! [`PART_BYTES`] at a time and publishes each part (`parts_in`: `g · PARTS_MAX + j + 1` once
//! parts `0..=j` of chunk `g` are in, only ever growing), and a reader copies part j out as
//! soon as it is published. The reader thus follows the writer inside the chunk: from one
//! rank to another a chunk costs about one copy plus one part, where waiting for the whole
//! chunk (`copied_in`) cost two copies in a row. Only ranks that copy in publish `parts_in`;
//! `copied_in` still moves with the other counters after the last part.
//!
//! **Meeting the other ops.** A world op that does not take the direct path (it agrees over
//! the links first, inside [`Ctx::watched`], with the workspaces as the engine's [`PeerWatch`])
//! announces its fingerprint in this rank's workspace; a
//! rank arriving at a direct op at the same sequence number sees that announcement where it
//! waits for the peer's stamp, and the announcing rank, whenever it would sleep, looks for a
//! peer's slot header carrying its sequence number. Either way both fail at once with
//! [`ErrorKind::Mismatch`] and both fingerprints, instead of waiting for each other until the
//! deadline. The direct ops' fast path pays one load of the peer's announcement line, and only
//! while a peer is late.

mod all_gather;
mod all_reduce;
mod all_to_all;
mod broadcast;
mod copy_in;
mod reduce_scatter;
mod rooted;
mod single_copy;

pub(crate) use all_gather::all_gather;
pub(crate) use all_reduce::all_reduce;
pub(crate) use all_to_all::all_to_all;
pub(crate) use broadcast::broadcast;
pub(crate) use reduce_scatter::reduce_scatter;
pub(crate) use rooted::{gather, reduce, scatter};

use crate::engine::{Ctx, PeerWatch};
use crate::error::{Error, ErrorKind, Result};
use crate::transport::shm::workspace::{Counter, ShmDirect, CHUNK_BYTES, HISTORY, SLOTS, SLOT_HEADER, SMALL_BYTES};
use crate::wire::{Fingerprint, FP_BYTES, FP_WORDS};
use copy_in::CopyIn;

/// Per-communicator progress of the direct protocol (identical on every rank).
#[derive(Debug, Default)]
pub(crate) struct DirectState {
    /// Direct ops arrived at so far.
    pub ops: u64,
    /// Chunks processed so far.
    pub chunks: u64,
    /// Ops `0..checked` had every rank's stamp seen and fingerprint checked by this rank.
    pub checked: u64,
    /// This rank's fingerprints of its last [`SLOTS`] ops (op `k` at `k % SLOTS`), for checking
    /// the loose ones when every rank has arrived (at most [`EAGER`] + 1 back).
    pub recent: Box<[Option<Fingerprint>; SLOTS]>,
    /// Whether every rank reads every peer's memory by single copy (`None`: not found out
    /// yet; see `single_copy.rs`).
    pub single_copy: Option<bool>,
}

/// The direct view and its state, as an algorithm sees them.
pub(crate) struct Direct<'a> {
    pub shm: &'a ShmDirect,
    pub state: &'a mut DirectState,
}

/// Output bytes from which the direct ops' copy-out steps use non-temporal stores: half the
/// test VM's L3 (32 MiB). Below it the output stays in the caches between back-to-back ops, and
/// a plain copy was up to 1.3× faster at 4 MiB; from 16 MiB streaming was 1.05–1.4× faster
/// (all_gather, all_to_all, broadcast, scatter, 2 ranks; docs/benchmarks.md).
const STREAM_FROM: usize = 16 << 20;

/// The copy for the steps that write into the caller's buffers of an op whose output is
/// `total` bytes: from [`STREAM_FROM`] non-temporal stores (a buffer that large leaves the
/// caches before anyone reads it, and the stores skip reading every line first), below that
/// a plain copy, which leaves the result in the caches.
pub(super) fn copy_out_for(total: usize) -> fn(&mut [u8], &[u8]) {
    if total >= STREAM_FROM {
        crate::copy::copy_streaming
    } else {
        crate::copy::copy
    }
}

/// Bytes moved through the halves in one chunk step (what this rank copies in plus what it
/// copies out) up to which the copy-in streams ([`copy_in_for`]).
const STREAM_IN_UNTIL: usize = 256 << 10;

/// The copy of parts into this rank's half in a chunk step where this rank copies `moved`
/// bytes in and out. Up to [`STREAM_IN_UNTIL`], when every rank has a core of its own
/// (`own_core`: [`ShmDirect::each_rank_has_a_core`]): non-temporal stores (ending in a store
/// fence, so every part is in memory before it is published). The half's lines sit in the readers' caches from the
/// last time they read it, and plain stores take each line back first; streaming skips that.
/// Between two pinned threads (`bench/floor_parts.c`) a 128 KiB block in 16 KiB parts took
/// 10.0 µs from the first store to the reader's last load instead of 20.0. Above it (a whole
/// 512 KiB chunk, or two ranks' 256 KiB blocks) the readers then fetch every line from memory,
/// and plain stores were faster (2 ranks, inputs rewritten before every op;
/// docs/perf_fresh_inputs.md). With more ranks than cores a reader often shares the writer's
/// core and caches, where streaming only sends the lines to memory and back: 4 ranks on 2
/// cores ran gather at 512 KiB–1 MiB 1.3–1.7× slower with it. Otherwise plain stores, unless
/// the cores look far apart (`copy_in.rs`: then every copy-in streams for a while). A local
/// choice: the readers do not depend on it.
pub(super) fn copy_in_for(moved: usize, own_core: bool) -> CopyIn {
    CopyIn::new(moved <= STREAM_IN_UNTIL && own_core, own_core)
}

/// Whether a buffer of `bytes` goes inline in the slot.
pub(crate) fn is_small(bytes: usize) -> bool {
    bytes <= SMALL_BYTES
}

// A slot's header is the fingerprint's words and the payload's length.
const _: () = assert!(FP_WORDS + 1 == SLOT_HEADER / 8);

/// How many ops a rank may run ahead of the slowest rank (module docs).
pub(super) const EAGER: u64 = (SLOTS - 1) as u64;

// A late check reads the history, which must outlast the lead a rank may take (module docs).
const _: () = assert!(HISTORY as u64 >= 2 * EAGER);

/// Whose slots an arrival waits for before the op goes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Wait {
    /// Every rank's (the op needs everyone's data, or everyone's agreement).
    Everyone,
    /// Only this rank's (a non-root of a broadcast or scatter reads the root's payload).
    Root(usize),
    /// Nobody's (a rank whose whole part is publishing its payload: the root of a small
    /// broadcast or scatter, a non-root of a small gather or reduce).
    Nobody,
}

/// Writes this rank's slot and waits for every rank's; checks the fingerprints. Returns the
/// slot of this op.
pub(super) fn arrive(ctx: &mut Ctx<'_>, d: &mut Direct<'_>, fp: &Fingerprint, payload: &[u8]) -> Result<usize> {
    arrive_for(ctx, d, fp, payload, Wait::Everyone)
}

/// [`arrive`] waiting only for the slots `wait` names, whose fingerprints it checks; the
/// others are checked by a later arrival (module docs). So a root that only publishes returns
/// at once, and back-to-back rooted ops overlap by up to [`EAGER`] ops, while no slot is
/// rewritten before every rank has finished reading it.
pub(super) fn arrive_for(
    ctx: &mut Ctx<'_>,
    d: &mut Direct<'_>,
    fp: &Fingerprint,
    payload: &[u8],
    wait: Wait,
) -> Result<usize> {
    let k = d.state.ops;
    let slot = (k % SLOTS as u64) as usize;
    let stamp = k + 1;
    let me = d.shm.rank();
    let n = ctx.size;
    // This op's slot last held op k − SLOTS: before rewriting it, see every rank past op
    // k − EAGER (module docs).
    if wait == Wait::Everyone && d.state.checked < k {
        // The loose ops before a full arrival: checked before it, so that a rank that took
        // another op there is named even if it never arrives here (module docs).
        check_through(ctx, d, k - 1)?;
    } else if k >= EAGER && d.state.checked <= k - EAGER {
        check_through(ctx, d, k - EAGER)?;
        // Check ahead the later ops every rank has stamped already, so that the next arrivals
        // need not read the peers' slots (a miss each) until the slowest is EAGER ops behind.
        check_stamped(d, k);
    }
    d.state.ops += 1;
    d.state.recent[slot] = Some(*fp);
    let words = fp.words();
    let check = check_word(&words);
    let mut header = [0u64; SLOT_HEADER / 8];
    header[..FP_WORDS].copy_from_slice(&words);
    header[FP_WORDS] = payload.len() as u64;
    // Every rank has stamped op k − EAGER (just checked), so none still reads op
    // k − SLOTS's slot, which this write replaces, nor op k − HISTORY's entry (module docs).
    let mut copy = CopyIn::for_slot(fp.kind, payload.len(), d.shm.each_rank_has_a_core(), k);
    d.shm.write_slot(k, check, &header, payload, |dst, src| copy.copy(dst, src));
    copy.done();
    let ranks = match wait {
        Wait::Everyone => {
            arrive_wait(ctx, d.shm, fp, slot, stamp, 0..n)?;
            check_fingerprints(d.shm, Seen::Slot(slot), fp, check, (0..n).filter(|r| *r != me))?;
            d.state.checked = stamp;
            return Ok(slot);
        }
        Wait::Root(r) => r..r + 1,
        Wait::Nobody => 0..0,
    };
    arrive_wait(ctx, d.shm, fp, slot, stamp, ranks.clone())?;
    check_fingerprints(d.shm, Seen::Slot(slot), fp, check, ranks.clone().filter(|r| *r != me))?;
    // A wait on every other rank (a non-root of 2 ranks) checked this op as a full arrival
    // does: nothing is left to check late if nothing was before it.
    if d.state.checked == k && ranks.len() + 1 == n && !ranks.contains(&me) {
        d.state.checked = stamp;
    }
    Ok(slot)
}

/// Where a rank's fingerprint of an op is read: the op's slot (its check word on the stamp's
/// line), while the slot cannot have been reused, or its history entry, for a late check.
#[derive(Debug, Clone, Copy)]
enum Seen {
    Slot(usize),
    History(u64),
}

/// Checks the fingerprints of the ops from `d.state.checked` on, before `end`, that every rank
/// has stamped, without waiting; stops at the first op whose fingerprints differ (a later
/// arrival reports it).
///
/// A rank stamps its ops in order, so its stamp of op `j` says it stamped every op before:
/// a binary search over the ops finds how far each rank is in a few reads of its stamps, and
/// the check words come from the history, side by side (a line or two per rank), where
/// reading every op's slot cost a line per op and rank.
fn check_stamped(d: &mut Direct<'_>, end: u64) {
    let (n, me) = (d.shm.size(), d.shm.rank());
    let stamped = |r: usize, op: u64| d.shm.slot_stamp(r, (op % SLOTS as u64) as usize) > op;
    // Ops before `reached` are stamped by every rank looked at so far.
    let mut reached = end;
    for r in (0..n).filter(|r| *r != me) {
        let (mut lo, mut hi) = (d.state.checked, reached);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if stamped(r, mid) {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        reached = lo;
    }
    while d.state.checked < reached {
        let op = d.state.checked;
        let Some(fp) = d.state.recent[(op % SLOTS as u64) as usize] else { return };
        let others = (0..n).filter(|r| *r != me);
        if check_fingerprints(d.shm, Seen::History(op), &fp, check_word(&fp.words()), others).is_err() {
            return;
        }
        d.state.checked += 1;
    }
}

/// Waits until every rank has stamped ops `d.state.checked..=last` (at most [`EAGER`] + 1 of
/// this rank's latest ops) and checks their fingerprints against this rank's, oldest first.
fn check_through(ctx: &mut Ctx<'_>, d: &mut Direct<'_>, last: u64) -> Result<()> {
    let n = ctx.size;
    while d.state.checked <= last {
        let op = d.state.checked;
        let slot = (op % SLOTS as u64) as usize;
        let fp = d.state.recent[slot].expect("this rank's fingerprint of each of its last SLOTS ops");
        arrive_wait(ctx, d.shm, &fp, slot, op + 1, 0..n)?;
        let others = (0..n).filter(|r| *r != d.shm.rank());
        check_fingerprints(d.shm, Seen::History(op), &fp, check_word(&fp.words()), others)?;
        d.state.checked += 1;
    }
    Ok(())
}

/// Waits until the slots `slot` of `ranks` carry `stamp` (the op `fp`) or a later one, or fails
/// naming a rank that runs another op at `fp`'s sequence number over the links (announced).
fn arrive_wait(
    ctx: &mut Ctx<'_>,
    shm: &ShmDirect,
    fp: &Fingerprint,
    slot: usize,
    stamp: u64,
    ranks: std::ops::Range<usize>,
) -> Result<()> {
    let tag = announce_tag(fp.seq);
    let elsewhere = std::cell::Cell::new(None);
    let mut lagging = || {
        let r = ranks.clone().find(|r| shm.slot_stamp(*r, slot) < stamp)?;
        match shm.announced(r, tag) {
            Some(record) => {
                elsewhere.set(Some((r, record)));
                None
            }
            None => Some(r),
        }
    };
    // Peers are often right there: poll their stamps briefly before the doorbell protocol.
    for _ in 0..shm.arrival_polls() {
        if lagging().is_none() {
            break;
        }
        std::hint::spin_loop();
    }
    ctx.wait_until(&mut lagging)?;
    match elsewhere.take() {
        Some((r, record)) => {
            Err(path_mismatch(r, &record, fp, "through the agreement phase", "on the direct shared-memory path"))
        }
        None => Ok(()),
    }
}

/// The check word of a fingerprint (its [`Fingerprint::words`]): a 64-bit hash that arrival
/// compares first, on the stamp's own cache line; the whole fingerprint (the next line) is read
/// only when they differ.
fn check_word(words: &[u64; FP_WORDS]) -> u64 {
    words.iter().fold(0x9E37_79B9_7F4A_7C15u64, |h, w| (h ^ w).wrapping_mul(0xFF51_AFD7_ED55_8CCD).rotate_left(29))
}

/// Checks that `ranks` (which stamped the op `fp` or a later one) ran `fp` there: their check
/// words, read where `seen` says, against `check` (`fp`'s), and where one differs, the whole
/// fingerprint.
fn check_fingerprints(
    shm: &ShmDirect,
    seen: Seen,
    fp: &Fingerprint,
    check: u64,
    ranks: impl Iterator<Item = usize>,
) -> Result<()> {
    for r in ranks {
        // Rank r stamped this op; it rewrites its slot (when `seen` is the slot) only once
        // this rank has stamped a later op, and its history entry only once this rank has
        // stamped op + HISTORY − EAGER, after this check (module docs).
        let theirs_check = match seen {
            Seen::Slot(slot) => shm.slot_check(r, slot),
            Seen::History(op) => shm.history_check(r, op),
        };
        if theirs_check == check {
            continue;
        }
        // As above.
        let h = match seen {
            Seen::Slot(slot) => shm.slot_header_snapshot(r, slot),
            Seen::History(op) => shm.history_header(r, op),
        };
        let theirs = Fingerprint::decode_from(&h[..FP_BYTES], r)?;
        if theirs != *fp {
            return Err(Error::new(
                ErrorKind::Mismatch,
                format!("ranks called different collectives: rank {r} called {theirs}, this rank called {fp}"),
            )
            .with_peer(r));
        }
    }
    Ok(())
}

/// The announcement tag of the world op with sequence number `seq` (never 0).
fn announce_tag(seq: u64) -> u64 {
    seq.wrapping_add(1).max(1)
}

/// The error of a rank that runs `mine` `my_path` while world rank `r` runs the op whose
/// encoded fingerprint is `theirs` `their_path` at the same sequence number.
fn path_mismatch(r: usize, theirs: &[u8], mine: &Fingerprint, their_path: &str, my_path: &str) -> Error {
    let theirs = match Fingerprint::decode(&theirs[..FP_BYTES]) {
        Ok(f) => f,
        Err(e) => return e.with_peer(r),
    };
    let how = if theirs == *mine {
        format!(
            " ({their_path} there, {my_path} here: ranks chose different algorithms for it; \
             pass the same algorithm on every rank)"
        )
    } else {
        String::new()
    };
    Error::new(
        ErrorKind::Mismatch,
        format!("ranks called different collectives: rank {r} called {theirs}, this rank called {mine}{how}"),
    )
    .with_peer(r)
}

/// How a world op that talks over links (agreement first) meets ranks that may run direct ops
/// (see the module docs): the native backend hands the workspaces to the engine as its
/// [`PeerWatch`], and [`Ctx::watched`] announces the op and runs [`no_direct_peer`] whenever
/// it would sleep.
impl PeerWatch for ShmDirect {
    fn announce(&self, fp: &Fingerprint) {
        ShmDirect::announce(self, announce_tag(fp.seq), &fp.encode());
    }

    fn check(&self, rank: usize, fp: &Fingerprint) -> Result<()> {
        no_direct_peer(self, rank, fp)
    }
}

/// `Err` ([`ErrorKind::Mismatch`]) if a peer's slot says it runs a direct op at `fp`'s
/// sequence number, which this rank (running `fp` over the links) will never join.
pub(crate) fn no_direct_peer(shm: &ShmDirect, me: usize, fp: &Fingerprint) -> Result<()> {
    for r in (0..shm.size()).filter(|r| *r != me) {
        for slot in 0..SLOTS {
            let h = shm.slot_header_snapshot(r, slot);
            // Torn or stale headers do not decode or carry another sequence number.
            match Fingerprint::decode(&h[..FP_BYTES]) {
                Ok(theirs) if theirs.seq == fp.seq && theirs.group == fp.group => {
                    return Err(path_mismatch(
                        r,
                        &h,
                        fp,
                        "on the direct shared-memory path",
                        "through the agreement phase",
                    ))
                }
                _ => {}
            }
        }
    }
    Ok(())
}

/// Waits until every rank's counter `c` is at least `value`.
pub(super) fn wait_counter(ctx: &mut Ctx<'_>, shm: &ShmDirect, c: Counter, value: u64) -> Result<()> {
    let n = ctx.size;
    ctx.wait_until(|| (0..n).find(|r| shm.counter(*r, c) < value))
}

/// Waits until rank `r`'s counter `c` is at least `value`.
pub(super) fn wait_peer_counter(ctx: &mut Ctx<'_>, shm: &ShmDirect, r: usize, c: Counter, value: u64) -> Result<()> {
    ctx.wait_until(|| (shm.counter(r, c) < value).then_some(r))
}

/// Bytes of one *part*: the unit in which a rank copies into its half and a reader follows it
/// (`Counter::PartsIn`), so that the reader copies part j out while the writer copies part
/// j + 1 in, and a chunk moved from one rank to another costs about one copy plus one part
/// instead of two copies. 16 KiB: with inputs rewritten before every op, 2 ranks, parts of 8
/// and 16 KiB were as fast as each other and faster than 32 and 64 KiB for gather, scatter and
/// broadcast from 64 KiB to 512 KiB, and whole chunks (the protocol before parts) slowest
/// (docs/perf_fresh_inputs.md). Every rank must use the same value: a reader trusts part j to
/// be where its own arithmetic puts it.
pub(super) const PART_BYTES: usize = 16 << 10;

/// Upper bound on the parts of one chunk: `Counter::PartsIn` holds `g · PARTS_MAX + j + 1`
/// once parts `0..=j` of chunk `g` are in, so it grows with every part of every chunk.
const PARTS_MAX: u64 = (CHUNK_BYTES / PART_BYTES) as u64;

// Parts are whole cache lines and whole elements of every dtype.
const _: () = assert!(PART_BYTES % 64 == 0 && CHUNK_BYTES % PART_BYTES == 0);

/// How many parts `len` bytes make (the same on every rank for the same `len`).
pub(super) fn part_count(len: usize) -> usize {
    len.div_ceil(PART_BYTES)
}

/// Part `j` of `len` bytes (empty from [`part_count`] on).
pub(super) fn part(len: usize, j: usize) -> std::ops::Range<usize> {
    (j * PART_BYTES).min(len)..((j + 1) * PART_BYTES).min(len)
}

/// The parts of `len` bytes, in order.
pub(super) fn parts(len: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    (0..part_count(len)).map(move |j| part(len, j))
}

/// Publishes that this rank has copied parts `0..=j` of chunk `g` into its half.
///
/// Quietly: a part rings no doorbell. Every writer publishes `copied_in` (which rings) right
/// after its last part, so a reader asleep in [`wait_part`] (ranks sharing cores) wakes then
/// and finds every part in; one that spins follows part by part. Ringing every part woke each
/// sleeping rank up to 32 times a chunk, each a system call and a rank taking the core from
/// the writer: 4 ranks on 2 cores ran gather at 512 KiB–1 MiB 1.5–2.6× slower than whole
/// chunks did (docs/perf_fresh_inputs.md).
pub(super) fn publish_part(shm: &ShmDirect, g: u64, j: usize) {
    debug_assert!((j as u64) < PARTS_MAX, "part {j} of a chunk of at most {PARTS_MAX} parts");
    shm.publish_quiet(Counter::PartsIn, g * PARTS_MAX + j as u64 + 1);
}

/// Whether a reader here follows the writers part by part ([`wait_part`]) in an op whose
/// output here is `total` bytes. Not when ranks share cores (`own_core` false:
/// [`ShmDirect::each_rank_has_a_core`]): a reader
/// that waits for a writer descheduled on its own core spins out its budget once per part
/// instead of once per chunk (4 ranks on 2 cores, inputs rewritten before every op: all_to_all
/// at 64–512 KiB 1.2–1.8× slower following parts). Not from [`STREAM_FROM`] bytes of output,
/// where the copy-out streams to memory and a 2-rank scatter of 32–64 MiB ran 1.6–2.3× slower
/// following parts. A local choice: writers publish every part either way.
pub(super) fn follows_parts(own_core: bool, total: usize) -> bool {
    own_core && total < STREAM_FROM
}

/// Waits until rank `r` has copied parts `0..=j` of chunk `g` into its half: part by part
/// when `follow` ([`follows_parts`]), else until it has published the whole chunk
/// (`copied_in`, which every writer publishes right after its last part).
pub(super) fn wait_part(ctx: &mut Ctx<'_>, shm: &ShmDirect, r: usize, g: u64, j: usize, follow: bool) -> Result<()> {
    let want = g * PARTS_MAX + j as u64 + 1;
    if shm.counter(r, Counter::PartsIn) >= want {
        return Ok(());
    }
    if !follow {
        return wait_peer_counter(ctx, shm, r, Counter::CopiedIn, g + 1);
    }
    wait_peer_counter(ctx, shm, r, Counter::PartsIn, want)
}

/// Direct barrier: arrival alone.
pub(crate) fn barrier(ctx: &mut Ctx<'_>, d: &mut Direct<'_>, fp: &Fingerprint) -> Result<()> {
    arrive(ctx, d, fp, &[]).map(|_| ())
}
