//! Which algorithm function runs an op, once [`super::plan`] has chosen the [`Algorithm`]:
//! the one `match` per op between the communicator's op surface and the algorithm files.
//!
//! The communicator validates and fingerprints an op, asks `plan` for an algorithm, and runs
//! the function here for that op inside its turn. Algorithms that need more than the links
//! get it explicitly: the host layout (hierarchical) and the direct shared-memory view.

use super::hierarchical::HostLayout;
use super::{Algorithm, ReduceBuffers};
use crate::dtype::Element;
use crate::engine::Ctx;
use crate::error::{Error, Result};
use crate::reduce::ReduceOp;
use crate::wire::Fingerprint;

/// Whether `algo` needs the agreement phase over the links before it runs (the direct path
/// agrees as it arrives; dissemination checks fingerprints in its own rounds).
pub(crate) fn agrees(algo: Algorithm) -> bool {
    !matches!(algo, Algorithm::ShmDirect | Algorithm::Dissemination)
}

/// Runs `f` with the direct shared-memory view taken out of `ctx` (and puts it back).
#[cfg(target_os = "linux")]
fn with_direct<'c, R>(
    ctx: &mut Ctx<'c>,
    f: impl FnOnce(&mut Ctx<'c>, &mut super::shm_direct::Direct<'c>) -> Result<R>,
) -> Result<R> {
    let mut d = ctx.direct.take().ok_or_else(|| Error::invalid("the direct shared-memory path is not available"))?;
    let r = f(ctx, &mut d);
    ctx.direct = Some(d);
    r
}

/// All-reduce with `algo` (`op` is the combiner: `Avg` is finished by the caller on the
/// returned buffer, which holds the result).
pub(crate) fn all_reduce<'b, T: Element>(
    ctx: &mut Ctx<'_>,
    algo: Algorithm,
    layout: Option<&HostLayout>,
    fp: &Fingerprint,
    io: ReduceBuffers<'b, T>,
    op: ReduceOp,
) -> Result<&'b mut [T]> {
    #[cfg(not(target_os = "linux"))]
    let _ = fp;
    match (algo, layout) {
        #[cfg(target_os = "linux")]
        (Algorithm::ShmDirect, _) => with_direct(ctx, |ctx, d| super::shm_direct::all_reduce(ctx, d, fp, io, op)),
        (Algorithm::Hierarchical, Some(l)) => {
            let buf = io.into_in_place();
            super::hierarchical::all_reduce(ctx, l, buf, op)?;
            Ok(buf)
        }
        _ => {
            let buf = io.into_in_place();
            all_reduce_in_place(ctx, algo, buf, op)?;
            Ok(buf)
        }
    }
}

/// In-place all-reduce with one of the link algorithms (ring, star, else recursive doubling).
pub(crate) fn all_reduce_in_place<T: Element>(
    ctx: &mut Ctx<'_>,
    algo: Algorithm,
    buf: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    match algo {
        Algorithm::Ring => super::ring::all_reduce(ctx, buf, op),
        Algorithm::Star => super::star::all_reduce(ctx, buf, op),
        _ => super::doubling::all_reduce(ctx, buf, op),
    }
}

/// Broadcast with `algo` (direct, hierarchical, else binomial tree).
pub(crate) fn broadcast<T: Element>(
    ctx: &mut Ctx<'_>,
    algo: Algorithm,
    layout: Option<&HostLayout>,
    fp: &Fingerprint,
    buf: &mut [T],
    root: usize,
) -> Result<()> {
    #[cfg(not(target_os = "linux"))]
    let _ = fp;
    match (algo, layout) {
        #[cfg(target_os = "linux")]
        (Algorithm::ShmDirect, _) => with_direct(ctx, |ctx, d| super::shm_direct::broadcast(ctx, d, fp, buf, root)),
        (Algorithm::Hierarchical, Some(l)) => super::hierarchical::broadcast(ctx, l, buf, root),
        _ => super::tree::broadcast(ctx, buf, root),
    }
}

/// All-gather with `algo` (hierarchical, else ring).
pub(crate) fn all_gather<T: Element>(
    ctx: &mut Ctx<'_>,
    algo: Algorithm,
    layout: Option<&HostLayout>,
    input: &[T],
    output: &mut [T],
) -> Result<()> {
    match (algo, layout) {
        (Algorithm::Hierarchical, Some(l)) => super::hierarchical::all_gather(ctx, l, input, output),
        _ => super::ring::all_gather(ctx, input, output),
    }
}

/// Reduce-scatter with `algo` (hierarchical, else ring); `op` is the combiner.
pub(crate) fn reduce_scatter<T: Element>(
    ctx: &mut Ctx<'_>,
    algo: Algorithm,
    layout: Option<&HostLayout>,
    input: &[T],
    output: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    match (algo, layout) {
        (Algorithm::Hierarchical, Some(l)) => super::hierarchical::reduce_scatter(ctx, l, input, output, op),
        _ => super::ring::reduce_scatter(ctx, input, output, op),
    }
}

/// Barrier with `algo`: dissemination, direct arrival, else the agreement phase alone (which
/// the caller runs when [`agrees`] says so).
pub(crate) fn barrier(ctx: &mut Ctx<'_>, algo: Algorithm, fp: &Fingerprint) -> Result<()> {
    match algo {
        Algorithm::Dissemination => super::barrier::dissemination(ctx, fp),
        #[cfg(target_os = "linux")]
        Algorithm::ShmDirect => with_direct(ctx, |ctx, d| super::shm_direct::barrier(ctx, d, fp)),
        _ => Ok(()),
    }
}
