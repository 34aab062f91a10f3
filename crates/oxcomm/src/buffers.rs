//! The buffers of an op as the layers that run it see them: in place (one buffer) or apart
//! (an input that is only read and an output), for each shape of op (`ReduceBuffers`,
//! `GatherBuffers`, `ScatterBuffers`, `ExchangeBuffers`; the rooted ops use the gather and
//! scatter ones with the non-root's side empty).
//!
//! A values-level module, like [`crate::dtype`]: the communicator builds these, both backends
//! take them, and the algorithms (below the backends) read and write through them, so they
//! live below all three and import only values (`dtype`, `copy`). What an op *does* with them
//! is not here.

use std::borrow::Cow;
use std::ops::Range;

use crate::copy::copy;
use crate::dtype::{as_bytes, as_bytes_mut, Element};

/// The buffers of an all-reduce: one reduced in place, or an input that is only read and an
/// output of the same length that receives the result.
pub(crate) enum ReduceBuffers<'a, T> {
    /// `all_reduce(buf)`.
    InPlace(&'a mut [T]),
    /// `all_reduce_into(input, output)`.
    Apart { input: &'a [T], output: &'a mut [T] },
}

impl<'a, T: Element> ReduceBuffers<'a, T> {
    /// Elements in each buffer.
    pub(crate) fn len(&self) -> usize {
        match self {
            ReduceBuffers::InPlace(b) => b.len(),
            ReduceBuffers::Apart { input, .. } => input.len(),
        }
    }

    /// Elements `r` of this rank's contribution.
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    pub(crate) fn input(&self, r: Range<usize>) -> &[T] {
        match self {
            ReduceBuffers::InPlace(b) => &b[r],
            ReduceBuffers::Apart { input, .. } => &input[r],
        }
    }

    /// Elements `r` of the result's buffer, as they are.
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    pub(crate) fn output(&mut self, r: Range<usize>) -> &mut [T] {
        match self {
            ReduceBuffers::InPlace(b) => &mut b[r],
            ReduceBuffers::Apart { output, .. } => &mut output[r],
        }
    }

    /// Elements `r` of the result's buffer holding this rank's contribution (copied from the
    /// input first when apart).
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    pub(crate) fn loaded(&mut self, r: Range<usize>) -> &mut [T] {
        match self {
            ReduceBuffers::InPlace(b) => &mut b[r],
            ReduceBuffers::Apart { input, output } => {
                let out = &mut output[r.clone()];
                copy(as_bytes_mut(out), as_bytes(&input[r]));
                out
            }
        }
    }

    /// The result's buffer holding this rank's contribution, for algorithms that work in
    /// place (apart: the input is copied into the output first).
    pub(crate) fn into_in_place(self) -> &'a mut [T] {
        match self {
            ReduceBuffers::InPlace(b) => b,
            ReduceBuffers::Apart { input, output } => {
                copy(as_bytes_mut(output), as_bytes(input));
                output
            }
        }
    }

    /// The result's buffer, as it is.
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    pub(crate) fn into_output(self) -> &'a mut [T] {
        match self {
            ReduceBuffers::InPlace(b) => b,
            ReduceBuffers::Apart { output, .. } => output,
        }
    }
}

/// The buffers of an all-gather of one block per rank: one buffer of `n` blocks whose block
/// `rank` already holds this rank's contribution (NCCL's in-place form), or an input block that
/// is only read and an output of `n` blocks.
pub(crate) enum GatherBuffers<'a, T> {
    /// `all_gather_in_place(buf)`.
    InPlace(&'a mut [T]),
    /// `all_gather(input, output)`.
    Apart { input: &'a [T], output: &'a mut [T] },
}

impl<'a, T: Element> GatherBuffers<'a, T> {
    /// Elements in one block (one rank's contribution) in a group of `n`.
    pub(crate) fn block_len(&self, n: usize) -> usize {
        match self {
            GatherBuffers::InPlace(b) => b.len() / n.max(1),
            GatherBuffers::Apart { input, .. } => input.len(),
        }
    }

    /// Elements `r` of the contribution of this rank (`me`; blocks of `m`).
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    pub(crate) fn own(&self, me: usize, m: usize, r: Range<usize>) -> &[T] {
        match self {
            GatherBuffers::InPlace(b) => &b[me * m..][r],
            GatherBuffers::Apart { input, .. } => &input[r],
        }
    }

    /// Elements `r` of block `block` of the output (blocks of `m`).
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    pub(crate) fn block_mut(&mut self, m: usize, block: usize, r: Range<usize>) -> &mut [T] {
        match self {
            GatherBuffers::InPlace(b) => &mut b[block * m..][r],
            GatherBuffers::Apart { output, .. } => &mut output[block * m..][r],
        }
    }

    /// The output, with this rank's block in place (apart: copied from the input).
    pub(crate) fn into_whole(self, me: usize) -> &'a mut [T] {
        self.into_whole_with(me, copy)
    }

    /// [`GatherBuffers::into_whole`] copying the contribution with `copy_block`.
    pub(crate) fn into_whole_with(self, me: usize, copy_block: fn(&mut [u8], &[u8])) -> &'a mut [T] {
        match self {
            GatherBuffers::InPlace(b) => b,
            GatherBuffers::Apart { input, output } => {
                let m = input.len();
                copy_block(as_bytes_mut(&mut output[me * m..(me + 1) * m]), as_bytes(input));
                output
            }
        }
    }

    /// The contribution and the output as two buffers, for algorithms that take them apart
    /// (in place: the contribution is copied out first).
    pub(crate) fn into_apart(self, me: usize, n: usize) -> (Cow<'a, [T]>, &'a mut [T]) {
        match self {
            GatherBuffers::InPlace(b) => {
                let m = b.len() / n.max(1);
                (Cow::Owned(b[me * m..(me + 1) * m].to_vec()), b)
            }
            GatherBuffers::Apart { input, output } => (Cow::Borrowed(input), output),
        }
    }
}

