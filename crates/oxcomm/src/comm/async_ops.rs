//! The async forms of the collectives: each runs its sync op through
//! [`Communicator::run_async`], so async ops keep their place in the rank's order of ops.

use super::work::Work;
use super::Communicator;
use crate::dtype::Element;
use crate::reduce::ReduceOp;

impl Communicator {
    /// handle. Async ops on one communicator run and complete in the order they were issued.
    pub fn all_reduce_async<T: Element>(&self, buf: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        self.run_async(move |c| {
            let mut buf = buf;
            c.all_reduce(&mut buf, op)?;
            Ok(buf)
        })
    }

    /// Async [`Communicator::broadcast`].
    pub fn broadcast_async<T: Element>(&self, buf: Vec<T>, root: usize) -> Work<Vec<T>> {
        self.run_async(move |c| {
            let mut buf = buf;
            c.broadcast(&mut buf, root)?;
            Ok(buf)
        })
    }

    /// Async [`Communicator::reduce`].
    pub fn reduce_async<T: Element>(&self, buf: Vec<T>, root: usize, op: ReduceOp) -> Work<Vec<T>> {
        self.run_async(move |c| {
            let mut buf = buf;
            c.reduce(&mut buf, root, op)?;
            Ok(buf)
        })
    }

    /// Async [`Communicator::all_gather`]: the handle returns the gathered buffer.
    pub fn all_gather_async<T: Element>(&self, input: Vec<T>) -> Work<Vec<T>> {
        self.run_async(move |c| {
            let mut out = vec![T::default(); input.len() * c.size()];
            c.all_gather(&input, &mut out)?;
            Ok(out)
        })
    }

    /// Async [`Communicator::reduce_scatter`]: the handle returns this rank's block.
    pub fn reduce_scatter_async<T: Element>(&self, input: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        self.run_async(move |c| {
            let mut out = vec![T::default(); input.len() / c.size().max(1)];
            c.reduce_scatter(&input, &mut out, op)?;
            Ok(out)
        })
    }

    /// Async [`Communicator::all_to_all`]: the handle returns the received buffer.
    pub fn all_to_all_async<T: Element>(&self, send: Vec<T>) -> Work<Vec<T>> {
        self.run_async(move |c| {
            let mut out = vec![T::default(); send.len()];
            c.all_to_all(&send, &mut out)?;
            Ok(out)
        })
    }

    /// Async [`Communicator::barrier`].
    pub fn barrier_async(&self) -> Work<()> {
        self.run_async(move |c| c.barrier())
    }
}
