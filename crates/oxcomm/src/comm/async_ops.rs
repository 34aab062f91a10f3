//! The async forms of the collectives: each runs its sync op through
//! [`Communicator::run_async`], so async ops keep their place in the rank's order of ops.
//!
//! Each takes its buffers by value and hands them back through the [`Work`] handle. A buffer
//! is any [`OwnedBuf`]: a `Vec<T>`, a `Box<[T]>`, or a caller's own type around memory it owns
//! (a pinned region, a tensor's storage), so no copy in or out is needed. Ops that produce a
//! buffer of a new size also have an `_into_async` form that writes into one the caller passes.

use super::work::Work;
use super::Communicator;
use crate::dtype::Element;
use crate::reduce::ReduceOp;

/// An owned buffer of `T` that an async op can take, use in its turn and hand back: anything
/// `AsRef<[T]> + AsMut<[T]> + Send + 'static`, such as `Vec<T>`, `Box<[T]>` or a caller's
/// wrapper around foreign memory.
///
/// The op reads and writes the elements only through `as_ref`/`as_mut`, on the communicator's
/// async worker thread, between the call and the moment the handle completes; a wrapper must
/// keep the memory valid (and not touched by anyone else) for that long, which owning it
/// ensures.
///
/// ```
/// use oxcomm::{threads, ReduceOp};
///
/// /// A caller's buffer type (here over a boxed slice; in practice foreign memory).
/// struct Pinned(Box<[f32]>);
/// impl AsRef<[f32]> for Pinned {
///     fn as_ref(&self) -> &[f32] { &self.0 }
/// }
/// impl AsMut<[f32]> for Pinned {
///     fn as_mut(&mut self) -> &mut [f32] { &mut self.0 }
/// }
///
/// let out = threads::run(2, |comm| {
///     let buf = Pinned(vec![comm.rank() as f32 + 1.0; 4].into_boxed_slice());
///     let buf = comm.all_reduce_async(buf, ReduceOp::Sum).wait()?;
///     Ok::<_, oxcomm::Error>(buf.0[0])
/// })?;
/// assert_eq!(*out[0].as_ref().unwrap(), 3.0);
/// # Ok::<(), oxcomm::Error>(())
/// ```
pub trait OwnedBuf<T>: AsRef<[T]> + AsMut<[T]> + Send + 'static {}

impl<T, B: AsRef<[T]> + AsMut<[T]> + Send + 'static> OwnedBuf<T> for B {}

impl Communicator {
    /// Async [`Communicator::all_reduce`]: takes the buffer and hands it back through the
    /// handle. Async ops on one communicator run and complete in the order they were issued.
    pub fn all_reduce_async<T: Element, B: OwnedBuf<T>>(&self, buf: B, op: ReduceOp) -> Work<B> {
        self.run_async(move |c| {
            let mut buf = buf;
            c.all_reduce(buf.as_mut(), op)?;
            Ok(buf)
        })
    }

    /// Async [`Communicator::broadcast`].
    pub fn broadcast_async<T: Element, B: OwnedBuf<T>>(&self, buf: B, root: usize) -> Work<B> {
        self.run_async(move |c| {
            let mut buf = buf;
            c.broadcast(buf.as_mut(), root)?;
            Ok(buf)
        })
    }

    /// Async [`Communicator::reduce`].
    pub fn reduce_async<T: Element, B: OwnedBuf<T>>(&self, buf: B, root: usize, op: ReduceOp) -> Work<B> {
        self.run_async(move |c| {
            let mut buf = buf;
            c.reduce(buf.as_mut(), root, op)?;
            Ok(buf)
        })
    }

    /// Async [`Communicator::all_gather`]: the handle returns the gathered buffer.
    pub fn all_gather_async<T: Element, I: OwnedBuf<T>>(&self, input: I) -> Work<Vec<T>> {
        self.run_async(move |c| {
            let input = input.as_ref();
            let mut out = vec![T::default(); input.len() * c.size()];
            c.all_gather(input, &mut out)?;
            Ok(out)
        })
    }

    /// Async [`Communicator::all_gather`] into the caller's `output`; the handle returns both.
    pub fn all_gather_into_async<T: Element, I: OwnedBuf<T>, O: OwnedBuf<T>>(
        &self,
        input: I,
        output: O,
    ) -> Work<(I, O)> {
        self.run_async(move |c| {
            let (input, mut output) = (input, output);
            c.all_gather(input.as_ref(), output.as_mut())?;
            Ok((input, output))
        })
    }

    /// Async [`Communicator::reduce_scatter`]: the handle returns this rank's block.
    pub fn reduce_scatter_async<T: Element, I: OwnedBuf<T>>(&self, input: I, op: ReduceOp) -> Work<Vec<T>> {
        self.run_async(move |c| {
            let input = input.as_ref();
            let mut out = vec![T::default(); input.len() / c.size().max(1)];
            c.reduce_scatter(input, &mut out, op)?;
            Ok(out)
        })
    }

