//! Direct shared-memory collectives: ranks on one host read each other's workspaces
//! ([`ShmDirect`]) instead of sending bytes through rings.
//!
//! **Arrival** (every direct op starts with it): a rank writes its fingerprint (and, for small
//! messages, its payload) into its slot for the op's parity and stamps it; it then waits for
//! every rank's stamp and compares every fingerprint with its own before touching the user's
//! buffer, so the agreement costs no extra round. A slot is rewritten two ops later, which
//! is safe because finishing the op in between required every rank to arrive at it (so it had
//! finished reading the older slot).
//!
//! **Small all-reduce** (≤ [`SMALL_BYTES`]): after arrival every rank reduces all payloads in
//! rank order (identical results everywhere). One step; each rank writes S and reads n·S.
//!
//! **Large all-reduce**, per chunk of [`CHUNK_BYTES`] (two halves, so chunk g+1 overlaps
//! with the tail of chunk g): copy every slice but my own into my chunk buffer → reduce my
//! 1/n slice of the user's buffer in place with every other rank's chunk buffer, 16 KiB at a
//! time, copying each reduced piece (still in L1) to my chunk buffer → copy every other rank's
//! reduced slice into the user's buffer. Three steps per chunk; per rank (n−1)/n·S copied in,
//! S read and 2S/n written by the reduction, (n−1)/n·S copied out (writing the user's slice
//! from the reduction instead of copying it out made 2 ranks 20–30% faster at 1–16 MiB). Chunks are
//! small enough to stay in the L2 cache between the steps. Out of place
//! ([`ReduceBuffers::Apart`]) the same steps read the input and write the output, each
//! reduced piece being copied from the input into the output just before it is reduced there.
//!
//! **Broadcast**: small payloads travel in the root's slot; large ones chunk by chunk through
//! the root's input region. **Barrier**: arrival alone.
//!
//! Progress counters (`copied_in`, `reduced`, `copied_out`) count chunks over the life of the
//! communicator; every rank moves each of them by the same amount in every op.
//!
//! **Meeting the other ops.** A world op that does not take the direct path (it agrees over
//! the links first, [`beside_direct`]) announces its fingerprint in this rank's workspace; a
//! rank arriving at a direct op at the same sequence number sees that announcement where it
//! waits for the peer's stamp, and the announcing rank, whenever it would sleep, looks for a
//! peer's slot header carrying its sequence number. Either way both fail at once with
//! [`ErrorKind::Mismatch`] and both fingerprints, instead of waiting for each other until the
//! deadline. The direct ops' fast path pays one load of the peer's announcement line, and only
//! while a peer is late.

use super::schedule::chunk;
use super::ReduceBuffers;
use crate::copy::copy;
use crate::dtype::{as_bytes, as_bytes_mut, Element};
use crate::engine::{Ctx, Watch};
use crate::error::{Error, ErrorKind, Result};
use crate::reduce::{self, ReduceOp};
use crate::transport::shm::workspace::{Counter, ShmDirect, CHUNK_BYTES, SLOT_HEADER, SMALL_BYTES};

use crate::wire::{Fingerprint, FP_BYTES};

/// Bytes reduced at a time in the large all-reduce's reduce step (fits in L1 with its inputs).
const REDUCE_PIECE_BYTES: usize = 16 * 1024;

/// Per-communicator progress of the direct protocol (identical on every rank).
#[derive(Debug, Default)]
pub(crate) struct DirectState {
    /// Direct ops arrived at so far.
    pub ops: u64,
    /// Chunks processed so far.
    pub chunks: u64,
}

/// The direct view and its state, as an algorithm sees them.
pub(crate) struct Direct<'a> {
    pub shm: &'a ShmDirect,
    pub state: &'a mut DirectState,
}

/// Whether a buffer of `bytes` goes inline in the slot.
pub(crate) fn is_small(bytes: usize) -> bool {
    bytes <= SMALL_BYTES
}

