//! Which algorithm function runs an op, once [`super::plan`] has chosen the [`Algorithm`]:
//! the one `match` per op between the communicator's op surface and the algorithm files.
//!
//! The flow: the communicator validates and fingerprints an op and asks its backend for a
//! route; the native backend ([`crate::backend`]'s `native.rs`) has [`super::plan`] choose the
//! algorithm. In the op's turn the native backend builds the engine's `Ctx`, runs the
//! agreement phase when [`agrees`] says so, and calls the function here for the op. Algorithms
//! that need more than the links get it explicitly: the host layout (hierarchical) and the
//! direct shared-memory view, which the backend that owns the workspaces hands in (`None`
//! where there is none). Reductions take the combiner (never `Avg`) and return the buffer
//! that holds the result, where the communicator finishes `Avg`.

use std::ops::Range;

use super::hierarchical::HostLayout;
use super::Algorithm;
use crate::buffers::{ExchangeBuffers, GatherBuffers, ReduceBuffers, ScatterBuffers};
use crate::dtype::Element;
use crate::engine::Ctx;
use crate::error::{Error, Result};
use crate::reduce::ReduceOp;
use crate::transport::Transport;
use crate::wire::Fingerprint;

/// Whether `algo` needs the agreement phase over the links before it runs (the direct path
/// agrees as it arrives; dissemination checks fingerprints in its own rounds).
pub(crate) fn agrees(algo: Algorithm) -> bool {
    !matches!(algo, Algorithm::ShmDirect | Algorithm::Dissemination)
}

/// The direct shared-memory view an op was given, or the error of an op routed to the direct
/// path without one.
#[cfg(target_os = "linux")]
fn direct<'d, 'v>(direct: Option<&'d mut Direct<'v>>) -> Result<&'d mut Direct<'v>> {
    direct.ok_or_else(|| Error::invalid("the direct shared-memory path is not available"))
}

/// The direct view of an op where the platform has one (the shm transport, Linux).
#[cfg(target_os = "linux")]
pub(crate) type Direct<'v> = super::shm_direct::Direct<'v>;
/// The direct view of an op where the platform has one (never, off Linux).
#[cfg(not(target_os = "linux"))]
pub(crate) type Direct<'v> = std::marker::PhantomData<&'v ()>;

/// Whether an all-reduce of `bytes` per rank with `algo` over `transport`'s links folds its
/// agreement into its data ([`super::doubling::all_reduce_folded`]) instead of running the
/// agreement phase first: recursive doubling over TCP alone, up to
/// [`super::doubling::FOLD_MAX_BYTES`], where the phase's round trip is most of the op.
pub(crate) fn folds_agreement(algo: Algorithm, transport: Transport, bytes: usize) -> bool {
    algo == Algorithm::RecursiveDoubling && transport == Transport::Tcp && bytes <= super::doubling::FOLD_MAX_BYTES
}

