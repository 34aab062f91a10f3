//! Algorithms rooted at one rank that talk to every other rank directly ("flat"): the
//! agreement phase that precedes every collective, gather, scatter, and a star all-reduce.
//!
//! **Agreement** (the fingerprint check): every rank sends its 48-byte op fingerprint to group
//! rank 0, which compares them all and answers each rank with a 64-byte verdict. Nothing is
//! written into a user buffer before the verdict says every rank called the same op, so a
//! mismatch (different op, dtype, count, root or sequence) fails on every rank with both
//! fingerprints named and all buffers untouched. If some rank never arrives, rank 0 times out
//! at the deadline and tells the others which ranks are missing (they wait half a second longer
//! than rank 0 for that verdict). Steps: 2. Bytes: 48 up, 64 down per rank.
//!
//! | algorithm | steps | bytes sent per non-root rank | bytes sent by the root |
//! | --- | --- | --- | --- |
//! | gather | 1 | S | 0 |
//! | scatter | 1 | 0 | (n − 1) · S |
//! | star all-reduce | 2 | S | (n − 1) · S |

use std::time::{Duration, Instant};

use crate::buffers::{GatherBuffers, ScatterBuffers};
use crate::dtype::{as_bytes, as_bytes_mut, Element};
use crate::engine::{Ctx, Xfer};
use crate::error::{Error, ErrorKind, Result};
use crate::reduce::{self, ReduceOp};
use crate::wire::{Fingerprint, FP_BYTES};

/// How much longer non-root ranks wait for rank 0's verdict than rank 0 waits for them.
pub(crate) const VERDICT_GRACE: Duration = Duration::from_millis(500);

pub(crate) const VERDICT_BYTES: usize = 16 + FP_BYTES;
pub(crate) const OK: u8 = 0;
pub(crate) const MISMATCH: u8 = 1;
pub(crate) const MISSING: u8 = 2;

pub(crate) fn verdict(status: u8, word: u64, fp: &Fingerprint) -> [u8; VERDICT_BYTES] {
    let mut v = [0u8; VERDICT_BYTES];
    v[0] = status;
    v[8..16].copy_from_slice(&word.to_le_bytes());
    v[16..].copy_from_slice(&fp.encode());
    v
}

fn list(ranks: &[usize]) -> String {
    ranks.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(", ")
}

/// A verdict as a non-root rank reads it (see [`decode_verdict`]).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Every rank called the same op.
    Agreed,
    /// Group rank `culprit` called `theirs` (`culprit` is 0 when this rank is the odd one
    /// out, and `theirs` is then rank 0's op).
    Mismatch { culprit: usize, theirs: Fingerprint },
    /// `count` ranks (1 ..= n − 2) did not join rank 0's op `theirs`; their ids follow.
    Missing { count: usize, theirs: Fingerprint },
}

/// Decodes the verdict rank 0 sent to group rank `me` of a group of `n`, checking every field:
/// the status, the reserved bytes, the word (a rank id below `n` that is not `me`, or a count
/// of missing ranks between 1 and n − 2: neither this rank nor rank 0 is missing) and the
/// fingerprint. Errors are [`ErrorKind::Protocol`] without a peer (the caller names rank 0).
pub(crate) fn decode_verdict(v: &[u8], n: usize, me: usize) -> Result<Verdict> {
    if v.len() != VERDICT_BYTES {
        return Err(Error::protocol(format!("a verdict of {} bytes (expected {VERDICT_BYTES})", v.len())));
    }
    if v[1..8] != [0; 7] {
        return Err(Error::protocol("reserved bytes of the verdict are not zero"));
    }
    let mut w = [0u8; 8];
    w.copy_from_slice(&v[8..16]);
    let word = u64::from_le_bytes(w);
    let theirs = Fingerprint::decode(&v[16..])?;
    match v[0] {
        OK if word == 0 => Ok(Verdict::Agreed),
        MISMATCH => match usize::try_from(word) {
            Ok(c) if c < n && (c != me || c == 0) => Ok(Verdict::Mismatch { culprit: c, theirs }),
            _ => Err(Error::protocol(format!("a mismatch verdict naming rank {word} (group of {n}, this is {me})"))),
        },
        MISSING => match usize::try_from(word) {
            Ok(count) if count >= 1 && count < n.saturating_sub(1) => Ok(Verdict::Missing { count, theirs }),
            _ => Err(Error::protocol(format!("a verdict of {word} missing ranks (group of {n})"))),
        },
        s => Err(Error::protocol(format!("bad verdict status {s} with word {word}"))),
    }
}

