//! Direct all-to-all and all-to-all-v, and the *exchange* that moves blocks between ranks
//! through the chunk halves (which gather and scatter in `rooted.rs` use too).
//!
//! Vocabulary: a *block* is what rank a sends to rank b (`L[a][b]` bytes; S is one rank's
//! send buffer); a *lane* is the part of a chunk half that holds the bytes for one reader
//! ([`Lanes`]: n − 1 lanes of [`lane_bytes`] each, or one lane of the whole half); a *piece*
//! is the part of a block that crosses in one chunk step ([`piece`]).
//!
//! **Small** (every rank's send buffer fits [`SMALL_BYTES`], with all_to_all_v's count table):
//! arrival carries the buffer, then every rank copies its block out of every other rank's
//! slot. One step (the arrival); per rank S written to the slot, (n − 1)/n · S read.
//!
//! **Large**: steps = ⌈max over a ≠ b of `L[a][b]` / lane⌉ (the same on every rank). Step s of
//! chunk g: wait until every rank published `CopiedOut` = g − 1 (the half is free again) →
//! copy piece s of every block into its lane, part by part (part j of every piece, then
//! publish `parts_in`; see "Parts" in the module docs of `shm_direct`), publish `CopiedIn`
//! (and `Reduced`, unused) → copy my piece out of each of their halves, each part as soon as
//! its sender published it, publish `CopiedOut`. Per rank (n − 1)/n · S copied in and (n − 1)/n · S
//! copied out for equal blocks; the own block goes send → recv once. Uneven blocks take as
//! many steps as the largest block needs (one big pair uses 1/(n − 1) of each half).
//!
//! **In place** (equal blocks only): block p of the buffer is both what goes to rank p and
//! where rank p's block lands. Arrival copies the whole buffer into the slot before any block
//! comes in (small), and step s copies piece s of every block in before it copies the peers'
//! pieces s over them (large), so every piece leaves before it is overwritten: no extra pass.
//!
//! **Equal blocks from 512 KiB to 16 MiB** with `OXCOMM_SHM_SINGLE_COPY=1` (off by default)
//! where every rank can read its peers: each rank exposes its send buffer and reads its block
//! from every peer's straight into its receive buffer (`single_copy.rs`): per rank
//! (n − 1)/n · S copied once. When a rank works in place
//! (its arrival payload says so), every rank takes the chunked exchange instead.
//!
//! **all_to_all_v**: ranks do not know each other's counts, so the arrival payload carries
//! this rank's send and recv counts ([`CountTable`], 2n words) before the data. Every rank then
//! checks the whole count matrix (a rank's send count against its peer's recv count), so a
//! disagreement fails on every rank at once, naming the peer on the two ranks concerned,
//! before anything is written; and every rank derives the same small/large choice and step
//! count. Above 2048 ranks the table does not fit a slot: arrival agrees on the op and the
//! pairwise exchange (which checks lengths) moves the data.

use std::ops::Range;

use super::reduce_scatter::piece_index;
use super::single_copy;
use super::{
    arrive, copy_in_for, copy_out_for, follows_parts, is_small, part, part_count, publish_part, wait_counter,
    wait_part, Direct,
};
use crate::algorithms::{pairwise, ExchangeBuffers};
use crate::copy::copy;
use crate::dtype::Element;
use crate::engine::Ctx;
use crate::error::{Error, ErrorKind, Result};
use crate::transport::shm::workspace::{Counter, CHUNK_BYTES, SMALL_BYTES};
use crate::wire::{Fingerprint, FP_BYTES};

/// How a chunk half is divided between the ranks that read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Lanes {
    /// One lane per other rank, in rank order without the owner.
    PerPeer,
    /// The whole half is one lane (every rank sends to one rank at most: gather).
    One,
}

impl Lanes {
    /// Bytes of one lane among `n` ranks.
    pub(super) fn bytes(self, n: usize) -> usize {
        match self {
            Lanes::PerPeer => lane_bytes(n),
            Lanes::One => CHUNK_BYTES,
        }
    }

