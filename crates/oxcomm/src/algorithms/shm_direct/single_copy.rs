//! Single-copy moves for the direct ops that only move data (all_gather, all_to_all, gather,
//! scatter, broadcast): a rank exposes the address of the buffer it sends from in its arrival
//! payload, and each reader copies its part straight from that buffer into its own with one
//! cross-memory read ([`crate::transport::shm::single_copy`]), instead of the sender copying
//! into its chunk buffer and the reader copying out of it.
//!
//! Per op: arrival (the address travels inline, with a word of the op's: 16 bytes) → each rank reads what it needs
//! from each peer it reads → it publishes that it is done (`CopiedOut`; `CopiedIn` and
//! `Reduced` move with it, one chunk, so every counter keeps moving in lockstep) → a rank
//! whose buffer others read waits until they are done before it returns (the caller may then
//! reuse the buffer). Per rank: its share copied once; no chunk buffer is touched.
//!
//! **When.** Every process must be able to read every peer: the first op that would use it
//! runs its usual path, and after its arrival every rank reads each peer's probe word and
//! publishes its verdict (whether it can, and whether it shares its core); the ops after it use
//! single copy only if every verdict says yes (the same on every rank, from state every rank
//! holds alike). Blocks from [`FROM`] bytes ([`SHARED_CORES_FROM`] where ranks share cores) up
//! to [`SPREAD_UNTIL`] (all_gather, all_to_all) or [`ROOTED_UNTIL`] (gather, scatter,
//! broadcast) use it; outside, the slot or chunked paths measured faster (docs/benchmarks.md).
//! `OXCOMM_SHM_SINGLE_COPY=0` turns it off (set it alike on every rank; a rank with it off
//! says no, so every rank keeps the chunked path).

use std::ops::Range;

use super::{wait_counter, wait_peer_counter, Direct};
use crate::engine::Ctx;
use crate::error::{Error, ErrorKind, Result};
use crate::transport::shm::single_copy;
use crate::transport::shm::workspace::Counter;
use crate::wire::FP_BYTES;

/// Smallest block (bytes one rank reads from one peer) that moves by single copy: below it
/// the read's fixed cost (a system call that pins the peer's pages) is more than the copies
/// through a slot cost. all_gather on 2 ranks, µs per op, slot path against single copy:
/// 4 KiB blocks 1.6 / 1.6, 8 KiB 2.5–2.7 / 1.8–1.9, 16 KiB 4.0–4.7 / 2.4, 32 KiB 7.4–7.8 / 3.2.
/// The rooted ops keep the slot path for small blocks, where a rank that only publishes
/// returns at once (single copy makes it wait for its reader).
pub(super) const FROM: usize = 8 << 10;
/// [`FROM`] when some rank shares its core with another: single copy's second wait (for the
/// readers) then costs a trip through the scheduler. all_gather on 4 ranks on 2 cores, µs per
/// op, 32 KiB and 64 KiB in all: 16.6 and 15.3 from 8 KiB blocks, 7.2–10.9 and 11.9–17.4
/// from 32 KiB.
pub(super) const SHARED_CORES_FROM: usize = 32 << 10;
/// Blocks from this size take the chunked path again in all_gather and all_to_all, whose
/// chunked copy-out streams into the caller's buffer (2 ranks, this VM: single copy 1.3–2.5×
/// the chunked busbw from 128 KiB to 16 MiB of output, 0.8–0.9× from 64 MiB).
pub(super) const SPREAD_UNTIL: usize = 16 << 20;
/// Blocks from this size take the chunked path again in the rooted ops (gather, scatter,
/// broadcast), where one rank's buffer is the only source or destination (single copy 1.5–3×
/// up to 1 MiB blocks, 0.85–0.95× from 2 MiB).
pub(super) const ROOTED_UNTIL: usize = 2 << 20;

/// Whether this op, with blocks of `block` bytes, moves them by single copy below `until`
/// ([`SPREAD_UNTIL`] or [`ROOTED_UNTIL`]); decided before arrival, identically on every rank.
pub(super) fn planned(d: &Direct<'_>, block: usize, until: usize) -> bool {
    d.state.single_copy_from.is_some_and(|from| (from..until).contains(&block))
}

/// After the arrival of an op with blocks of `block` bytes that did not plan single copy:
/// the first time such an op could have used it, every rank finds out whether it can read
/// every peer, and every rank learns every verdict.
pub(super) fn learn(ctx: &mut Ctx<'_>, d: &mut Direct<'_>, block: usize, until: usize) -> Result<()> {
    if d.state.single_copy_from.is_some() || !(FROM..until).contains(&block) {
        return Ok(());
    }
    let (n, me, shm) = (ctx.size, ctx.rank, d.shm);
    let wanted = std::env::var("OXCOMM_SHM_SINGLE_COPY").map_or(true, |v| v != "0");
    let can = wanted && (0..n).filter(|r| *r != me).all(|r| shm.probe_peer(r));
    if shm.single_copy_verdict(me) == 0 {
        let verdict = match (can, shm.arrival_polls() > 0) {
            (false, _) => Verdict::No,
            (true, true) => Verdict::OwnCore,
            (true, false) => Verdict::SharedCores,
        };
        shm.publish_single_copy_verdict(verdict as u64);
    }
    ctx.wait_until(|| (0..n).find(|r| shm.single_copy_verdict(*r) == 0))?;
    let verdicts: Vec<u64> = (0..n).map(|r| shm.single_copy_verdict(r)).collect();
    d.state.single_copy_from =
        Some(if verdicts.iter().any(|v| *v != Verdict::OwnCore as u64 && *v != Verdict::SharedCores as u64) {
            usize::MAX
        } else if verdicts.contains(&(Verdict::SharedCores as u64)) {
            SHARED_CORES_FROM
        } else {
            FROM
        });
    Ok(())
}

