//! The collectives: every public op of [`Communicator`] that all ranks of the group call
//! together, in its sync form. Each validates its arguments (nothing is sent for a bad one),
//! builds its fingerprint, and runs the algorithm `algorithms::dispatch` picks.

use std::time::Duration;

use super::{Communicator, OpOptions};
use crate::algorithms::{self, dispatch, plan, Algorithm, ReduceBuffers};
use crate::dtype::Element;
use crate::error::Result;
use crate::reduce::{self, ReduceOp};
use crate::wire::{Fingerprint, OpKind};

impl Communicator {
    pub(super) fn algorithm(
        &self,
        fp: &Fingerprint,
        opts: &OpOptions,
        bytes: usize,
        count: usize,
    ) -> Result<Algorithm> {
        let forced = match (opts.algorithm, self.core.config.algorithm) {
            (Some(a), _) => Some(a),
            (None, Some(a)) if plan::candidates(fp.kind).contains(&a) => Some(a),
            _ => None,
        };
        plan::choose(fp.kind, bytes, count, self.size(), forced, self.has_direct(), self.group.layout.is_some())
            .map_err(|e| e.with_op(self.describe(fp)).with_rank(self.core.world_rank))
    }

    /// Whether this communicator can use the direct shared-memory path.
    pub(super) fn has_direct(&self) -> bool {
        #[cfg(target_os = "linux")]
        return self.group.id == 0 && self.core.direct.is_some();
        #[cfg(not(target_os = "linux"))]
        false
    }