    /// Byte offset in `owner`'s half of the lane that `reader` reads.
    pub(super) fn offset(self, owner: usize, reader: usize, n: usize) -> usize {
        match self {
            Lanes::PerPeer => piece_index(reader, owner) * lane_bytes(n),
            Lanes::One => 0,
        }
    }
}

/// Bytes of one of the n − 1 lanes of a half: a multiple of 64, so pieces start on cache
/// lines and element boundaries (at least 256 bytes up to 2048 ranks).
pub(super) fn lane_bytes(n: usize) -> usize {
    (CHUNK_BYTES / n.saturating_sub(1).max(1)) / 64 * 64
}

/// Bytes `piece(len, lane, s)` of a block of `len` bytes that cross in step `s` (empty once
/// the block is done).
pub(super) fn piece(len: usize, lane: usize, s: usize) -> Range<usize> {
    let start = s.saturating_mul(lane).min(len);
    start..start.saturating_add(lane).min(len)
}

/// Steps that move blocks of at most `max_block` bytes through lanes of `lane` bytes.
pub(super) fn steps(max_block: usize, lane: usize) -> usize {
    max_block.div_ceil(lane)
}

/// The blocks of one exchange, in bytes: `send[p]` of what `io` sends goes to rank `p`, and
/// the block from rank `r` lands in `recv[r]` of where it receives (in place: `send[p]` and
/// `recv[p]` must be the same range). The own entries are not used.
pub(super) struct Blocks<'a> {
    pub io: ExchangeBuffers<'a, u8>,
    pub send: Vec<Range<usize>>,
    pub recv: Vec<Range<usize>>,
}

/// Moves `b` through the chunk halves in `steps` steps (identical on every rank), as the
/// module docs describe. Every rank moves each counter by `steps`.
pub(super) fn exchange(ctx: &mut Ctx<'_>, d: &mut Direct<'_>, b: Blocks<'_>, lanes: Lanes, steps: usize) -> Result<()> {
    let (n, me, shm) = (ctx.size, ctx.rank, d.shm);
    let lane = lanes.bytes(n);
    let Blocks { mut io, send, recv } = b;
    let copy_out = copy_out_for(io.recv_len());
    let follow = follows_parts(shm.each_rank_has_a_core(), io.recv_len());
    for s in 0..steps {
        let g = d.state.chunks;
        let half = (g & 1) as usize;
        // Half `half` was last read in chunk g-2: everyone must be done with it.
        wait_counter(ctx, shm, Counter::CopiedOut, g.saturating_sub(1))?;
        // Where piece s of the block for rank p is in what this rank sends, and where piece s
        // of rank r's block lands in what it receives.
        let at_step = |b: &Range<usize>, other: usize| {
            let p = if other == me { 0..0 } else { piece(b.len(), lane, s) };
            b.start + p.start..b.start + p.end
        };
        let sends = |p: usize| at_step(&send[p], p);
        let recvs = |r: usize| at_step(&recv[r], r);
        let parts_in = (0..n).map(|p| part_count(sends(p).len())).max().unwrap_or(0);
        let parts_out = (0..n).map(|r| part_count(recvs(r).len())).max().unwrap_or(0);
        let mut copy_in =
            copy_in_for((0..n).map(|p| sends(p).len() + recvs(p).len()).sum(), shm.each_rank_has_a_core());
        // Copy in, part by part: part j of every piece this rank sends, then publish it.
        for j in 0..parts_in {
            for p in 0..n {
                let sent = sends(p);
                let at = part(sent.len(), j);
                if at.is_empty() {
                    continue;
                }
                let from = sent.start + at.start..sent.start + at.end;
                // Rank p reads this part only after I publish it, and every rank finished
                // chunk g-2 (waited above), the last to read this half.
                let mut to = shm.chunk_mut(half, lanes.offset(me, p, n) + at.start, at.len());
                copy_in.copy(&mut to, io.send(from));
            }
            publish_part(shm, g, j);
        }
        copy_in.done();
        shm.publish(Counter::CopiedIn, g + 1);
        shm.publish(Counter::Reduced, g + 1);
        // Copy out, part by part, each as soon as its sender has it in (a sender that is
        // behind is followed part by part instead of waited for whole).
        for j in 0..parts_out {
            for r in 0..n {
                let got = recvs(r);
                let at = part(got.len(), j);
                if at.is_empty() {
                    continue;
                }
                wait_part(ctx, shm, r, g, j, follow)?;
                // Rank r published part j of its lanes for chunk g and rewrites them only
                // after every rank (me included) published CopiedOut = g+1.
                let from = shm.chunk(r, half, lanes.offset(r, me, n) + at.start, at.len());
                let to = got.start + at.start..got.start + at.end;
                copy_out(io.recv(to), from);
            }
        }
        shm.publish(Counter::CopiedOut, g + 1);
        d.state.chunks += 1;
    }
    Ok(())
}