/// Decodes the list of missing ranks that follows a [`Verdict::Missing`]: 8-byte ids, each
/// in 1..n, not `me`, strictly increasing (so no rank is named twice).
pub(crate) fn decode_missing(raw: &[u8], n: usize, me: usize) -> Result<Vec<usize>> {
    if raw.is_empty() || raw.len() % 8 != 0 || raw.len() / 8 >= n.saturating_sub(1) {
        return Err(Error::protocol(format!("a missing-rank list of {} bytes (group of {n})", raw.len())));
    }
    let mut out: Vec<usize> = Vec::with_capacity(raw.len() / 8);
    for c in raw.chunks_exact(8) {
        let mut w = [0u8; 8];
        w.copy_from_slice(c);
        let id = u64::from_le_bytes(w);
        match usize::try_from(id) {
            Ok(m) if m >= 1 && m < n && m != me && out.last().is_none_or(|l| *l < m) => out.push(m),
            _ => {
                return Err(Error::protocol(format!(
                    "the missing-rank list names rank {id} (group of {n}, this is {me}, ids must increase)"
                )))
            }
        }
    }
    Ok(out)
}

/// Checks that every rank of the group is running `mine`; see the module docs. Where ranks may
/// run the op another way (the backend gave the engine a watch), it also meets them
/// ([`Ctx::watched`]).
pub(crate) fn agree(ctx: &mut Ctx<'_>, mine: &Fingerprint) -> Result<()> {
    if ctx.size == 1 {
        return Ok(());
    }
    let r = ctx.watched(mine, |ctx| agree_over_links(ctx, mine));
    r.map_err(|e| ctx.blame_the_dead(e))
}

/// [`agree`] over the links.
fn agree_over_links(ctx: &mut Ctx<'_>, mine: &Fingerprint) -> Result<()> {
    let n = ctx.size;
    if ctx.rank != 0 {
        ctx.send(0, &mine.encode())?;
        let mut v = [0u8; VERDICT_BYTES];
        let deadline = ctx.deadline();
        ctx.set_deadline(deadline + VERDICT_GRACE);
        ctx.recv(0, &mut v)?;
        return heed_verdict(ctx, mine, &v);
    }
    // Rank 0: collect every fingerprint. When one differs from its own, the ranks heard from
    // so far get their verdicts at once: a rank running an op that folds its agreement into its
    // data (`doubling::all_reduce_folded`) sends rank 0 nothing more and waits for rank 0's
    // data, so only the verdict (read as data, and failing the check) frees it.
    let mut raw = vec![[0u8; FP_BYTES]; n];
    let mut known = vec![false; n];
    let mut told = vec![false; n];
    (known[0], told[0]) = (true, true);
    let encoded = mine.encode();
    let mut failed = None;
    while known.iter().any(|k| !k) {
        let differs = std::cell::Cell::new(None);
        let checks: Vec<_> = (0..n)
            .map(|p| {
                let (encoded, differs) = (&encoded, &differs);
                move |got: &[u8]| {
                    if got == encoded {
                        return Ok(());
                    }
                    differs.set(Some(p));
                    Err(Error::new(ErrorKind::Mismatch, "a fingerprint differs"))
                }
            })
            .collect();
        let ranks: Vec<usize> = (1..n).filter(|p| !known[*p]).collect();
        let (res, finished) = {
            let mut xfers: Vec<Xfer<'_>> = raw
                .iter_mut()
                .zip(&checks)
                .enumerate()
                .filter(|(p, _)| !known[*p])
                .map(|(p, (b, check))| Xfer::recv_checked(p, b, check, &mut []))
                .collect();
            let res = ctx.run(&mut xfers);
            let finished: Vec<usize> =
                ranks.iter().zip(&xfers).filter(|(_, x)| x.finished()).map(|(p, _)| *p).collect();
            (res, finished)
        };
        for p in finished {
            known[p] = true;
        }
        match (res, differs.get()) {
            (Ok(()), _) => {}
            (Err(_), Some(c)) => {
                known[c] = true;
                let (verdicts, _) = judge(ctx, mine, &raw, &known)?;
                let mut xfers: Vec<Xfer<'_>> = Vec::new();
                for p in 1..n {
                    if known[p] && !told[p] {
                        told[p] = true;
                        xfers.push(Xfer::send(p, &verdicts[p]));
                    }
                }
                // A rank that failed on hearing of the mismatch from another may have gone:
                // this rank still reports the mismatch it found (below).
                if let Err(e) = ctx.run(&mut xfers) {
                    failed = Some(e);
                    break;
                }
            }
            (Err(e), None) => {
                failed = Some(e);
                break;
            }
        }
    }
    let (verdicts, outcome) = judge(ctx, mine, &raw, &known)?;
    match failed {
        // Nobody differed from rank 0: a wait that failed names the missing ranks.
        Some(e) if outcome.is_ok() => {
            let arrived: Vec<bool> = known[1..].to_vec();
            Err(report_missing(ctx, mine, e, &arrived))
        }
        // Someone differed and the rest may be gone because of it (told of the mismatch by
        // the odd one's revocation, they fail and may leave): tell those left, best effort.
        _ if outcome.is_err() => {
            let mut xfers: Vec<Xfer<'_>> = (1..n).filter(|p| !told[*p]).map(|p| Xfer::send(p, &verdicts[p])).collect();
            ctx.set_deadline(Instant::now() + VERDICT_GRACE / 2);
            let _ = ctx.run(&mut xfers);
            outcome
        }
        // Every rank called the same op.
        _ => {
            let mut xfers: Vec<Xfer<'_>> = (1..n).filter(|p| !told[*p]).map(|p| Xfer::send(p, &verdicts[p])).collect();
            ctx.run(&mut xfers)?;
            outcome
        }
    }
}

