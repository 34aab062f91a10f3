//! Pairwise-exchange all-to-all (equal and per-peer counts).
//!
//! Step `k` in `1..n`: send the block for rank `r + k` while receiving the block from rank
//! `r − k` ([`schedule::pairwise`]); the own block is copied locally. Steps: n − 1. Bytes sent
//! per rank: (n − 1)/n · S for equal blocks.
//!
//! With per-peer counts, each block is preceded by its length (8 bytes) and the receiver
//! checks it against the count it expects before writing a byte, so mismatched count tables
//! fail with an error naming the peer instead of corrupting the buffer.

use std::ops::Range;

use super::schedule;
use crate::dtype::{as_bytes, Element};
use crate::engine::{Ctx, Xfer};
use crate::error::{Error, ErrorKind, Result};

/// All-to-all where rank `r`'s block for peer `p` is `send[send_ranges[p]]` and the block from
/// peer `p` lands in `recv[recv_ranges[p]]`. With `check_lengths`, lengths are exchanged and
/// compared first.
pub(crate) fn all_to_all<T: Element>(
    ctx: &mut Ctx<'_>,
    send: &[T],
    send_ranges: &[Range<usize>],
    recv: &mut [T],
    recv_ranges: &[Range<usize>],
    check_lengths: bool,
) -> Result<()> {
    let (n, r) = (ctx.size, ctx.rank);
    recv[recv_ranges[r].clone()].copy_from_slice(&send[send_ranges[r].clone()]);
    for step in 1..n {
        let (to, from) = schedule::pairwise(r, n, step);
        if check_lengths {
            let out = (send_ranges[to].len() as u64).to_le_bytes();
            let mut got = [0u8; 8];
            ctx.sendrecv(to, &out, from, &mut got)?;
            let got = u64::from_le_bytes(got);
            let want = recv_ranges[from].len() as u64;
            if got != want {
                return Err(Error::new(
                    ErrorKind::Mismatch,
                    format!("rank {} sends {got} elements here but recv_counts[{from}] = {want}", ctx.world(from)),
                )
                .with_peer(ctx.world(from)));
            }
        }
        let block = &send[send_ranges[to].clone()];
        let dst = &mut recv[recv_ranges[from].clone()];
        ctx.run(&mut [Xfer::send(to, as_bytes(block)), Xfer::recv(from, bytemuck::cast_slice_mut(dst))])?;
    }
    Ok(())
}