/// The buffers of a reduce-scatter of one block per rank: one buffer of `n` blocks whose block
/// `rank` receives the result (NCCL's in-place form; the other blocks are left unspecified),
/// or an input of `n` blocks that is only read and an output block.
pub(crate) enum ScatterBuffers<'a, T> {
    /// `reduce_scatter_in_place(buf)`.
    InPlace(&'a mut [T]),
    /// `reduce_scatter(input, output)`.
    Apart { input: &'a [T], output: &'a mut [T] },
}

impl<'a, T: Element> ScatterBuffers<'a, T> {
    /// Elements in one block (one rank's result) in a group of `n`.
    pub(crate) fn block_len(&self, n: usize) -> usize {
        match self {
            ScatterBuffers::InPlace(b) => b.len() / n.max(1),
            ScatterBuffers::Apart { output, .. } => output.len(),
        }
    }

    /// Elements in this rank's input (all `n` blocks).
    pub(crate) fn input_len(&self) -> usize {
        match self {
            ScatterBuffers::InPlace(b) => b.len(),
            ScatterBuffers::Apart { input, .. } => input.len(),
        }
    }

    /// Elements `r` of this rank's input (all `n` blocks).
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    pub(crate) fn input(&self, r: Range<usize>) -> &[T] {
        match self {
            ScatterBuffers::InPlace(b) => &b[r],
            ScatterBuffers::Apart { input, .. } => &input[r],
        }
    }

    /// Elements `r` of this rank's (`me`'s) result block (blocks of `m`), and the same
    /// elements of this rank's own input block where they are elsewhere (`None` in place: the
    /// result's elements hold them until written).
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    pub(crate) fn result_and_own(&mut self, me: usize, m: usize, r: Range<usize>) -> (&mut [T], Option<&[T]>) {
        match self {
            ScatterBuffers::InPlace(b) => (&mut b[me * m..][r], None),
            ScatterBuffers::Apart { input, output } => (&mut output[r.clone()], Some(&input[me * m..][r])),
        }
    }

    /// This rank's result block (blocks of `m`).
    pub(crate) fn into_result(self, me: usize, m: usize) -> &'a mut [T] {
        match self {
            ScatterBuffers::InPlace(b) => &mut b[me * m..(me + 1) * m],
            ScatterBuffers::Apart { output, .. } => output,
        }
    }
}

/// The buffers of an all-to-all: one buffer whose blocks are replaced by the blocks the peers
/// send (MPI's `MPI_IN_PLACE`: each block goes out before the one coming in overwrites it), or
/// a send buffer that is only read and a receive buffer. Rooted ops use it for their exchange
/// with one side empty.
pub(crate) enum ExchangeBuffers<'a, T> {
    /// `all_to_all_in_place(buf)`.
    InPlace(&'a mut [T]),
    /// `all_to_all(send, recv)`.
    Apart { send: &'a [T], recv: &'a mut [T] },
}

impl<'a, T: Element> ExchangeBuffers<'a, T> {
    /// Elements `r` of what this rank sends.
    pub(crate) fn send(&self, r: Range<usize>) -> &[T] {
        match self {
            ExchangeBuffers::InPlace(b) => &b[r],
            ExchangeBuffers::Apart { send, .. } => &send[r],
        }
    }

    /// Elements `r` of where this rank receives.
    pub(crate) fn recv(&mut self, r: Range<usize>) -> &mut [T] {
        match self {
            ExchangeBuffers::InPlace(b) => &mut b[r],
            ExchangeBuffers::Apart { recv, .. } => &mut recv[r],
        }
    }

    /// Elements this rank sends (the same as it receives, for equal blocks).
    pub(crate) fn send_len(&self) -> usize {
        match self {
            ExchangeBuffers::InPlace(b) => b.len(),
            ExchangeBuffers::Apart { send, .. } => send.len(),
        }
    }

    /// Elements of the receive buffer.
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    pub(crate) fn recv_len(&self) -> usize {
        match self {
            ExchangeBuffers::InPlace(b) => b.len(),
            ExchangeBuffers::Apart { recv, .. } => recv.len(),
        }
    }

    /// The same buffers as bytes.
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    pub(crate) fn into_bytes(self) -> ExchangeBuffers<'a, u8> {
        match self {
            ExchangeBuffers::InPlace(b) => ExchangeBuffers::InPlace(as_bytes_mut(b)),
            ExchangeBuffers::Apart { send, recv } => {
                ExchangeBuffers::Apart { send: as_bytes(send), recv: as_bytes_mut(recv) }
            }
        }
    }

    /// The send and receive buffers apart, for algorithms that cannot work in place (in place:
    /// the buffer is copied out first).
    pub(crate) fn into_apart(self) -> (Cow<'a, [T]>, &'a mut [T]) {
        match self {
            ExchangeBuffers::InPlace(b) => (Cow::Owned(b.to_vec()), b),
            ExchangeBuffers::Apart { send, recv } => (Cow::Borrowed(send), recv),
        }
    }
}