/// What a rank publishes once it has probed its peers (0 in the word: not yet).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    /// It reads every peer, and has a core of its own.
    OwnCore = 1,
    /// It cannot read some peer (or single copy is turned off here).
    No = 2,
    /// It reads every peer, but ranks share its core.
    SharedCores = 3,
}

/// The arrival payload that exposes a buffer starting at `addr`, with a word of the op's own
/// (all_to_all: whether this rank works in place).
pub(super) fn expose(addr: *const u8, word: u64) -> [u8; 16] {
    let mut payload = [0u8; 16];
    payload[..8].copy_from_slice(&(addr as u64).to_le_bytes());
    payload[8..].copy_from_slice(&word.to_le_bytes());
    payload
}

/// The address and the word rank `r` exposed in its arrival payload for this op (slot
/// `parity`); a payload of another length (a rank that did not plan single copy) is a protocol
/// error naming it, never an older op's address.
pub(super) fn exposed(d: &Direct<'_>, parity: usize, r: usize) -> Result<(u64, u64)> {
    // SAFETY: stamped for this op (the caller's arrival waited for it); the slot is reused two
    // ops later.
    let (header, payload) = unsafe { d.shm.slot(r, parity, 16) };
    let word = |b: &[u8], at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
    let len = word(header, FP_BYTES);
    if len != 16 {
        return Err(Error::protocol(format!(
            "rank {r} published {len} bytes where single copy expects its buffer's address (16)"
        ))
        .with_peer(r));
    }
    Ok((word(payload, 0), word(payload, 8)))
}

/// Copies `bytes` of the buffer rank `r` exposed at `addr` into `dst`. A rank that exited is
/// [`ErrorKind::PeerGone`]; an address it cannot read there is a protocol error naming it.
pub(super) fn read(
    ctx: &mut Ctx<'_>,
    d: &Direct<'_>,
    r: usize,
    addr: u64,
    bytes: Range<usize>,
    dst: &mut [u8],
) -> Result<()> {
    debug_assert_eq!(bytes.len(), dst.len());
    if dst.is_empty() {
        return Ok(());
    }
    ctx.count_read_directly(dst.len());
    let from = addr.checked_add(bytes.start as u64).ok_or_else(|| bad_address(r, addr))?;
    let failed = match single_copy::read(d.shm.pid(r), from, dst) {
        Ok(()) => return Ok(()),
        Err(e) => e,
    };
    // A rank that aborted (and may have exited since) names the rank to blame in its link;
    // that error wins over what the read saw of its memory.
    if let Some(e) = ctx.peer_failure(r) {
        return Err(e);
    }
    Err(match failed {
        rustix::io::Errno::SRCH => {
            Error::new(ErrorKind::PeerGone, format!("rank {r} exited while this rank read its buffer")).with_peer(r)
        }
        e => Error::protocol(format!("reading {} bytes of rank {r}'s buffer at {from:#x} failed: {e}", dst.len()))
            .with_peer(r),
    })
}

fn bad_address(r: usize, addr: u64) -> Error {
    Error::protocol(format!("rank {r} exposed a buffer at {addr:#x}, which does not fit the op")).with_peer(r)
}

/// Ends a single-copy op: publishes that this rank is done reading, then waits until every
/// rank `readers` names (the ones that read this rank's buffer) is done too.
pub(super) fn finish(ctx: &mut Ctx<'_>, d: &mut Direct<'_>, readers: Readers) -> Result<()> {
    let (g, shm) = (d.state.chunks, d.shm);
    shm.publish(Counter::CopiedIn, g + 1);
    shm.publish(Counter::Reduced, g + 1);
    shm.publish(Counter::CopiedOut, g + 1);
    d.state.chunks += 1;
    match readers {
        Readers::Everyone => wait_counter(ctx, shm, Counter::CopiedOut, g + 1),
        Readers::Rank(r) => wait_peer_counter(ctx, shm, r, Counter::CopiedOut, g + 1),
        Readers::Nobody => Ok(()),
    }
}

/// Who reads a rank's exposed buffer in an op.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Readers {
    /// Every other rank (all_gather, all_to_all, a scatter's or broadcast's root).
    Everyone,
    /// One rank (a gather's non-root: the root).
    Rank(usize),
    /// Nobody (a gather's root, a scatter's or broadcast's non-root).
    Nobody,
}