/// Byte ranges of element ranges of `T`.
fn byte_ranges<T>(r: &[Range<usize>]) -> Vec<Range<usize>> {
    let size = std::mem::size_of::<T>();
    r.iter().map(|r| r.start * size..r.end * size).collect()
}

/// Direct all-to-all: block `p` of what this rank sends (`send_ranges[p]`) goes to rank `p`,
/// whose block from this rank lands in its `recv_ranges[me]`; `uneven` (all_to_all_v, never in
/// place) says counts differ.
#[allow(clippy::too_many_arguments)] // the op's buffers plus the direct view
pub(crate) fn all_to_all<T: Element>(
    ctx: &mut Ctx<'_>,
    d: &mut Direct<'_>,
    fp: &Fingerprint,
    io: ExchangeBuffers<'_, T>,
    send_ranges: &[Range<usize>],
    recv_ranges: &[Range<usize>],
    uneven: bool,
) -> Result<()> {
    let (n, me) = (ctx.size, ctx.rank);
    if uneven && CountTable::bytes(n) > SMALL_BYTES {
        arrive(ctx, d, fp, &[])?;
        let (send, recv) = io.into_apart();
        return pairwise::all_to_all(ctx, &send, send_ranges, recv, recv_ranges, true);
    }
    let mut io = io.into_bytes();
    let bytes = io.send_len();
    let (send_b, recv_b) = (byte_ranges::<T>(send_ranges), byte_ranges::<T>(recv_ranges));
    let block = send_b.first().map_or(0, |r| r.len());
    if !uneven && single_copy::planned(d, block) {
        return all_to_all_single_copy(ctx, d, fp, io, send_b, recv_b);
    }
    let (slot, table) = if uneven {
        let mut payload = CountTable::encode(send_ranges, recv_ranges);
        if payload.len() + bytes <= SMALL_BYTES {
            payload.extend_from_slice(io.send(0..bytes));
        }
        let slot = arrive(ctx, d, fp, &payload)?;
        let table = CountTable::read(d, slot, n, std::mem::size_of::<T>())?;
        table.check(me)?;
        (slot, Some(table))
    } else {
        (arrive(ctx, d, fp, if is_small(bytes) { io.send(0..bytes) } else { &[] })?, None)
    };
    let (small, max_block) = match &table {
        Some(t) => (t.all_inline(), t.max_block()),
        None => (is_small(bytes), block),
    };
    if !uneven {
        single_copy::learn(ctx, d, block)?;
    }
    if let ExchangeBuffers::Apart { send, recv } = &mut io {
        recv[recv_b[me].clone()].copy_from_slice(&send[send_b[me].clone()]);
    }
    if small {
        for r in (0..n).filter(|r| *r != me) {
            let len = recv_b[r].len();
            if len == 0 {
                continue;
            }
            // Rank r's block for me starts where the blocks before mine end (checked: it sends
            // recv_b[r].len() bytes here, inside the payload it wrote).
            let at = table.as_ref().map_or(send_b[me].start, |t| t.offset(r, me));
            // Stamped for this op (arrive waited for it); read before the slot can be
            // reused (only once this rank has arrived at a later op).
            let payload = d.shm.slot_payload(r, slot, at + len);
            copy(io.recv(recv_b[r].clone()), &payload[at..]);
        }
        return Ok(());
    }
    let lanes = Lanes::PerPeer;
    let b = Blocks { io, send: send_b, recv: recv_b };
    exchange(ctx, d, b, lanes, steps(max_block, lanes.bytes(n)))
}