    /// Reduces `buf` across the group with `op`; every rank gets the result in `buf`.
    #[track_caller]
    pub fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.all_reduce_with(buf, op, &OpOptions::default())
    }

    /// [`Communicator::all_reduce`] with per-op options.
    #[track_caller]
    pub fn all_reduce_with<T: Element>(&self, buf: &mut [T], op: ReduceOp, opts: &OpOptions) -> Result<()> {
        self.all_reduce_buffers(ReduceBuffers::InPlace(buf), op, opts)
    }

    /// Reduces every rank's `input` with `op` into every rank's `output` (NCCL's out-of-place
    /// `ncclAllReduce(sendbuff, recvbuff)`); `input` is only read. Both have the same length.
    ///
    /// The shared-memory direct algorithm reads `input` where it would read the buffer in place,
    /// so this costs no more than [`Communicator::all_reduce`]; the others copy `input` into
    /// `output` and reduce that in place. Ranks may mix this and `all_reduce` in one op. On
    /// error `output` holds garbage. Lengths that differ are [`crate::ErrorKind::InvalidArgument`]
    /// before any communication.
    ///
    /// ```
    /// use oxcomm::ReduceOp;
    /// let out = oxcomm::threads::run(2, |comm| {
    ///     let grads = vec![comm.rank() as f32 + 1.0; 4];
    ///     let mut sum = vec![0.0; 4];
    ///     comm.all_reduce_into(&grads, &mut sum, ReduceOp::Sum)?;
    ///     Ok::<_, oxcomm::Error>((grads, sum))
    /// })
    /// .unwrap();
    /// let (grads, sum) = out[1].as_ref().unwrap();
    /// assert_eq!((grads[0], sum[0]), (2.0, 3.0));
    /// ```
    #[track_caller]
    pub fn all_reduce_into<T: Element>(&self, input: &[T], output: &mut [T], op: ReduceOp) -> Result<()> {
        self.all_reduce_into_with(input, output, op, &OpOptions::default())
    }

    /// [`Communicator::all_reduce_into`] with per-op options.
    #[track_caller]
    pub fn all_reduce_into_with<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
        opts: &OpOptions,
    ) -> Result<()> {
        self.all_reduce_buffers(ReduceBuffers::Apart { input, output }, op, opts)
    }

    #[track_caller]
    pub(super) fn all_reduce_buffers<T: Element>(
        &self,
        io: ReduceBuffers<'_, T>,
        op: ReduceOp,
        opts: &OpOptions,
    ) -> Result<()> {
        let count = io.len();
        let mut fp = Self::with_dtype::<T>(self.fingerprint(OpKind::AllReduce), count);
        fp.op = Some(op);
        if let ReduceBuffers::Apart { input, output } = &io {
            if input.len() != output.len() {
                let msg = format!("output has {} elements, input {}: they must be equal", output.len(), input.len());
                return Err(self.arg_error(&fp, msg));
            }
        }
        reduce::check(op, T::DTYPE).map_err(|e| e.with_op(self.describe(&fp)).with_rank(self.core.world_rank))?;
        #[cfg(feature = "mpi")]
        if let Some(b) = self.mpi() {
            return b.all_reduce(self, fp, io.into_in_place(), op, opts);
        }
        let algo = self.algorithm(&fp, opts, count * std::mem::size_of::<T>(), count)?;
        let n = self.size();
        let layout = self.group.layout.as_ref();
        self.collective(fp, opts, dispatch::agrees(algo), algo.name(), |ctx, fp| {
            let buf = dispatch::all_reduce(ctx, algo, layout, fp, io, op.combiner())?;
            reduce::finish_avg(buf, op, n);
            Ok(())
        })
    }

    /// Reduces `buf` across the group into `root`'s `buf`; other ranks' buffers are unchanged.
    #[track_caller]
    pub fn reduce<T: Element>(&self, buf: &mut [T], root: usize, op: ReduceOp) -> Result<()> {
        self.reduce_with(buf, root, op, &OpOptions::default())
    }

    /// [`Communicator::reduce`] with per-op options.
    #[track_caller]
    pub fn reduce_with<T: Element>(&self, buf: &mut [T], root: usize, op: ReduceOp, opts: &OpOptions) -> Result<()> {
        let mut fp = Self::with_dtype::<T>(self.fingerprint(OpKind::Reduce), buf.len());
        fp.op = Some(op);
        fp.root = Some(root as u32);
        self.check_root(root, &fp)?;
        reduce::check(op, T::DTYPE).map_err(|e| e.with_op(self.describe(&fp)).with_rank(self.core.world_rank))?;
        #[cfg(feature = "mpi")]
        if let Some(b) = self.mpi() {
            return b.reduce(self, fp, buf, root, op, opts);
        }
        self.algorithm(&fp, opts, std::mem::size_of_val(buf), buf.len())?;
        let (n, me) = (self.size(), self.rank());
        self.collective(fp, opts, true, "tree", |ctx, _| {
            algorithms::tree::reduce(ctx, buf, root, op.combiner())?;
            if me == root {
                reduce::finish_avg(buf, op, n);
            }
            Ok(())
        })
    }

    /// Copies `root`'s `buf` into every rank's `buf`.
    #[track_caller]
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.broadcast_with(buf, root, &OpOptions::default())
    }

    /// [`Communicator::broadcast`] with per-op options.
    #[track_caller]
    pub fn broadcast_with<T: Element>(&self, buf: &mut [T], root: usize, opts: &OpOptions) -> Result<()> {
        let mut fp = Self::with_dtype::<T>(self.fingerprint(OpKind::Broadcast), buf.len());
        fp.root = Some(root as u32);
        self.check_root(root, &fp)?;
        #[cfg(feature = "mpi")]
        if let Some(b) = self.mpi() {
            return b.broadcast(self, fp, buf, root, opts);
        }
        let algo = self.algorithm(&fp, opts, std::mem::size_of_val(buf), buf.len())?;
        let layout = self.group.layout.as_ref();
        self.collective(fp, opts, dispatch::agrees(algo), algo.name(), |ctx, fp| {
            dispatch::broadcast(ctx, algo, layout, fp, buf, root)
        })
    }

    /// Gathers every rank's `input` into `output` (size × input.len(), rank order).
    #[track_caller]
    pub fn all_gather<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        self.all_gather_with(input, output, &OpOptions::default())
    }

    /// [`Communicator::all_gather`] with per-op options.
    #[track_caller]
    pub fn all_gather_with<T: Element>(&self, input: &[T], output: &mut [T], opts: &OpOptions) -> Result<()> {
        let fp = Self::with_dtype::<T>(self.fingerprint(OpKind::AllGather), input.len());
        if output.len() != input.len() * self.size() {
            return Err(self.arg_error(
                &fp,
                format!(
                    "output has {} elements, expected size × input = {} × {}",
                    output.len(),
                    self.size(),
                    input.len()
                ),
            ));
        }
        #[cfg(feature = "mpi")]
        if let Some(b) = self.mpi() {
            return b.all_gather(self, fp, input, output, opts);
        }
        let algo = self.algorithm(&fp, opts, std::mem::size_of_val(input), input.len())?;
        let layout = self.group.layout.as_ref();
        self.collective(fp, opts, true, algo.name(), |ctx, _| dispatch::all_gather(ctx, algo, layout, input, output))
    }

    /// Reduces `input` (size × output.len()) across the group; rank r gets block r of the
    /// result in `output`.
    #[track_caller]
    pub fn reduce_scatter<T: Element>(&self, input: &[T], output: &mut [T], op: ReduceOp) -> Result<()> {
        self.reduce_scatter_with(input, output, op, &OpOptions::default())
    }

    /// [`Communicator::reduce_scatter`] with per-op options.
    #[track_caller]
    pub fn reduce_scatter_with<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
        opts: &OpOptions,
    ) -> Result<()> {
        let mut fp = Self::with_dtype::<T>(self.fingerprint(OpKind::ReduceScatter), input.len());
        fp.op = Some(op);
        reduce::check(op, T::DTYPE).map_err(|e| e.with_op(self.describe(&fp)).with_rank(self.core.world_rank))?;
        if input.len() != output.len() * self.size() {
            return Err(self.arg_error(
                &fp,
                format!(
                    "input has {} elements, expected size × output = {} × {} (the input length must be a multiple of the group size)",
                    input.len(),
                    self.size(),
                    output.len()
                ),
            ));
        }
        #[cfg(feature = "mpi")]
        if let Some(b) = self.mpi() {
            return b.reduce_scatter(self, fp, input, output, op, opts);
        }
        let algo = self.algorithm(&fp, opts, std::mem::size_of_val(input), input.len())?;
        let n = self.size();
        let layout = self.group.layout.as_ref();
        self.collective(fp, opts, true, algo.name(), |ctx, _| {
            dispatch::reduce_scatter(ctx, algo, layout, input, output, op.combiner())?;
            reduce::finish_avg(output, op, n);
            Ok(())
        })
    }

    /// All-to-all with equal blocks: block p of `send` goes to rank p; block p of `recv`
    /// comes from rank p. Both lengths must be equal and a multiple of the group size.
    #[track_caller]
    pub fn all_to_all<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.all_to_all_with(send, recv, &OpOptions::default())
    }

    /// [`Communicator::all_to_all`] with per-op options.
    #[track_caller]
    pub fn all_to_all_with<T: Element>(&self, send: &[T], recv: &mut [T], opts: &OpOptions) -> Result<()> {
        let fp = Self::with_dtype::<T>(self.fingerprint(OpKind::AllToAll), send.len());
        let n = self.size();
        if send.len() != recv.len() || send.len() % n != 0 {
            return Err(self.arg_error(
                &fp,
                format!(
                    "send ({}) and recv ({}) must have the same length, a multiple of the group size {n}",
                    send.len(),
                    recv.len()
                ),
            ));
        }
        #[cfg(feature = "mpi")]
        if let Some(b) = self.mpi() {
            return b.all_to_all(self, fp, send, recv, opts);
        }
        self.algorithm(&fp, opts, std::mem::size_of_val(send), send.len())?;
        let c = send.len() / n;
        let ranges: Vec<_> = (0..n).map(|p| p * c..(p + 1) * c).collect();
        self.collective(fp, opts, true, "pairwise", |ctx, _| {
            algorithms::pairwise::all_to_all(ctx, send, &ranges, recv, &ranges, false)
        })
    }

    /// All-to-all with per-peer counts: `send_counts[p]` elements of `send` (contiguous, in
    /// rank order) go to rank p; `recv_counts[p]` elements from rank p land in `recv`. A
    /// count that disagrees with the peer's is an error naming the peer; nothing is written
    /// from that peer.
    #[track_caller]
    pub fn all_to_all_v<T: Element>(
        &self,
        send: &[T],
        send_counts: &[usize],
        recv: &mut [T],
        recv_counts: &[usize],
    ) -> Result<()> {
        let fp = Self::with_dtype::<T>(self.fingerprint(OpKind::AllToAllV), 0);
        let n = self.size();
        for (name, counts, len) in [("send", send_counts, send.len()), ("recv", recv_counts, recv.len())] {
            if counts.len() != n {
                return Err(self.arg_error(&fp, format!("{name}_counts has {} entries, expected {n}", counts.len())));
            }
            let total: usize = counts.iter().sum();
            if total != len {
                return Err(
                    self.arg_error(&fp, format!("{name}_counts add up to {total} but {name} has {len} elements"))
                );
            }
        }
        let ranges = |counts: &[usize]| {
            let mut at = 0;
            counts
                .iter()
                .map(|c| {
                    at += c;
                    at - c..at
                })
                .collect::<Vec<_>>()
        };
        let (sr, rr) = (ranges(send_counts), ranges(recv_counts));
        if sr[self.rank()].len() != rr[self.rank()].len() {
            return Err(self.arg_error(
                &fp,
                format!(
                    "send_counts[{me}] = {} but recv_counts[{me}] = {} (this rank's own block)",
                    sr[self.rank()].len(),
                    rr[self.rank()].len(),
                    me = self.rank()
                ),
            ));
        }
        #[cfg(feature = "mpi")]
        if let Some(b) = self.mpi() {
            return b.all_to_all_v(self, fp, send, send_counts, recv, recv_counts);
        }
        self.collective(fp, &OpOptions::default(), true, "pairwise", |ctx, _| {
            algorithms::pairwise::all_to_all(ctx, send, &sr, recv, &rr, true)
        })
    }

    /// Gathers every rank's `input` into `output` on `root` (size × input.len()); other
    /// ranks pass `None`.
    #[track_caller]
    pub fn gather<T: Element>(&self, input: &[T], output: Option<&mut [T]>, root: usize) -> Result<()> {
        let mut fp = Self::with_dtype::<T>(self.fingerprint(OpKind::Gather), input.len());
        fp.root = Some(root as u32);
        self.check_root(root, &fp)?;
        let want = input.len() * self.size();
        let output = self.root_buffer(&fp, root, output, |o| o.len(), want, "output")?;
        #[cfg(feature = "mpi")]
        if let Some(b) = self.mpi() {
            return b.gather(self, fp, input, output, root);
        }
        self.collective(fp, &OpOptions::default(), true, "flat", |ctx, _| {
            algorithms::star::gather(ctx, input, output, root)
        })
    }

    /// Scatters block p of `root`'s `input` (size × output.len()) to rank p's `output`; other
    /// ranks pass `None`.
    #[track_caller]
    pub fn scatter<T: Element>(&self, input: Option<&[T]>, output: &mut [T], root: usize) -> Result<()> {
        let mut fp = Self::with_dtype::<T>(self.fingerprint(OpKind::Scatter), output.len());
        fp.root = Some(root as u32);
        self.check_root(root, &fp)?;
        let want = output.len() * self.size();
        let input = self.root_buffer(&fp, root, input, |i| i.len(), want, "input")?;
        #[cfg(feature = "mpi")]
        if let Some(b) = self.mpi() {
            return b.scatter(self, fp, input, output, root);
        }
        self.collective(fp, &OpOptions::default(), true, "flat", |ctx, _| {
            algorithms::star::scatter(ctx, input, output, root)
        })
    }

    /// Blocks until every rank of the group has called `barrier`.
    #[track_caller]
    pub fn barrier(&self) -> Result<()> {
        self.barrier_with(&OpOptions::default())
    }

    /// [`Communicator::barrier`] with per-op options (e.g. the dissemination algorithm).
    #[track_caller]
    pub fn barrier_with(&self, opts: &OpOptions) -> Result<()> {
        let fp = self.fingerprint(OpKind::Barrier);
        #[cfg(feature = "mpi")]
        if let Some(b) = self.mpi() {
            return b.barrier(self, fp, opts);
        }
        let algo = self.algorithm(&fp, opts, 0, 0)?;
        self.collective(fp, opts, dispatch::agrees(algo), algo.name(), |ctx, fp| dispatch::barrier(ctx, algo, fp))
    }

    /// A barrier that waits at most `timeout` and, on failure, names every rank that did not
    /// arrive (rank 0 collects the arrivals).
    #[track_caller]
    pub fn monitored_barrier(&self, timeout: Duration) -> Result<()> {
        let fp = self.fingerprint(OpKind::MonitoredBarrier);
        let opts = OpOptions { timeout: Some(timeout), ..OpOptions::default() };
        #[cfg(feature = "mpi")]
        if let Some(b) = self.mpi() {
            return b.monitored_barrier(self, fp, timeout);
        }
        self.collective(fp, &opts, true, "star", |_, _| Ok(()))
    }

    /// All-reduces several buffers as one op (one agreement, one algorithm run).
    #[track_caller]
    pub fn all_reduce_coalesced<T: Element>(&self, bufs: &mut [&mut [T]], op: ReduceOp) -> Result<()> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        let mut fp = Self::with_dtype::<T>(self.fingerprint(OpKind::AllReduceCoalesced), total);
        fp.op = Some(op);
        fp.extra = bufs.len() as u64;
        reduce::check(op, T::DTYPE).map_err(|e| e.with_op(self.describe(&fp)).with_rank(self.core.world_rank))?;
        let opts = OpOptions::default();
        #[cfg(feature = "mpi")]
        if let Some(b) = self.mpi() {
            return b.all_reduce_coalesced(self, fp, bufs, op);
        }
        let algo = self.algorithm(&fp, &opts, total * T::DTYPE.size(), total)?;
        let n = self.size();
        self.collective(fp, &opts, true, algo.name(), |ctx, _| {
            let mut flat: Vec<T> = Vec::with_capacity(total);
            for b in bufs.iter() {
                flat.extend_from_slice(b);
            }
            dispatch::all_reduce_in_place(ctx, algo, &mut flat, op.combiner())?;
            reduce::finish_avg(&mut flat, op, n);
            let mut at = 0;
            for b in bufs.iter_mut() {
                b.copy_from_slice(&flat[at..at + b.len()]);
                at += b.len();
            }
            Ok(())
        })
    }

    /// All-gathers several buffers as one op: `outputs[i]` (size × `inputs[i].len()`) receives
    /// every rank's `inputs[i]`.
    #[track_caller]
    pub fn all_gather_coalesced<T: Element>(&self, inputs: &[&[T]], outputs: &mut [&mut [T]]) -> Result<()> {
        let total: usize = inputs.iter().map(|b| b.len()).sum();
        let mut fp = Self::with_dtype::<T>(self.fingerprint(OpKind::AllGatherCoalesced), total);
        fp.extra = inputs.len() as u64;
        let n = self.size();
        if inputs.len() != outputs.len() {
            return Err(self.arg_error(&fp, format!("{} inputs but {} outputs", inputs.len(), outputs.len())));
        }
        for (i, (a, b)) in inputs.iter().zip(outputs.iter()).enumerate() {
            if b.len() != a.len() * n {
                return Err(
                    self.arg_error(&fp, format!("outputs[{i}] has {} elements, expected {} × {}", b.len(), n, a.len()))
                );
            }
        }
        #[cfg(feature = "mpi")]
        if let Some(b) = self.mpi() {
            return b.all_gather_coalesced(self, fp, inputs, outputs);
        }
        self.collective(fp, &OpOptions::default(), true, "ring", |ctx, _| {
            let mut flat: Vec<T> = Vec::with_capacity(total);
            for b in inputs {
                flat.extend_from_slice(b);
            }
            let mut all = vec![T::default(); total * n];
            algorithms::ring::all_gather(ctx, &flat, &mut all)?;
            for (p, block) in all.chunks(total.max(1)).enumerate().take(n) {
                let mut at = 0;
                for (i, out) in outputs.iter_mut().enumerate() {
                    let c = inputs[i].len();
                    out[p * c..(p + 1) * c].copy_from_slice(&block[at..at + c]);
                    at += c;
                }
            }
            Ok(())
        })
    }
}
