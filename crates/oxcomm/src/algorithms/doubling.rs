//! Recursive doubling all-reduce, for small buffers, correct for any group size.
//!
//! With `p` the largest power of two ≤ n, the `n − p` *extra* ranks first fold their buffer
//! into a proxy rank, the `p` ranks then exchange whole buffers with partner `rank ^ 2^k` for
//! `log2 p` steps, reducing each time, and proxies hand the result back.
//!
//! Steps: log2 p (+2 when n is not a power of two). Bytes sent per rank: S · log2 p (+S for
//! proxies and extras). Latency-optimal, bandwidth-wasteful: used below `plan`'s threshold.
//! Every rank computes `a ⊕ b` as its partner computes `b ⊕ a`, so results are bitwise equal
//! on all ranks.
//!
//! # The agreement folded in ([`all_reduce_folded`])
//!
//! The agreement phase ([`super::star::agree`]) costs a round trip to rank 0 before the first
//! byte of data moves: on TCP, where a one-way trip is tens of µs, that is most of a small
//! all-reduce. The folded form sends every step's message as `[fingerprint][payload]` and
//! checks the partner's fingerprint before it reads the payload, with no agreement phase. When
//! every check passes every rank called the same op: a rank sends its step-k message only after
//! its step k − 1 checked, so a passed check at step k vouches, by induction, for the whole
//! 2^(k+1)-rank subcube, and extras are vouched for by their proxies, which check them before
//! their first step. The work happens in a copy of the buffer, which is written back only once
//! every step passed, so a failed op writes nothing. Costs: 48 more bytes per message; steps
//! and payload as above. What it does not give: the agreement's diagnosis. A rank names the
//! partner that differs (or that it timed out waiting for) and the others learn of it from
//! that rank's abort, not all from rank 0's one verdict.

use super::schedule;
use crate::dtype::{as_bytes, as_bytes_mut, Element};
use crate::engine::{Ctx, Xfer};
use crate::error::{Error, ErrorKind, Result};
use crate::reduce::{self, ReduceOp};
use crate::wire::{Fingerprint, FP_BYTES};

/// Largest all-reduce (bytes per rank) that [`all_reduce_folded`] runs: above it the agreement
/// phase's round trip is a small part of the op, and the folded form's copies are not.
pub(crate) const FOLD_MAX_BYTES: usize = 64 << 10;

/// In-place recursive-doubling all-reduce (`op` is the combiner).
pub(crate) fn all_reduce<T: Element>(ctx: &mut Ctx<'_>, buf: &mut [T], op: ReduceOp) -> Result<()> {
    let d = schedule::recursive_doubling(ctx.rank, ctx.size);
    if !fold_extra(ctx, &d, buf, op)? {
        return Ok(());
    }
    let mut mine = buf.to_vec();
    for &partner in &d.partners {
        mine.copy_from_slice(buf);
        ctx.run(&mut [Xfer::send(partner, as_bytes(&mine)), Xfer::recv_reduce(partner, buf, op)])?;
    }
    return_to_extra(ctx, &d, buf)
}

/// The first step of an all-reduce among a power of two of ranks `d` (this file's and
/// `halving.rs`'s): an extra rank sends its buffer to its proxy and receives the result into
/// it (`Ok(false)`: it has nothing else to do); a proxy reduces its extra's buffer into its
/// own; `Ok(true)` for ranks that go on to the rounds.
pub(crate) fn fold_extra<T: Element>(
    ctx: &mut Ctx<'_>,
    d: &schedule::Doubling,
    buf: &mut [T],
    op: ReduceOp,
) -> Result<bool> {
    if !d.in_rounds {
        let proxy = d.fold.expect("extra ranks have a proxy");
        ctx.send(proxy, as_bytes(buf))?;
        ctx.recv(proxy, as_bytes_mut(buf))?;
        return Ok(false);
    }
    if let Some(extra) = d.fold {
        ctx.run(&mut [Xfer::recv_reduce(extra, buf, op)])?;
    }
    Ok(true)
}