    /// Async [`Communicator::reduce_scatter`] into the caller's `output`; the handle returns
    /// both.
    pub fn reduce_scatter_into_async<T: Element, I: OwnedBuf<T>, O: OwnedBuf<T>>(
        &self,
        input: I,
        output: O,
        op: ReduceOp,
    ) -> Work<(I, O)> {
        self.run_async(move |c| {
            let (input, mut output) = (input, output);
            c.reduce_scatter(input.as_ref(), output.as_mut(), op)?;
            Ok((input, output))
        })
    }

    /// Async [`Communicator::all_to_all`]: the handle returns the received buffer.
    pub fn all_to_all_async<T: Element, I: OwnedBuf<T>>(&self, send: I) -> Work<Vec<T>> {
        self.run_async(move |c| {
            let send = send.as_ref();
            let mut out = vec![T::default(); send.len()];
            c.all_to_all(send, &mut out)?;
            Ok(out)
        })
    }

    /// Async [`Communicator::all_to_all`] into the caller's `recv`; the handle returns both.
    pub fn all_to_all_into_async<T: Element, I: OwnedBuf<T>, O: OwnedBuf<T>>(&self, send: I, recv: O) -> Work<(I, O)> {
        self.run_async(move |c| {
            let (send, mut recv) = (send, recv);
            c.all_to_all(send.as_ref(), recv.as_mut())?;
            Ok((send, recv))
        })
    }

    /// Async [`Communicator::all_to_all_v`]; the handle returns both buffers.
    pub fn all_to_all_v_async<T: Element, I: OwnedBuf<T>, O: OwnedBuf<T>>(
        &self,
        send: I,
        send_counts: Vec<usize>,
        recv: O,
        recv_counts: Vec<usize>,
    ) -> Work<(I, O)> {
        self.run_async(move |c| {
            let (send, mut recv) = (send, recv);
            c.all_to_all_v(send.as_ref(), &send_counts, recv.as_mut(), &recv_counts)?;
            Ok((send, recv))
        })
    }

    /// Async [`Communicator::gather`] (`output`: `Some` at the root); the handle returns both.
    pub fn gather_async<T: Element, I: OwnedBuf<T>, O: OwnedBuf<T>>(
        &self,
        input: I,
        output: Option<O>,
        root: usize,
    ) -> Work<(I, Option<O>)> {
        self.run_async(move |c| {
            let (input, mut output) = (input, output);
            c.gather(input.as_ref(), output.as_mut().map(|o| o.as_mut()), root)?;
            Ok((input, output))
        })
    }

    /// Async [`Communicator::scatter`] (`input`: `Some` at the root); the handle returns both.
    pub fn scatter_async<T: Element, I: OwnedBuf<T>, O: OwnedBuf<T>>(
        &self,
        input: Option<I>,
        output: O,
        root: usize,
    ) -> Work<(Option<I>, O)> {
        self.run_async(move |c| {
            let (input, mut output) = (input, output);
            c.scatter(input.as_ref().map(|i| i.as_ref()), output.as_mut(), root)?;
            Ok((input, output))
        })
    }

    /// Async [`Communicator::all_reduce_coalesced`]; the handle returns the buffers.
    pub fn all_reduce_coalesced_async<T: Element, B: OwnedBuf<T>>(&self, bufs: Vec<B>, op: ReduceOp) -> Work<Vec<B>> {
        self.run_async(move |c| {
            let mut bufs = bufs;
            let mut views: Vec<&mut [T]> = bufs.iter_mut().map(|b| b.as_mut()).collect();
            c.all_reduce_coalesced(&mut views, op)?;
            Ok(bufs)
        })
    }

    /// Async [`Communicator::all_gather_coalesced`]; the handle returns both lists of buffers.
    pub fn all_gather_coalesced_async<T: Element, I: OwnedBuf<T>, O: OwnedBuf<T>>(
        &self,
        inputs: Vec<I>,
        outputs: Vec<O>,
    ) -> Work<(Vec<I>, Vec<O>)> {
        self.run_async(move |c| {
            let (inputs, mut outputs) = (inputs, outputs);
            {
                let ins: Vec<&[T]> = inputs.iter().map(|b| b.as_ref()).collect();
                let mut outs: Vec<&mut [T]> = outputs.iter_mut().map(|b| b.as_mut()).collect();
                c.all_gather_coalesced(&ins, &mut outs)?;
            }
            Ok((inputs, outputs))
        })
    }

    /// Async [`Communicator::barrier`].
    pub fn barrier_async(&self) -> Work<()> {
        self.run_async(move |c| c.barrier())
    }
}
