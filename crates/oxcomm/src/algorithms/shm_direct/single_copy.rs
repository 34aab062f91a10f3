//! Single-copy moves for all_gather and all_to_all: a rank exposes the address of the buffer
//! it sends from in its arrival payload, and each reader copies its part straight from that
//! buffer into its own with one cross-memory read ([`crate::transport::shm::single_copy`]),
//! instead of the sender copying into its chunk buffer and the reader copying out of it.
//!
//! Per op: arrival (the address travels inline, with a word of the op's: 16 bytes) → each
//! rank reads its block from every peer → it publishes that it is done (`CopiedOut`;
//! `CopiedIn` and `Reduced` move with it, one chunk, so every counter keeps moving in
//! lockstep) → it waits until every peer is done reading its buffer before it returns (the
//! caller may then reuse the buffer). Per rank: its share copied once; no chunk buffer is
//! touched.
//!
//! **When.** Every process must be able to read every peer: the first op that could use it
//! runs the chunked path, and after its arrival every rank reads each peer's probe word and
//! publishes its verdict; the ops after it use single copy only if every verdict says yes (the
//! same on every rank, from state every rank holds alike). Blocks of [`FROM`]..[`UNTIL`] bytes
//! use it. The limits come from a loop that rewrites what it sends before every op, as training
//! does: there the read's fixed cost (a system call that pins the peer's pages) and the copy
//! from lines dirty in the owner's cache lose to the chunked path's two copies on two cores up
//! to 256 KiB blocks, and single copy wins from about 1 MiB (docs/benchmarks.md; a benchmark
//! that sends the same unchanged buffer every time flatters single copy far below that). The
//! rooted ops (gather, scatter, broadcast) lost at every size, so they do not use it.
//!
//! **Off by default** since the chunked path follows the writer part by part and watches for
//! far cores (`copy_in.rs`): with fresh inputs on 2 ranks it then beat single copy at every
//! block size this took, 1–16 MiB of all_gather output, both when the host placed the two
//! vCPUs near (in place 1 MiB 33 µs against 55) and far apart (53 against 91), and
//! `process_vm_readv` itself moves 5–7 GB/s here where the chunk scheme moves 8–10
//! (`bench/floor_cma.c`; docs/perf_large_fresh.md). `OXCOMM_SHM_SINGLE_COPY=1` turns it on
//! (set it alike on every rank; a rank without it says no, so every rank keeps the chunked
//! path).

use std::ops::Range;

use super::{wait_counter, Direct};
use crate::engine::Ctx;
use crate::error::{Error, ErrorKind, Result};
use crate::transport::shm::single_copy;
use crate::transport::shm::workspace::Counter;
use crate::wire::FP_BYTES;

/// Smallest block (bytes one rank reads from one peer) that moves by single copy. all_gather
/// on 2 ranks, µs per op with the input rewritten before each, single copy / chunked: 64 KiB
/// of output 19.0 / 17.4, 256 KiB 31.7–32.2 / 29.3–30.0, 1 MiB 107.7–108.1 / 108.5–113.9,
/// 4 MiB 478–501 / 559–567 (all_to_all: 4 MiB 523–545 / 627–650).
pub(super) const FROM: usize = 512 << 10;
/// Blocks from this size take the chunked path again, whose copy-out streams into the
/// caller's buffer (2 ranks, this VM: the same busbw at 32–64 MiB of output, 3 rounds).
pub(super) const UNTIL: usize = 16 << 20;

/// Whether this op, with blocks of `block` bytes, moves them by single copy (decided before
/// arrival, identically on every rank).
pub(super) fn planned(d: &Direct<'_>, block: usize) -> bool {
    d.state.single_copy == Some(true) && (FROM..UNTIL).contains(&block)
}

/// After the arrival of an op with blocks of `block` bytes that did not plan single copy:
/// the first time such an op could have used it, every rank finds out whether it can read
/// every peer, and every rank learns every verdict.
pub(super) fn learn(ctx: &mut Ctx<'_>, d: &mut Direct<'_>, block: usize) -> Result<()> {
    if d.state.single_copy.is_some() || !(FROM..UNTIL).contains(&block) {
        return Ok(());
    }
    let (n, me, shm) = (ctx.size, ctx.rank, d.shm);
    let wanted = std::env::var("OXCOMM_SHM_SINGLE_COPY").is_ok_and(|v| v.trim() == "1");
    let can = wanted && (0..n).filter(|r| *r != me).all(|r| shm.probe_peer(r));
    if shm.single_copy_verdict(me) == 0 {
        shm.publish_single_copy_verdict(if can { Verdict::Yes } else { Verdict::No } as u64);
    }
    ctx.wait_until(|| (0..n).find(|r| shm.single_copy_verdict(*r) == 0))?;
    d.state.single_copy = Some((0..n).all(|r| shm.single_copy_verdict(r) == Verdict::Yes as u64));
    Ok(())
}

/// What a rank publishes once it has probed its peers (0 in the word: not yet).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    /// It reads every peer.
    Yes = 1,
    /// It cannot read some peer (or single copy is turned off here).
    No = 2,
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
/// `slot`); a payload of another length (a rank that did not plan single copy) is a protocol
/// error naming it, never an older op's address.
pub(super) fn exposed(d: &Direct<'_>, slot: usize, r: usize) -> Result<(u64, u64)> {
    // Stamped for this op (the caller's arrival waited for it); the slot is reused only
    // once this rank has arrived at a later op.
    let (header, payload) = (d.shm.slot_header_snapshot(r, slot), d.shm.slot_payload(r, slot, 16));
    let word = |b: &[u8], at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
    let len = word(&header, FP_BYTES);
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
/// rank is done too (so no one reads this rank's buffer any more).
pub(super) fn finish(ctx: &mut Ctx<'_>, d: &mut Direct<'_>) -> Result<()> {
    let (g, shm) = (d.state.chunks, d.shm);
    shm.publish(Counter::CopiedIn, g + 1);
    shm.publish(Counter::Reduced, g + 1);
    shm.publish(Counter::CopiedOut, g + 1);
    d.state.chunks += 1;
    wait_counter(ctx, shm, Counter::CopiedOut, g + 1)
}