/// All-reduce with `algo` (`op` is the combiner: `Avg` is finished by the communicator on
/// the returned buffer, which holds the result). `agreed` says whether the agreement phase
/// ran; recursive doubling without it folds the agreement into its messages.
#[allow(clippy::too_many_arguments)] // the op's buffers plus what the route hands every algorithm
pub(crate) fn all_reduce<'b, T: Element>(
    ctx: &mut Ctx<'_>,
    algo: Algorithm,
    agreed: bool,
    layout: Option<&HostLayout>,
    fp: &Fingerprint,
    io: ReduceBuffers<'b, T>,
    op: ReduceOp,
    d: Option<&mut Direct<'_>>,
) -> Result<&'b mut [T]> {
    #[cfg(not(target_os = "linux"))]
    let _ = (fp, d);
    match (algo, layout) {
        (Algorithm::RecursiveDoubling, _) if !agreed => {
            let buf = io.into_in_place();
            super::doubling::all_reduce_folded(ctx, fp, buf, op)?;
            Ok(buf)
        }
        #[cfg(target_os = "linux")]
        (Algorithm::ShmDirect, _) => super::shm_direct::all_reduce(ctx, direct(d)?, fp, io, op),
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

/// In-place all-reduce with one of the link algorithms (ring, halving-doubling, star, else
/// recursive doubling).
pub(crate) fn all_reduce_in_place<T: Element>(
    ctx: &mut Ctx<'_>,
    algo: Algorithm,
    buf: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    match algo {
        Algorithm::Ring => super::ring::all_reduce(ctx, buf, op),
        Algorithm::HalvingDoubling => super::halving::all_reduce(ctx, buf, op),
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
    d: Option<&mut Direct<'_>>,
) -> Result<()> {
    #[cfg(not(target_os = "linux"))]
    let _ = (fp, d);
    match (algo, layout) {
        #[cfg(target_os = "linux")]
        (Algorithm::ShmDirect, _) => super::shm_direct::broadcast(ctx, direct(d)?, fp, buf, root),
        (Algorithm::Hierarchical, Some(l)) => super::hierarchical::broadcast(ctx, l, buf, root),
        _ => super::tree::broadcast(ctx, buf, root),
    }
}

/// All-gather with `algo` (direct, hierarchical, else ring). In place, the direct path and
/// the ring work on the buffer itself; hierarchical copies this rank's block out first.
pub(crate) fn all_gather<T: Element>(
    ctx: &mut Ctx<'_>,
    algo: Algorithm,
    layout: Option<&HostLayout>,
    fp: &Fingerprint,
    io: GatherBuffers<'_, T>,
    d: Option<&mut Direct<'_>>,
) -> Result<()> {
    #[cfg(not(target_os = "linux"))]
    let _ = (fp, d);
    let (n, me) = (ctx.size, ctx.rank);
    match (algo, layout) {
        #[cfg(target_os = "linux")]
        (Algorithm::ShmDirect, _) => super::shm_direct::all_gather(ctx, direct(d)?, fp, io),
        (Algorithm::Hierarchical, Some(l)) => {
            let (input, output) = io.into_apart(me, n);
            super::hierarchical::all_gather(ctx, l, &input, output)
        }
        _ => super::ring::all_gather_in_place(ctx, io.into_whole(me)),
    }
}

/// Reduce-scatter with `algo` (direct, hierarchical, else ring); `op` is the combiner (`Avg`
/// is finished by the caller on the returned block, which holds the result). In place, the
/// direct path and the ring work on the buffer itself (the ring leaves partial results in the
/// other blocks); hierarchical reduces into a scratch block and copies it in.
pub(crate) fn reduce_scatter<'b, T: Element>(
    ctx: &mut Ctx<'_>,
    algo: Algorithm,
    layout: Option<&HostLayout>,
    fp: &Fingerprint,
    io: ScatterBuffers<'b, T>,
    op: ReduceOp,
    d: Option<&mut Direct<'_>>,
) -> Result<&'b mut [T]> {
    #[cfg(not(target_os = "linux"))]
    let _ = (fp, d);
    let (n, me) = (ctx.size, ctx.rank);
    match (algo, layout, io) {
        #[cfg(target_os = "linux")]
        (Algorithm::ShmDirect, _, io) => super::shm_direct::reduce_scatter(ctx, direct(d)?, fp, io, op),
        (Algorithm::Hierarchical, Some(l), ScatterBuffers::Apart { input, output }) => {
            super::hierarchical::reduce_scatter(ctx, l, input, output, op)?;
            Ok(output)
        }
        (Algorithm::Hierarchical, Some(l), ScatterBuffers::InPlace(buf)) => {
            let m = buf.len() / n;
            let mut result = vec![T::default(); m];
            super::hierarchical::reduce_scatter(ctx, l, buf, &mut result, op)?;
            let out = &mut buf[me * m..(me + 1) * m];
            out.copy_from_slice(&result);
            Ok(out)
        }
        (_, _, ScatterBuffers::Apart { input, output }) => {
            super::ring::reduce_scatter(ctx, input, output, op)?;
            Ok(output)
        }
        (_, _, ScatterBuffers::InPlace(buf)) => {
            super::ring::reduce_scatter_in_place(ctx, buf, op)?;
            let m = buf.len() / n;
            Ok(&mut buf[me * m..(me + 1) * m])
        }
    }
}