/// [`all_to_all`] of equal blocks by single copy: every rank reads its block of every peer's
/// exposed send buffer into its receive buffer. A rank in place says so in its payload: its
/// blocks would be overwritten while its peers read them, so then every rank takes the
/// chunked exchange instead (each piece leaves before the peer's lands).
fn all_to_all_single_copy(
    ctx: &mut Ctx<'_>,
    d: &mut Direct<'_>,
    fp: &Fingerprint,
    mut io: ExchangeBuffers<'_, u8>,
    send_b: Vec<Range<usize>>,
    recv_b: Vec<Range<usize>>,
) -> Result<()> {
    let (n, me) = (ctx.size, ctx.rank);
    let in_place = matches!(io, ExchangeBuffers::InPlace(_));
    let slot = arrive(ctx, d, fp, &single_copy::expose(io.send(0..0).as_ptr(), u64::from(in_place)))?;
    if let ExchangeBuffers::Apart { send, recv } = &mut io {
        recv[recv_b[me].clone()].copy_from_slice(&send[send_b[me].clone()]);
    }
    let mut any_in_place = false;
    for r in 0..n {
        any_in_place |= single_copy::exposed(d, slot, r)?.1 != 0;
    }
    if any_in_place {
        let lanes = Lanes::PerPeer;
        let max_block = send_b[me].len();
        let b = Blocks { io, send: send_b, recv: recv_b };
        return exchange(ctx, d, b, lanes, steps(max_block, lanes.bytes(n)));
    }
    for r in (1..n).map(|k| (me + k) % n) {
        let (addr, _) = single_copy::exposed(d, slot, r)?;
        single_copy::read(ctx, d, r, addr, send_b[me].clone(), io.recv(recv_b[r].clone()))?;
    }
    single_copy::finish(ctx, d)
}

/// The count table an all_to_all_v rank puts first in its arrival payload: its send counts,
/// then its recv counts, as little-endian u64 element counts; its send buffer follows when
/// the whole payload fits a slot.
struct CountTable {
    /// `send[a][b]`: elements rank a sends to rank b.
    send: Vec<Vec<u64>>,
    /// `recv[b][a]`: elements rank b expects from rank a.
    recv: Vec<Vec<u64>>,
    /// Whether every rank's send buffer follows its table.
    inline: Vec<bool>,
    /// Element size.
    size: usize,
}

impl CountTable {
    /// Bytes of one rank's table among `n` ranks.
    fn bytes(n: usize) -> usize {
        2 * n * 8
    }

    fn encode(send: &[Range<usize>], recv: &[Range<usize>]) -> Vec<u8> {
        send.iter().chain(recv).flat_map(|r| (r.len() as u64).to_le_bytes()).collect()
    }

    /// Every rank's table, read from this op's `slot`; a payload whose length is neither the
    /// table nor the table and the send buffer it describes is a protocol error naming its
    /// rank.
    fn read(d: &Direct<'_>, slot: usize, n: usize, size: usize) -> Result<CountTable> {
        let table = CountTable::bytes(n);
        let mut t = CountTable { send: Vec::with_capacity(n), recv: Vec::with_capacity(n), inline: Vec::new(), size };
        for r in 0..n {
            // Stamped for this op; the header is always readable.
            let h = d.shm.slot_header_snapshot(r, slot);
            let len = u64::from_le_bytes(h[FP_BYTES..FP_BYTES + 8].try_into().expect("8 bytes"));
            let bad = |why: &str| {
                Error::protocol(format!("rank {r}'s all_to_all_v count table is malformed ({why})")).with_peer(r)
            };
            if len < table as u64 || len > SMALL_BYTES as u64 {
                return Err(bad(&format!("{len} bytes of payload, expected {table} to {SMALL_BYTES}")));
            }
            // As above; `table` ≤ SMALL_BYTES (checked by the caller).
            let words = d.shm.slot_payload(r, slot, table);
            let counts: Vec<u64> =
                words.chunks_exact(8).map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes"))).collect();
            let data = counts[..n]
                .iter()
                .try_fold(0u64, |acc, c| acc.checked_add(c.checked_mul(size as u64)?))
                .ok_or_else(|| bad("send counts overflow"))?;
            let inline = match len - table as u64 {
                0 => false,
                extra if extra == data => true,
                extra => return Err(bad(&format!("{extra} bytes of data for send counts adding up to {data} bytes"))),
            };
            t.inline.push(inline);
            t.recv.push(counts[n..].to_vec());
            t.send.push(counts[..n].to_vec());
        }
        Ok(t)
    }