/// The last step after [`fold_extra`]: a proxy sends the result to its extra.
pub(crate) fn return_to_extra<T: Element>(ctx: &mut Ctx<'_>, d: &schedule::Doubling, buf: &[T]) -> Result<()> {
    match d.fold {
        Some(extra) if d.in_rounds => ctx.send(extra, as_bytes(buf)),
        _ => Ok(()),
    }
}

/// [`all_reduce`] with the agreement on `fp` folded into its messages (module docs); run it
/// *instead of* the agreement phase.
pub(crate) fn all_reduce_folded<T: Element>(
    ctx: &mut Ctx<'_>,
    fp: &Fingerprint,
    buf: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    if ctx.size == 1 {
        return Ok(());
    }
    // It talks over links, so it meets ranks that may run the op another way.
    let r = ctx.watched(fp, |ctx| folded_steps(ctx, fp, buf, op));
    r.map_err(|e| ctx.blame_the_dead(e))
}

/// The steps of [`all_reduce_folded`].
fn folded_steps<T: Element>(ctx: &mut Ctx<'_>, fp: &Fingerprint, buf: &mut [T], op: ReduceOp) -> Result<()> {
    let d = schedule::recursive_doubling(ctx.rank, ctx.size);
    let mine = fp.encode();
    // What this rank sends each step: its fingerprint, then its partial result.
    let mut out = vec![0u8; FP_BYTES + std::mem::size_of_val(buf)];
    out[..FP_BYTES].copy_from_slice(&mine);
    let mut work: Vec<T> = buf.to_vec();
    let mut theirs: Vec<T> = vec![T::default(); buf.len()];
    if !d.in_rounds {
        let proxy = d.fold.expect("extra ranks have a proxy");
        out[FP_BYTES..].copy_from_slice(as_bytes(&work));
        step(ctx, Some((proxy, &out)), proxy, fp, &mut theirs)?;
        buf.copy_from_slice(&theirs);
        return Ok(());
    }
    if let Some(extra) = d.fold {
        step(ctx, None, extra, fp, &mut theirs)?;
        reduce::reduce_into(&mut work, &theirs, op);
    }
    for partner in d.partners {
        out[FP_BYTES..].copy_from_slice(as_bytes(&work));
        step(ctx, Some((partner, &out)), partner, fp, &mut theirs)?;
        reduce::reduce_into(&mut work, &theirs, op);
    }
    if let Some(extra) = d.fold {
        out[FP_BYTES..].copy_from_slice(as_bytes(&work));
        ctx.send(extra, &out)?;
    }
    buf.copy_from_slice(&work);
    Ok(())
}

/// One step of [`folded_steps`]: sends `send` (if any) while it receives `from`'s message,
/// checking its fingerprint against `fp` before the payload lands in `into`.
fn step<T: Element>(
    ctx: &mut Ctx<'_>,
    send: Option<(usize, &[u8])>,
    from: usize,
    fp: &Fingerprint,
    into: &mut [T],
) -> Result<()> {
    let who = ctx.world(from);
    let mine = fp.encode();
    let check = |got: &[u8]| check_partner(got, &mine, fp, who);
    let mut head = [0u8; FP_BYTES];
    let recv = Xfer::recv_checked(from, &mut head, &check, as_bytes_mut(into));
    match send {
        Some((to, data)) => ctx.run(&mut [Xfer::send(to, data), recv]),
        None => ctx.run(&mut [recv]),
    }
}

/// `Ok` if the fingerprint `got` from world rank `who` is `mine` (the encoding of `fp`), else
/// the mismatch naming both ops (or only this one, if `got` is no fingerprint).
fn check_partner(got: &[u8], mine: &[u8], fp: &Fingerprint, who: usize) -> Result<()> {
    if got == mine {
        return Ok(());
    }
    let msg = match Fingerprint::decode_from(got, who) {
        Ok(theirs) => format!("ranks called different collectives: rank {who} called {theirs}, this rank called {fp}"),
        // Rank 0 of an op that runs the agreement phase answers with a verdict, not data.
        Err(_) => format!("rank {who} is not running {fp}: it sent something else (another collective's message)"),
    };
    Err(Error::new(ErrorKind::Mismatch, msg).with_peer(who))
}