/// What a verdict from rank 0 means to non-root rank `ctx.rank`: `Ok` when every rank agreed,
/// else the error naming who differs or who is missing (whose list it reads from rank 0).
pub(crate) fn heed_verdict(ctx: &mut Ctx<'_>, mine: &Fingerprint, v: &[u8]) -> Result<()> {
    let (n, r) = (ctx.size, ctx.rank);
    let root = ctx.world(0);
    let from_root = |e: Error| Error::protocol(format!("verdict from rank {root}: {}", e.message())).with_peer(root);
    // A rank 0 that runs an op folding its agreement into its data sends that data, which
    // starts with its op's fingerprint, where this rank expects a verdict.
    if let Ok(theirs) = Fingerprint::decode(&v[..FP_BYTES.min(v.len())]) {
        return Err(Error::new(
            ErrorKind::Mismatch,
            format!("ranks called different collectives: rank {root} called {theirs}, this rank called {mine}"),
        )
        .with_peer(root));
    }
    match decode_verdict(v, n, r).map_err(from_root)? {
        Verdict::Agreed => Ok(()),
        Verdict::Mismatch { culprit, theirs } => {
            let who = ctx.world(culprit);
            Err(Error::new(
                ErrorKind::Mismatch,
                format!("ranks called different collectives: rank {who} called {theirs}, this rank called {mine}"),
            )
            .with_peer(who))
        }
        Verdict::Missing { count, theirs } => {
            // `count` is at most n - 2, checked by the decoder: the allocation is bounded
            // by the group size, never by the peer.
            let mut raw = vec![0u8; 8 * count];
            ctx.recv(0, &mut raw)?;
            let missing: Vec<usize> =
                decode_missing(&raw, n, r).map_err(from_root)?.into_iter().map(|m| ctx.world(m)).collect();
            Err(Error::new(
                ErrorKind::Timeout,
                format!(
                    "timed out: rank {root} reports that rank(s) {} did not join {theirs} before the deadline",
                    list(&missing),
                ),
            )
            .with_peer(missing[0]))
        }
    }
}

/// Rank 0, whose wait for the fingerprints ended with `e` (`arrived[p - 1]`: rank p's came):
/// on a timeout, tells the ranks that came which did not (best effort, within a short
/// deadline) and returns the error naming them; any other error as it is.
pub(crate) fn report_missing(ctx: &mut Ctx<'_>, mine: &Fingerprint, e: Error, arrived: &[bool]) -> Error {
    if e.kind() != ErrorKind::Timeout {
        return e;
    }
    let n = ctx.size;
    let missing: Vec<usize> = (1..n).filter(|p| !arrived[p - 1]).collect();
    if missing.is_empty() {
        return e; // every fingerprint came: the timeout was another transfer's
    }
    let here: Vec<usize> = (1..n).filter(|p| arrived[p - 1]).collect();
    let mut tail = Vec::with_capacity(8 * missing.len());
    for m in &missing {
        tail.extend_from_slice(&(*m as u64).to_le_bytes());
    }
    let v = verdict(MISSING, missing.len() as u64, mine);
    ctx.set_deadline(Instant::now() + VERDICT_GRACE / 2);
    let mut xfers: Vec<Xfer<'_>> = Vec::new();
    for p in &here {
        xfers.push(Xfer::send(*p, &v));
        xfers.push(Xfer::send(*p, &tail));
    }
    let _ = ctx.run(&mut xfers);
    let world: Vec<usize> = missing.iter().map(|m| ctx.world(*m)).collect();
    Error::new(
        ErrorKind::Timeout,
        format!(
            "timed out after {:?}: rank(s) {} did not join {mine} within the timeout (OXCOMM_TIMEOUT, or \
             the group's own)",
            ctx.timeout(),
            list(&world)
        ),
    )
    .with_peer(world[0])
}