    /// `Err` (`Mismatch`) if a rank's send count for a peer is not the count that peer
    /// expects from it. Pairs with this rank come first, so the two ranks of a disagreement
    /// name each other; the others name the sender.
    fn check(&self, me: usize) -> Result<()> {
        let n = self.send.len();
        let pairs = (0..n).flat_map(|p| [(p, me), (me, p)]).chain((0..n).flat_map(|a| (0..n).map(move |b| (a, b))));
        for (a, b) in pairs {
            let (sent, expected) = (self.send[a][b], self.recv[b][a]);
            if sent == expected {
                continue;
            }
            let (msg, peer) = if b == me {
                (format!("rank {a} sends {sent} elements here but recv_counts[{a}] = {expected}"), a)
            } else if a == me {
                (format!("send_counts[{b}] = {sent} but rank {b} expects {expected} elements from this rank"), b)
            } else {
                (format!("rank {a} sends {sent} elements to rank {b}, which expects {expected}"), a)
            };
            return Err(Error::new(ErrorKind::Mismatch, msg).with_peer(peer));
        }
        Ok(())
    }

    /// Whether every rank's send buffer travelled in its slot.
    fn all_inline(&self) -> bool {
        self.inline.iter().all(|i| *i)
    }

    /// The largest block between two different ranks, in bytes (checked by [`Self::read`]:
    /// each rank's counts fit a slot's worth of data or an address space).
    fn max_block(&self) -> usize {
        let n = self.send.len();
        let most = (0..n).flat_map(|a| (0..n).filter(move |b| *b != a).map(move |b| (a, b)));
        most.map(|(a, b)| (self.send[a][b] as usize).saturating_mul(self.size)).max().unwrap_or(0)
    }

    /// Offset in rank `r`'s payload of its block for `me`, in bytes (after its table; the
    /// sum is bounded by its payload, checked by [`Self::read`]).
    fn offset(&self, r: usize, me: usize) -> usize {
        let n = self.send.len();
        CountTable::bytes(n) + self.send[r][..me].iter().sum::<u64>() as usize * self.size
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_each_block_once() {
        for (len, lane) in [(0, 64), (1, 64), (64, 64), (65, 64), (1000, 192)] {
            let n = steps(len, lane);
            let mut at = 0;
            for s in 0..n + 2 {
                let p = piece(len, lane, s);
                assert_eq!(p.start, at.min(len));
                at = p.end;
                assert!(p.len() <= lane && (s >= n || !p.is_empty()));
            }
            assert_eq!(at, len);
        }
    }

    #[test]
    fn lanes_fit_the_half_and_do_not_overlap() {
        for n in [2, 3, 4, 7, 8, 64, 2048] {
            let lane = lane_bytes(n);
            assert!(lane >= 256 && lane % 64 == 0 && lane * (n - 1) <= CHUNK_BYTES, "n={n}");
            for owner in 0..n.min(9) {
                let offs: Vec<usize> =
                    (0..n).filter(|r| *r != owner).map(|r| Lanes::PerPeer.offset(owner, r, n)).collect();
                assert!(offs.windows(2).all(|w| w[1] == w[0] + lane));
                assert_eq!(offs[0], 0);
            }
        }
        assert_eq!(Lanes::One.bytes(8), CHUNK_BYTES);
    }
}
