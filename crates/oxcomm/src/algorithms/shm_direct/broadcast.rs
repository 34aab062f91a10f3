//! Direct broadcast: small payloads travel in the root's slot, which the root publishes and
//! leaves (its arrival waits for nobody; the others wait for the root's slot alone), so
//! back-to-back broadcasts overlap by up to `SLOTS - 1` ops, as MPI's eager sends do. Large
//! ones go chunk by chunk through the root's chunk buffers after a full arrival; the root
//! copies each chunk in part by part and the others copy each part out as soon as it is in
//! (`parts` in the module docs), so the two copies overlap. (Reading straight from the
//! root's buffer, `single_copy.rs`, was slower here once the root rewrites it before each
//! broadcast, as training does; docs/benchmarks.md.)

use super::{
    arrive, arrive_for, copy_in_for, copy_out_for, follows_parts, is_small, parts, publish_part, wait_counter,
    wait_part, Direct, Wait,
};
use crate::copy::copy;
use crate::dtype::{as_bytes, as_bytes_mut, Element};
use crate::engine::Ctx;
use crate::error::Result;
use crate::transport::shm::workspace::{Counter, CHUNK_BYTES};
use crate::wire::Fingerprint;

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
        // The root only publishes; the others wait for the root alone (see `arrive_for`).
        let (payload, wait) = if me == root { (as_bytes(&*buf), Wait::Nobody) } else { (&[][..], Wait::Root(root)) };
        let slot = arrive_for(ctx, d, fp, payload, wait)?;
        if me != root {
            // The root stamped its slot for this op; it is reused only once this rank
            // has arrived at a later op.
            let payload = d.shm.slot_payload(root, slot, bytes);
            copy(as_bytes_mut(buf), payload);
        }
        return Ok(());
    }
    arrive(ctx, d, fp, &[])?;
    let per_chunk = CHUNK_BYTES / std::mem::size_of::<T>();
    let total = buf.len();
    let copy_out = copy_out_for(bytes);
    let follow = follows_parts(d.shm.each_rank_has_a_core(), bytes);
    for start in (0..total).step_by(per_chunk) {
        let part = &mut buf[start..(start + per_chunk).min(total)];
        let g = d.state.chunks;
        let half = (g & 1) as usize;
        let shm = d.shm;
        let len = std::mem::size_of_val(part);
        if me == root {
            wait_counter(ctx, shm, Counter::CopiedOut, g.saturating_sub(1))?;
            // As in all_reduce's copy-in, part by part, so that the readers follow.
            let src = as_bytes(part);
            let mut copy_in = copy_in_for(len, shm.each_rank_has_a_core());
            for (j, at) in parts(len).enumerate() {
                copy_in.copy(&mut shm.chunk_mut(half, at.start, at.len()), &src[at]);
                publish_part(shm, g, j);
            }
            copy_in.done();
            shm.publish(Counter::CopiedIn, g + 1);
            shm.publish(Counter::Reduced, g + 1);
            shm.publish(Counter::CopiedOut, g + 1);
        } else {
            shm.publish(Counter::CopiedIn, g + 1);
            shm.publish(Counter::Reduced, g + 1);
            let dst = as_bytes_mut(part);
            for (j, at) in parts(len).enumerate() {
                wait_part(ctx, shm, root, g, j, follow)?;
                // The root published part j of chunk g and rewrites this half only after
                // every rank published CopiedOut = g+1.
                copy_out(&mut dst[at.clone()], shm.chunk(root, half, at.start, at.len()));
            }
            shm.publish(Counter::CopiedOut, g + 1);
        }
        d.state.chunks += 1;
    }
    Ok(())
}