/// Rank 0's judgement of the fingerprints it read (`raw[p]` for p ≥ 1 where `known[p]`;
/// index 0 unused): the verdict for each rank (index 0 unused) and rank 0's own outcome. The
/// culprit is the lowest known rank whose op differs from rank 0's; a rank not read yet is told
/// the culprit's op.
#[allow(clippy::type_complexity)] // the verdicts and the outcome, used apart
pub(crate) fn judge(
    ctx: &Ctx<'_>,
    mine: &Fingerprint,
    raw: &[[u8; FP_BYTES]],
    known: &[bool],
) -> Result<(Vec<[u8; VERDICT_BYTES]>, Result<()>)> {
    let n = ctx.size;
    let mut fps: Vec<Option<Fingerprint>> = Vec::with_capacity(n);
    fps.push(Some(*mine));
    for (p, b) in raw.iter().enumerate().skip(1) {
        fps.push(if known[p] { Some(Fingerprint::decode_from(b, ctx.world(p))?) } else { None });
    }
    let culprit = (1..n).find(|p| fps[*p].is_some_and(|f| f != *mine));
    let verdicts: Vec<[u8; VERDICT_BYTES]> = (0..n)
        .map(|p| match culprit {
            None => verdict(OK, 0, mine),
            Some(_) if fps[p].is_some_and(|f| f != *mine) => verdict(MISMATCH, 0, mine),
            Some(c) => verdict(MISMATCH, c as u64, &fps[c].expect("the culprit's op is known")),
        })
        .collect();
    let outcome = match culprit {
        None => Ok(()),
        Some(c) => {
            let who = ctx.world(c);
            let theirs = fps[c].expect("the culprit's op is known");
            Err(Error::new(
                ErrorKind::Mismatch,
                format!("ranks called different collectives: rank {who} called {theirs}, this rank called {mine}"),
            )
            .with_peer(who))
        }
    };
    Ok((verdicts, outcome))
}

/// Flat gather: the root's output (n blocks; in place, its own block already there) receives
/// every rank's contribution.
pub(crate) fn gather<T: Element>(ctx: &mut Ctx<'_>, io: GatherBuffers<'_, T>, root: usize) -> Result<()> {
    let (n, me) = (ctx.size, ctx.rank);
    let c = io.block_len(n);
    if me != root {
        return ctx.send(root, as_bytes(io.own(me, c, 0..c)));
    }
    let output = io.into_whole(me);
    let mut xfers = Vec::with_capacity(n);
    for (p, block) in output.chunks_mut(c.max(1)).enumerate().take(n) {
        if p != root && c > 0 {
            xfers.push(Xfer::recv(p, as_bytes_mut(block)));
        }
    }
    ctx.run(&mut xfers)
}

/// Flat scatter: block `p` of the root's input goes to rank `p` (in place, the root's block
/// stays in its input).
pub(crate) fn scatter<T: Element>(ctx: &mut Ctx<'_>, mut io: ScatterBuffers<'_, T>, root: usize) -> Result<()> {
    let (n, me) = (ctx.size, ctx.rank);
    let c = io.block_len(n);
    if me != root {
        return ctx.recv(root, as_bytes_mut(io.into_result(me, c)));
    }
    if let (out, Some(own)) = io.result_and_own(me, c, 0..c) {
        out.copy_from_slice(own);
    }
    let mut xfers: Vec<Xfer<'_>> =
        (0..n).filter(|p| *p != root).map(|p| Xfer::send(p, as_bytes(io.input(p * c..(p + 1) * c)))).collect();
    ctx.run(&mut xfers)
}

/// Star all-reduce: rank 0 receives every buffer, reduces them in rank order and sends the
/// result back (`op` is the combiner).
pub(crate) fn all_reduce<T: Element>(ctx: &mut Ctx<'_>, buf: &mut [T], op: ReduceOp) -> Result<()> {
    let n = ctx.size;
    if n == 1 {
        return Ok(());
    }
    if ctx.rank != 0 {
        ctx.send(0, as_bytes(buf))?;
        return ctx.recv(0, as_bytes_mut(buf));
    }
    let mut others = vec![T::default(); buf.len() * (n - 1)];
    {
        let mut xfers: Vec<Xfer<'_>> = others
            .chunks_mut(buf.len().max(1))
            .enumerate()
            .filter(|_| !buf.is_empty())
            .map(|(i, b)| Xfer::recv(i + 1, as_bytes_mut(b)))
            .collect();
        ctx.run(&mut xfers)?;
    }
    for block in others.chunks(buf.len().max(1)) {
        if !buf.is_empty() {
            reduce::reduce_into(buf, block, op);
        }
    }
    let mut xfers: Vec<Xfer<'_>> = (1..n).map(|p| Xfer::send(p, as_bytes(buf))).collect();
    ctx.run(&mut xfers)
}