/// Writes this rank's slot and waits for every rank's; checks the fingerprints. Returns the
/// slot parity of this op.
fn arrive(ctx: &mut Ctx<'_>, d: &mut Direct<'_>, fp: &Fingerprint, payload: &[u8]) -> Result<usize> {
    let parity = (d.state.ops & 1) as usize;
    let stamp = d.state.ops + 1;
    d.state.ops += 1;
    debug_assert_eq!(FP_BYTES + 8, SLOT_HEADER);
    let mut header = [0u8; FP_BYTES + 8];
    header[..FP_BYTES].copy_from_slice(&fp.encode());
    header[FP_BYTES..].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    // SAFETY: parity protocol (module docs): every rank arrived at the previous op, so no one
    // still reads the slot of the op before it, which this write replaces.
    unsafe { d.shm.write_slot(parity, stamp, &header, payload) };
    let shm = d.shm;
    let n = ctx.size;
    // A late peer may be running another op at this sequence number (announced).
    let tag = announce_tag(fp.seq);
    let elsewhere = std::cell::Cell::new(None);
    let mut lagging = || {
        let r = (0..n).find(|r| shm.slot_stamp(*r, parity) != stamp)?;
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
    if let Some((r, record)) = elsewhere.take() {
        return Err(path_mismatch(r, &record, fp, "through the agreement phase", "on the direct shared-memory path"));
    }
    for r in 0..n {
        // SAFETY: rank r stamped this slot for this op; it rewrites it only two ops later.
        let (h, _) = unsafe { shm.slot(r, parity, 0) };
        if h[..FP_BYTES] == header[..FP_BYTES] {
            continue;
        }
        let theirs = Fingerprint::decode_from(&h[..FP_BYTES], r)?;
        if theirs != *fp {
            return Err(Error::new(
                ErrorKind::Mismatch,
                format!("ranks called different collectives: rank {r} called {theirs}, this rank called {fp}"),
            )
            .with_peer(r));
        }
    }
    Ok(parity)
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

/// Runs `f`, a world op at `ctx`'s rank that talks over links (agreement first), beside ranks
/// that may run direct ops: announces `fp` to them and, while `f` waits, checks that no peer
/// runs a direct op at the same sequence number (see the module docs). Without the direct path
/// (other transports, subgroups) it is just `f`.
pub(crate) fn beside_direct<R>(
    ctx: &mut Ctx<'_>,
    fp: &Fingerprint,
    f: impl FnOnce(&mut Ctx<'_>) -> Result<R>,
) -> Result<R> {
    let Some(shm) = ctx.shm else { return f(ctx) };
    shm.announce(announce_tag(fp.seq), &fp.encode());
    let before = ctx.watch.replace(Watch { fp: *fp, check: no_direct_peer });
    let r = f(ctx);
    ctx.watch = before;
    // A peer that saw the mismatch first may have closed its links: name the op it runs
    // rather than report its close.
    r.map_err(|e| no_direct_peer(shm, ctx.rank, fp).err().unwrap_or(e))
}

/// `Err` ([`ErrorKind::Mismatch`]) if a peer's slot says it runs a direct op at `fp`'s
/// sequence number, which this rank (running `fp` over the links) will never join.
pub(crate) fn no_direct_peer(shm: &ShmDirect, me: usize, fp: &Fingerprint) -> Result<()> {
    for r in (0..shm.size()).filter(|r| *r != me) {
        for parity in 0..2 {
            let h = shm.slot_header_snapshot(r, parity);
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
fn wait_counter(ctx: &mut Ctx<'_>, shm: &ShmDirect, c: Counter, value: u64) -> Result<()> {
    let n = ctx.size;
    ctx.wait_until(|| (0..n).find(|r| shm.counter(*r, c) < value))
}

/// Direct all-reduce (`op` is the combiner; `Avg` is finished by the caller).
pub(crate) fn all_reduce<'b, T: Element>(
    ctx: &mut Ctx<'_>,
    d: &mut Direct<'_>,
    fp: &Fingerprint,
    mut io: ReduceBuffers<'b, T>,
    op: ReduceOp,
) -> Result<&'b mut [T]> {
    let total = io.len();
    let bytes = total * std::mem::size_of::<T>();
    if is_small(bytes) {
        let parity = arrive(ctx, d, fp, as_bytes(io.input(0..total)))?;
        let out = io.into_output();
        for r in 0..ctx.size {
            // SAFETY: stamped for this op (arrive waited for it); read before the slot can be
            // reused (two ops later).
            let (_, payload) = unsafe { d.shm.slot(r, parity, bytes) };
            if r == 0 {
                copy(as_bytes_mut(out), payload);
            } else {
                reduce::reduce_into(out, bytemuck::cast_slice(payload), op);
            }
        }
        return Ok(out);
    }
    arrive(ctx, d, fp, &[])?;
    let (n, me, size) = (ctx.size, ctx.rank, std::mem::size_of::<T>());
    let per_chunk = CHUNK_BYTES / size;
    for start in (0..total).step_by(per_chunk) {
        let part_len = (start + per_chunk).min(total) - start;
        let g = d.state.chunks;
        let half = (g & 1) as usize;
        let shm = d.shm;
        // Slice r of this chunk, as a range of the whole buffer.
        let slice = |r: usize| {
            let s = chunk(part_len, n, r);
            start + s.start..start + s.end
        };
        // Half `half` was last used by chunk g-2: everyone must be done reading it.
        wait_counter(ctx, shm, Counter::CopiedOut, g.saturating_sub(1))?;
        for r in (0..n).filter(|r| *r != me) {
            let s = slice(r);
            let off = (s.start - start) * size;
            // SAFETY: others read slice r of my buffer only after I publish CopiedIn = g+1, and
            // they finished with chunk g-2 (waited above).
            copy(unsafe { shm.chunk_mut(half, off, s.len() * size) }, as_bytes(io.input(s)));
        }
        shm.publish(Counter::CopiedIn, g + 1);
        wait_counter(ctx, shm, Counter::CopiedIn, g + 1)?;
        let mine = slice(me);
        if !mine.is_empty() {
            let (off, len) = ((mine.start - start) * size, mine.len() * size);
            // SAFETY: slice `me` of my buffer is read by others only after I publish
            // Reduced = g+1; the other ranks' slices `me` were published for chunk g and are
            // not rewritten before everyone published CopiedOut = g+1.
            let dst: &mut [T] = bytemuck::cast_slice_mut(unsafe { shm.chunk_mut(half, off, len) });
            // SAFETY: as above, for the other ranks' published slices.
            let theirs = |r: usize| -> &[T] { bytemuck::cast_slice(unsafe { shm.chunk(r, half, off, len) }) };
            // In L1-sized pieces: reduce into the result's buffer (apart: after copying the
            // input's piece there), then copy the piece (still in L1) to my chunk buffer for
            // the others; so my own slice needs no copy-out.
            let piece = (REDUCE_PIECE_BYTES / size).max(1);
            for lo in (0..mine.len()).step_by(piece) {
                let hi = (lo + piece).min(mine.len());
                let user = io.loaded(mine.start + lo..mine.start + hi);
                for r in (0..n).filter(|r| *r != me) {
                    reduce::reduce_into(user, &theirs(r)[lo..hi], op);
                }
                copy(as_bytes_mut(&mut dst[lo..hi]), as_bytes(user));
            }
        }
        shm.publish(Counter::Reduced, g + 1);
        wait_counter(ctx, shm, Counter::Reduced, g + 1)?;
        for r in (0..n).filter(|r| *r != me) {
            let s = slice(r);
            if s.is_empty() {
                continue;
            }
            let off = (s.start - start) * size;
            // SAFETY: rank r published its reduced slice for chunk g and rewrites it only after
            // everyone (me included) published CopiedOut = g+1.
            let src = unsafe { shm.chunk(r, half, off, s.len() * size) };
            copy(as_bytes_mut(io.output(s)), src);
        }
        shm.publish(Counter::CopiedOut, g + 1);
        d.state.chunks += 1;
    }
    Ok(io.into_output())
}

/// Direct broadcast from group rank `root`.
pub(crate) fn broadcast<T: Element>(
    ctx: &mut Ctx<'_>,
    d: &mut Direct<'_>,
    fp: &Fingerprint,
    buf: &mut [T],
    root: usize,
) -> Result<()> {
    let bytes = std::mem::size_of_val(buf);
    let me = ctx.rank;
    if is_small(bytes) {
        let parity = arrive(ctx, d, fp, if me == root { as_bytes(buf) } else { &[] })?;
        if me != root {
            // SAFETY: the root stamped its slot for this op; it is reused two ops later.
            let (_, payload) = unsafe { d.shm.slot(root, parity, bytes) };
            copy(as_bytes_mut(buf), payload);
        }
        return Ok(());
    }
    arrive(ctx, d, fp, &[])?;
    let per_chunk = CHUNK_BYTES / std::mem::size_of::<T>();
    let total = buf.len();
    for start in (0..total).step_by(per_chunk) {
        let part = &mut buf[start..(start + per_chunk).min(total)];
        let g = d.state.chunks;
        let half = (g & 1) as usize;
        let shm = d.shm;
        let len = std::mem::size_of_val(part);
        if me == root {
            wait_counter(ctx, shm, Counter::CopiedOut, g.saturating_sub(1))?;
            // SAFETY: as in all_reduce's copy-in.
            copy(unsafe { shm.chunk_mut(half, 0, len) }, as_bytes(part));
            shm.publish(Counter::CopiedIn, g + 1);
            shm.publish(Counter::Reduced, g + 1);
            shm.publish(Counter::CopiedOut, g + 1);
        } else {
            shm.publish(Counter::CopiedIn, g + 1);
            shm.publish(Counter::Reduced, g + 1);
            let n = ctx.size;
            ctx.wait_until(|| (shm.counter(root, Counter::CopiedIn) < g + 1).then_some(root.min(n - 1)))?;
            // SAFETY: the root published chunk g and rewrites this half only after every rank
            // published CopiedOut = g+1.
            copy(as_bytes_mut(part), unsafe { shm.chunk(root, half, 0, len) });
            shm.publish(Counter::CopiedOut, g + 1);
        }
        d.state.chunks += 1;
    }
    Ok(())
}

/// Direct barrier: arrival alone.
pub(crate) fn barrier(ctx: &mut Ctx<'_>, d: &mut Direct<'_>, fp: &Fingerprint) -> Result<()> {
    arrive(ctx, d, fp, &[]).map(|_| ())
}