/// Reduce to group rank `root` with `algo` (direct, else binomial tree); `op` is the combiner.
/// Returns the root's result buffer (empty elsewhere), where the caller finishes `Avg`.
pub(crate) fn reduce<'b, T: Element>(
    ctx: &mut Ctx<'_>,
    algo: Algorithm,
    fp: &Fingerprint,
    io: ReduceBuffers<'b, T>,
    root: usize,
    op: ReduceOp,
    d: Option<&mut Direct<'_>>,
) -> Result<&'b mut [T]> {
    #[cfg(not(target_os = "linux"))]
    let _ = (fp, d);
    match algo {
        #[cfg(target_os = "linux")]
        Algorithm::ShmDirect => super::shm_direct::reduce(ctx, direct(d)?, fp, io, root, op),
        _ => super::tree::reduce(ctx, io, root, op),
    }
}

/// All-to-all with `algo` (direct, else pairwise exchange): block `p` of what this rank sends
/// (`send_ranges[p]`) goes to group rank `p`, whose block from this rank lands in
/// `recv_ranges` of where it receives; `uneven` says the counts differ between ranks
/// (all_to_all_v, never in place). The direct path works in place (every piece of a block is
/// copied out before its peer's piece lands there); the pairwise exchange copies the buffer
/// first.
#[allow(clippy::too_many_arguments)] // the op's buffers plus what the route hands every algorithm
pub(crate) fn all_to_all<T: Element>(
    ctx: &mut Ctx<'_>,
    algo: Algorithm,
    fp: &Fingerprint,
    io: ExchangeBuffers<'_, T>,
    send_ranges: &[Range<usize>],
    recv_ranges: &[Range<usize>],
    uneven: bool,
    d: Option<&mut Direct<'_>>,
) -> Result<()> {
    #[cfg(not(target_os = "linux"))]
    let _ = (fp, d);
    match algo {
        #[cfg(target_os = "linux")]
        Algorithm::ShmDirect => {
            super::shm_direct::all_to_all(ctx, direct(d)?, fp, io, send_ranges, recv_ranges, uneven)
        }
        _ => {
            let (send, recv) = io.into_apart();
            super::pairwise::all_to_all(ctx, &send, send_ranges, recv, recv_ranges, uneven)
        }
    }
}

/// Gather to group rank `root` with `algo` (direct, else flat); `io` as
/// [`crate::backend::Backend::gather`] takes it.
pub(crate) fn gather<T: Element>(
    ctx: &mut Ctx<'_>,
    algo: Algorithm,
    fp: &Fingerprint,
    io: GatherBuffers<'_, T>,
    root: usize,
    d: Option<&mut Direct<'_>>,
) -> Result<()> {
    #[cfg(not(target_os = "linux"))]
    let _ = (fp, d);
    match algo {
        #[cfg(target_os = "linux")]
        Algorithm::ShmDirect => super::shm_direct::gather(ctx, direct(d)?, fp, io, root),
        _ => super::star::gather(ctx, io, root),
    }
}

/// Scatter from group rank `root` with `algo` (direct, else flat); `io` as
/// [`crate::backend::Backend::scatter`] takes it.
pub(crate) fn scatter<T: Element>(
    ctx: &mut Ctx<'_>,
    algo: Algorithm,
    fp: &Fingerprint,
    io: ScatterBuffers<'_, T>,
    root: usize,
    d: Option<&mut Direct<'_>>,
) -> Result<()> {
    #[cfg(not(target_os = "linux"))]
    let _ = (fp, d);
    match algo {
        #[cfg(target_os = "linux")]
        Algorithm::ShmDirect => super::shm_direct::scatter(ctx, direct(d)?, fp, io, root),
        _ => super::star::scatter(ctx, io, root),
    }
}

/// Barrier with `algo`: dissemination, direct arrival, else the agreement phase alone (which
/// the caller runs when [`agrees`] says so).
pub(crate) fn barrier(ctx: &mut Ctx<'_>, algo: Algorithm, fp: &Fingerprint, d: Option<&mut Direct<'_>>) -> Result<()> {
    #[cfg(not(target_os = "linux"))]
    let _ = d;
    match algo {
        Algorithm::Dissemination => super::barrier::dissemination(ctx, fp),
        #[cfg(target_os = "linux")]
        Algorithm::ShmDirect => super::shm_direct::barrier(ctx, direct(d)?, fp),
        _ => Ok(()),
    }
}
