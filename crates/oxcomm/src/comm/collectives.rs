//! The collectives: every public op of [`Communicator`] that all ranks of the group call
//! together, in its sync form. Each validates its arguments (nothing is sent for a bad one),
//! builds its fingerprint, asks the backend for a route and runs the op on the backend in its
//! turn ([`crate::backend`]).
//!
//! `Avg` is finished here, for every backend: a reduction reaches the backend with its
//! combiner (`op.combiner()`, `Sum` for `Avg`), and the buffer the backend hands back is
//! divided by the group size ([`reduce::finish_avg`]) inside the op's turn, before the op
//! counts as done. all_reduce, reduce (at the root), reduce_scatter and all_reduce_coalesced
//! do this; the composite ops are built on them.
//!
//! Over 600 lines because it is one list: every sync collective's argument checks and
//! fingerprint, each a few lines that read best side by side; the op path they share is in
//! `core.rs`, the async forms in `async_ops.rs`.

use std::time::Duration;

use super::{Communicator, OpOptions};
use crate::algorithms::plan;
use crate::backend::{Backend, Route};
use crate::buffers::{ExchangeBuffers, GatherBuffers, ReduceBuffers, ScatterBuffers};
use crate::dtype::Element;
use crate::error::Result;
use crate::reduce::{self, ReduceOp};
use crate::wire::{Fingerprint, OpKind};

impl Communicator {
    /// How the backend will run the op of `fp` on `bytes` (`count` elements): the forced
    /// algorithm is `opts`', else the communicator's when it applies to the op. A forced
    /// algorithm that does not apply is an error before anything is sent.
    pub(super) fn route(&self, fp: &Fingerprint, opts: &OpOptions, bytes: usize, count: usize) -> Result<Route> {
        let forced = match (opts.algorithm, self.core.config.algorithm) {
            (Some(a), _) => Some(a),
            (None, Some(a)) if plan::candidates(fp.kind).contains(&a) => Some(a),
            _ => None,
        };
        self.core
            .backend
            .route(fp.kind, bytes, count, &self.view(), forced)
            .map_err(|e| e.with_op(self.describe(fp)).with_rank(self.core.world_rank))
    }

    /// Reduces `buf` across the group with `op`; every rank gets the result in `buf`.
    #[track_caller]
    pub fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.all_reduce_with(buf, op, &OpOptions::default())
    }

    /// All-reduce of every rank's `factor × buf` (NCCL's `ncclRedOpCreatePreMulSum`, torch's
    /// `ReduceOp.PREMUL_SUM`): this rank's `buf` is multiplied by its `factor` in place,
    /// element by element as [`ReduceOp::Prod`] multiplies (exact integer and complex
    /// products, a logical and on bools), then summed over the ranks. Ranks may pass different
    /// factors. A dtype that cannot be multiplied and summed (float8) is refused before `buf`
    /// is touched.
    ///
    /// ```
    /// let sums = oxcomm::threads::run(2, |comm| {
    ///     let mut buf = [1.0f32, 2.0];
    ///     let factor = if comm.rank() == 0 { 0.5 } else { 3.0 };
    ///     comm.all_reduce_premul_sum(&mut buf, factor).unwrap();
    ///     buf
    /// })
    /// .unwrap();
    /// assert_eq!(sums[0], [3.5, 7.0]);
    /// ```
    #[track_caller]
    pub fn all_reduce_premul_sum<T: Element>(&self, buf: &mut [T], factor: T) -> Result<()> {
        for op in [ReduceOp::Prod, ReduceOp::Sum] {
            crate::reduce::check(op, T::DTYPE).map_err(|e| {
                let fp = Self::with_dtype::<T>(self.fingerprint(OpKind::AllReduce), buf.len());
                e.with_op(format!("{} (premul sum)", self.describe(&fp))).with_rank(self.core.world_rank)
            })?;
        }
        const PIECE: usize = 64;
        let factors = [factor; PIECE];
        for piece in buf.chunks_mut(PIECE) {
            crate::reduce::reduce_into(piece, &factors[..piece.len()], ReduceOp::Prod);
        }
        self.all_reduce(buf, ReduceOp::Sum)
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
        let route = self.route(&fp, opts, count * std::mem::size_of::<T>(), count)?;
        let n = self.size();
        self.run_op(fp, opts, route, |b, env| {
            let out = b.all_reduce(env, route, io, op.combiner())?;
            reduce::finish_avg(out, op, n);
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
        let fp = self.reduce_fingerprint::<T>(buf.len(), root, op)?;
        self.reduce_buffers(fp, ReduceBuffers::InPlace(buf), root, op, opts)
    }

    /// Reduce out of place (MPI's `MPI_Reduce(sendbuf, recvbuf)`): every rank's `input` is
    /// only read; `root` passes `Some(output)` (as long as `input`), which receives the
    /// reduction, and the others pass `None`. On shared memory the root reads its input and
    /// writes its output directly, with no copy of one into the other.
    ///
    /// ```
    /// use oxcomm::ReduceOp;
    /// let out = oxcomm::threads::run(3, |comm| {
    ///     let input = vec![comm.rank() as i32 + 1; 2];
    ///     let mut output = vec![0; 2];
    ///     comm.reduce_into(&input, (comm.rank() == 0).then_some(&mut output[..]), 0, ReduceOp::Sum)?;
    ///     Ok::<_, oxcomm::Error>(output)
    /// })
    /// .unwrap();
    /// assert_eq!(out[0].as_ref().unwrap(), &[6, 6]);
    /// ```
    #[track_caller]
    pub fn reduce_into<T: Element>(
        &self,
        input: &[T],
        output: Option<&mut [T]>,
        root: usize,
        op: ReduceOp,
    ) -> Result<()> {
        self.reduce_into_with(input, output, root, op, &OpOptions::default())
    }

    /// [`Communicator::reduce_into`] with per-op options.
    #[track_caller]
    pub fn reduce_into_with<T: Element>(
        &self,
        input: &[T],
        output: Option<&mut [T]>,
        root: usize,
        op: ReduceOp,
        opts: &OpOptions,
    ) -> Result<()> {
        let fp = self.reduce_fingerprint::<T>(input.len(), root, op)?;
        let output = self.root_buffer(&fp, root, output, |o| o.len(), input.len(), "output")?;
        self.reduce_buffers(fp, ReduceBuffers::Apart { input, output: output.unwrap_or(&mut []) }, root, op, opts)
    }

    #[track_caller]
    fn reduce_fingerprint<T: Element>(&self, len: usize, root: usize, op: ReduceOp) -> Result<Fingerprint> {
        let mut fp = Self::with_dtype::<T>(self.fingerprint(OpKind::Reduce), len);
        fp.op = Some(op);
        fp.root = Some(root as u32);
        self.check_root(root, &fp)?;
        reduce::check(op, T::DTYPE).map_err(|e| e.with_op(self.describe(&fp)).with_rank(self.core.world_rank))?;
        Ok(fp)
    }

    #[track_caller]
    fn reduce_buffers<T: Element>(
        &self,
        fp: Fingerprint,
        io: ReduceBuffers<'_, T>,
        root: usize,
        op: ReduceOp,
        opts: &OpOptions,
    ) -> Result<()> {
        let len = io.len();
        let route = self.route(&fp, opts, len * std::mem::size_of::<T>(), len)?;
        let (n, at_root) = (self.size(), self.rank() == root);
        self.run_op(fp, opts, route, |b, env| {
            let out = b.reduce(env, route, io, root, op.combiner())?;
            if at_root {
                reduce::finish_avg(out, op, n);
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
        let route = self.route(&fp, opts, std::mem::size_of_val(buf), buf.len())?;
        self.run_op(fp, opts, route, |b, env| b.broadcast(env, route, buf, root))
    }

    /// Gathers every rank's `input` into `output` (size × input.len(), rank order).
    #[track_caller]
    pub fn all_gather<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        self.all_gather_with(input, output, &OpOptions::default())
    }

    /// [`Communicator::all_gather`] with per-op options.
    #[track_caller]
    pub fn all_gather_with<T: Element>(&self, input: &[T], output: &mut [T], opts: &OpOptions) -> Result<()> {
        self.all_gather_buffers(GatherBuffers::Apart { input, output }, opts)
    }

    /// All-gather in place (NCCL's in-place `ncclAllGather`, `sendbuff = recvbuff + rank ×
    /// count`): `buf` holds one block of `buf.len() / size` elements per rank, this rank's
    /// block (`rank × block ..`) holding its contribution on entry; on return every block holds
    /// its rank's contribution.
    ///
    /// The shared-memory direct algorithm and the ring work on `buf` itself, so this costs no
    /// copy that [`Communicator::all_gather`] does not; the hierarchical algorithm copies this
    /// rank's block out first. Ranks may mix this and `all_gather` in one op. On error `buf`
    /// holds garbage. A length that is not a multiple of the group size is
    /// [`crate::ErrorKind::InvalidArgument`] before any communication.
    ///
    /// ```
    /// let out = oxcomm::threads::run(3, |comm| {
    ///     let mut buf = vec![0i32; 2 * comm.size()];
    ///     let me = comm.rank();
    ///     buf[2 * me..2 * me + 2].fill(me as i32 + 1);
    ///     comm.all_gather_in_place(&mut buf)?;
    ///     Ok::<_, oxcomm::Error>(buf)
    /// })
    /// .unwrap();
    /// assert_eq!(out[0].as_ref().unwrap(), &[1, 1, 2, 2, 3, 3]);
    /// ```
    #[track_caller]
    pub fn all_gather_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        self.all_gather_in_place_with(buf, &OpOptions::default())
    }

    /// [`Communicator::all_gather_in_place`] with per-op options.
    #[track_caller]
    pub fn all_gather_in_place_with<T: Element>(&self, buf: &mut [T], opts: &OpOptions) -> Result<()> {
        self.all_gather_buffers(GatherBuffers::InPlace(buf), opts)
    }

    #[track_caller]
    fn all_gather_buffers<T: Element>(&self, io: GatherBuffers<'_, T>, opts: &OpOptions) -> Result<()> {
        let n = self.size();
        let block = io.block_len(n);
        let fp = Self::with_dtype::<T>(self.fingerprint(OpKind::AllGather), block);
        let bad = match &io {
            GatherBuffers::Apart { input, output } => (output.len() != input.len() * n).then(|| {
                format!("output has {} elements, expected size × input = {n} × {}", output.len(), input.len())
            }),
            GatherBuffers::InPlace(buf) => (buf.len() % n != 0)
                .then(|| format!("buffer has {} elements, not a multiple of the group size {n}", buf.len())),
        };
        if let Some(msg) = bad {
            return Err(self.arg_error(&fp, msg));
        }
        let route = self.route(&fp, opts, block * std::mem::size_of::<T>(), block)?;
        self.run_op(fp, opts, route, |b, env| b.all_gather(env, route, io))
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
        self.reduce_scatter_buffers(ScatterBuffers::Apart { input, output }, op, opts)
    }

    /// Reduce-scatter in place (NCCL's in-place `ncclReduceScatter`, `recvbuff = sendbuff +
    /// rank × recvcount`): `buf` is this rank's input, one block of `buf.len() / size` elements
    /// per rank; on return this rank's block (`rank × block ..`) holds the reduction of every
    /// rank's block `rank`. The other blocks hold unspecified values afterwards.
    ///
    /// The shared-memory direct algorithm and the ring work on `buf` itself, so this costs no
    /// copy that [`Communicator::reduce_scatter`] does not (the ring leaves partial results in
    /// the other blocks; direct leaves them as they were); the hierarchical algorithm reduces
    /// into a scratch block and copies it in. Ranks may mix this and `reduce_scatter` in one
    /// op. On error `buf` holds garbage. A length that is not a multiple of the group size is
    /// [`crate::ErrorKind::InvalidArgument`] before any communication.
    ///
    /// ```
    /// use oxcomm::ReduceOp;
    /// let out = oxcomm::threads::run(2, |comm| {
    ///     let mut buf = vec![comm.rank() as f32 + 1.0; 4];
    ///     comm.reduce_scatter_in_place(&mut buf, ReduceOp::Sum)?;
    ///     let me = comm.rank();
    ///     Ok::<_, oxcomm::Error>(buf[2 * me..2 * me + 2].to_vec())
    /// })
    /// .unwrap();
    /// assert_eq!(out[1].as_ref().unwrap(), &[3.0, 3.0]);
    /// ```
    #[track_caller]
    pub fn reduce_scatter_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.reduce_scatter_in_place_with(buf, op, &OpOptions::default())
    }

    /// [`Communicator::reduce_scatter_in_place`] with per-op options.
    #[track_caller]
    pub fn reduce_scatter_in_place_with<T: Element>(
        &self,
        buf: &mut [T],
        op: ReduceOp,
        opts: &OpOptions,
    ) -> Result<()> {
        self.reduce_scatter_buffers(ScatterBuffers::InPlace(buf), op, opts)
    }

    #[track_caller]
    fn reduce_scatter_buffers<T: Element>(
        &self,
        io: ScatterBuffers<'_, T>,
        op: ReduceOp,
        opts: &OpOptions,
    ) -> Result<()> {
        let n = self.size();
        let total = io.input_len();
        let mut fp = Self::with_dtype::<T>(self.fingerprint(OpKind::ReduceScatter), total);
        fp.op = Some(op);
        reduce::check(op, T::DTYPE).map_err(|e| e.with_op(self.describe(&fp)).with_rank(self.core.world_rank))?;
        let bad = match &io {
            ScatterBuffers::Apart { input, output } => (input.len() != output.len() * n).then(|| {
                format!(
                    "input has {} elements, expected size × output = {n} × {} (the input length must be a multiple of the group size)",
                    input.len(),
                    output.len()
                )
            }),
            ScatterBuffers::InPlace(buf) => (buf.len() % n != 0).then(|| {
                format!("buffer has {} elements, not a multiple of the group size {n}", buf.len())
            }),
        };
        if let Some(msg) = bad {
            return Err(self.arg_error(&fp, msg));
        }
        let route = self.route(&fp, opts, total * std::mem::size_of::<T>(), total)?;
        self.run_op(fp, opts, route, |b, env| {
            let out = b.reduce_scatter(env, route, io, op.combiner())?;
            reduce::finish_avg(out, op, n);
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
        let n = self.size();
        if send.len() != recv.len() {
            let fp = Self::with_dtype::<T>(self.fingerprint(OpKind::AllToAll), send.len());
            return Err(self.arg_error(
                &fp,
                format!(
                    "send ({}) and recv ({}) must have the same length, a multiple of the group size {n}",
                    send.len(),
                    recv.len()
                ),
            ));
        }
        self.all_to_all_buffers(ExchangeBuffers::Apart { send, recv }, opts)
    }

    /// All-to-all in place (MPI's `MPI_IN_PLACE`): block p of `buf` goes to rank p and is
    /// replaced by rank p's block for this rank. The length must be a multiple of the group
    /// size.
    ///
    /// The shared-memory direct algorithm works on `buf` itself (each piece of a block leaves
    /// before the peer's piece lands there), so this costs no copy that
    /// [`Communicator::all_to_all`] does not; the pairwise exchange (other transports) copies
    /// `buf` first. Ranks may mix this and `all_to_all` in one op. On error `buf` holds
    /// garbage.
    ///
    /// ```
    /// let out = oxcomm::threads::run(2, |comm| {
    ///     let me = comm.rank() as i32;
    ///     let mut buf = vec![10 * me, 10 * me + 1];
    ///     comm.all_to_all_in_place(&mut buf)?;
    ///     Ok::<_, oxcomm::Error>(buf)
    /// })
    /// .unwrap();
    /// assert_eq!(out[0].as_ref().unwrap(), &[0, 10]);
    /// assert_eq!(out[1].as_ref().unwrap(), &[1, 11]);
    /// ```
    #[track_caller]
    pub fn all_to_all_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        self.all_to_all_in_place_with(buf, &OpOptions::default())
    }

    /// [`Communicator::all_to_all_in_place`] with per-op options.
    #[track_caller]
    pub fn all_to_all_in_place_with<T: Element>(&self, buf: &mut [T], opts: &OpOptions) -> Result<()> {
        self.all_to_all_buffers(ExchangeBuffers::InPlace(buf), opts)
    }

    #[track_caller]
    fn all_to_all_buffers<T: Element>(&self, io: ExchangeBuffers<'_, T>, opts: &OpOptions) -> Result<()> {
        let total = io.send_len();
        let fp = Self::with_dtype::<T>(self.fingerprint(OpKind::AllToAll), total);
        let n = self.size();
        if total % n != 0 {
            return Err(self.arg_error(&fp, format!("{total} elements are not a multiple of the group size {n}")));
        }
        let route = self.route(&fp, opts, total * std::mem::size_of::<T>(), total)?;
        self.run_op(fp, opts, route, |b, env| b.all_to_all(env, route, io))
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
        self.all_to_all_v_with(send, send_counts, recv, recv_counts, &OpOptions::default())
    }

    /// [`Communicator::all_to_all_v`] with per-op options.
    #[track_caller]
    pub fn all_to_all_v_with<T: Element>(
        &self,
        send: &[T],
        send_counts: &[usize],
        recv: &mut [T],
        recv_counts: &[usize],
        opts: &OpOptions,
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
        let me = self.rank();
        if send_counts[me] != recv_counts[me] {
            return Err(self.arg_error(
                &fp,
                format!(
                    "send_counts[{me}] = {} but recv_counts[{me}] = {} (this rank's own block)",
                    send_counts[me], recv_counts[me]
                ),
            ));
        }
        let route = self.route(&fp, opts, std::mem::size_of_val(send), send.len())?;
        self.run_op(fp, opts, route, |b, env| b.all_to_all_v(env, route, send, send_counts, recv, recv_counts))
    }

    /// Gathers every rank's `input` into `output` on `root` (size × input.len()); other
    /// ranks pass `None`.
    #[track_caller]
    pub fn gather<T: Element>(&self, input: &[T], output: Option<&mut [T]>, root: usize) -> Result<()> {
        self.gather_with(input, output, root, &OpOptions::default())
    }

    /// [`Communicator::gather`] with per-op options.
    #[track_caller]
    pub fn gather_with<T: Element>(
        &self,
        input: &[T],
        output: Option<&mut [T]>,
        root: usize,
        opts: &OpOptions,
    ) -> Result<()> {
        let mut fp = Self::with_dtype::<T>(self.fingerprint(OpKind::Gather), input.len());
        fp.root = Some(root as u32);
        self.check_root(root, &fp)?;
        let want = input.len() * self.size();
        let output = self.root_buffer(&fp, root, output, |o| o.len(), want, "output")?;
        let io = GatherBuffers::Apart { input, output: output.unwrap_or(&mut []) };
        self.gather_buffers(fp, io, root, opts)
    }

    /// Gather in place (MPI's `MPI_IN_PLACE` at the root): at `root`, `buf` holds one block of
    /// `buf.len() / size` elements per rank, its own block (`root × block ..`) holding its
    /// contribution on entry, and receives every rank's block; elsewhere `buf` is the rank's
    /// contribution and is only read. No copy of the root's block is made; a root length that
    /// is not a multiple of the group size is [`crate::ErrorKind::InvalidArgument`].
    ///
    /// ```
    /// let out = oxcomm::threads::run(3, |comm| {
    ///     let me = comm.rank() as i32;
    ///     let mut buf = if me == 1 { vec![0, 0, 7, 7, 0, 0] } else { vec![me; 2] };
    ///     comm.gather_in_place(&mut buf, 1)?;
    ///     Ok::<_, oxcomm::Error>(buf)
    /// })
    /// .unwrap();
    /// assert_eq!(out[1].as_ref().unwrap(), &[0, 0, 7, 7, 2, 2]);
    /// ```
    #[track_caller]
    pub fn gather_in_place<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.gather_in_place_with(buf, root, &OpOptions::default())
    }

    /// [`Communicator::gather_in_place`] with per-op options.
    #[track_caller]
    pub fn gather_in_place_with<T: Element>(&self, buf: &mut [T], root: usize, opts: &OpOptions) -> Result<()> {
        let fp = self.rooted_in_place_fingerprint::<T>(OpKind::Gather, buf.len(), root)?;
        let io = if self.rank() == root {
            GatherBuffers::InPlace(buf)
        } else {
            GatherBuffers::Apart { input: buf, output: &mut [] }
        };
        self.gather_buffers(fp, io, root, opts)
    }

    /// The fingerprint of a rooted op in place on a buffer of `len` elements (at `root`, every
    /// rank's block; elsewhere this rank's), once the root and the root's length are checked.
    #[track_caller]
    fn rooted_in_place_fingerprint<T: Element>(&self, kind: OpKind, len: usize, root: usize) -> Result<Fingerprint> {
        let (n, at_root) = (self.size(), self.rank() == root);
        let block = if at_root { len / n } else { len };
        let mut fp = Self::with_dtype::<T>(self.fingerprint(kind), block);
        fp.root = Some(root as u32);
        self.check_root(root, &fp)?;
        if at_root && len % n != 0 {
            return Err(self.arg_error(&fp, format!("buffer has {len} elements, not a multiple of the group size {n}")));
        }
        Ok(fp)
    }

    #[track_caller]
    fn gather_buffers<T: Element>(
        &self,
        fp: Fingerprint,
        io: GatherBuffers<'_, T>,
        root: usize,
        opts: &OpOptions,
    ) -> Result<()> {
        let block = io.block_len(self.size());
        let route = self.route(&fp, opts, block * std::mem::size_of::<T>(), block)?;
        self.run_op(fp, opts, route, |b, env| b.gather(env, route, io, root))
    }

    /// Scatters block p of `root`'s `input` (size × output.len()) to rank p's `output`; other
    /// ranks pass `None`.
    #[track_caller]
    pub fn scatter<T: Element>(&self, input: Option<&[T]>, output: &mut [T], root: usize) -> Result<()> {
        self.scatter_with(input, output, root, &OpOptions::default())
    }

    /// [`Communicator::scatter`] with per-op options.
    #[track_caller]
    pub fn scatter_with<T: Element>(
        &self,
        input: Option<&[T]>,
        output: &mut [T],
        root: usize,
        opts: &OpOptions,
    ) -> Result<()> {
        let mut fp = Self::with_dtype::<T>(self.fingerprint(OpKind::Scatter), output.len());
        fp.root = Some(root as u32);
        self.check_root(root, &fp)?;
        let want = output.len() * self.size();
        let input = self.root_buffer(&fp, root, input, |i| i.len(), want, "input")?;
        let io = ScatterBuffers::Apart { input: input.unwrap_or(&[]), output };
        self.scatter_buffers(fp, io, root, opts)
    }

    /// Scatter in place (MPI's `MPI_IN_PLACE` at the root): at `root`, `buf` holds one block
    /// of `buf.len() / size` elements per rank, block p going to rank p, and the root's own
    /// block stays where it is (nothing is written to `buf` there); elsewhere `buf` receives
    /// the rank's block. A root length that is not a multiple of the group size is
    /// [`crate::ErrorKind::InvalidArgument`].
    ///
    /// ```
    /// let out = oxcomm::threads::run(2, |comm| {
    ///     let mut buf = if comm.rank() == 0 { vec![1, 2, 3, 4] } else { vec![0; 2] };
    ///     comm.scatter_in_place(&mut buf, 0)?;
    ///     Ok::<_, oxcomm::Error>(buf)
    /// })
    /// .unwrap();
    /// assert_eq!(out[1].as_ref().unwrap(), &[3, 4]);
    /// ```
    #[track_caller]
    pub fn scatter_in_place<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.scatter_in_place_with(buf, root, &OpOptions::default())
    }

    /// [`Communicator::scatter_in_place`] with per-op options.
    #[track_caller]
    pub fn scatter_in_place_with<T: Element>(&self, buf: &mut [T], root: usize, opts: &OpOptions) -> Result<()> {
        let fp = self.rooted_in_place_fingerprint::<T>(OpKind::Scatter, buf.len(), root)?;
        let io = if self.rank() == root {
            ScatterBuffers::InPlace(buf)
        } else {
            ScatterBuffers::Apart { input: &[], output: buf }
        };
        self.scatter_buffers(fp, io, root, opts)
    }

    #[track_caller]
    fn scatter_buffers<T: Element>(
        &self,
        fp: Fingerprint,
        io: ScatterBuffers<'_, T>,
        root: usize,
        opts: &OpOptions,
    ) -> Result<()> {
        let block = io.block_len(self.size());
        let route = self.route(&fp, opts, block * std::mem::size_of::<T>(), block)?;
        self.run_op(fp, opts, route, |b, env| b.scatter(env, route, io, root))
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
        let route = self.route(&fp, opts, 0, 0)?;
        self.run_op(fp, opts, route, |b, env| b.barrier(env, route))
    }

    /// A barrier that waits at most `timeout` and, on failure, names every rank that did not
    /// arrive (rank 0 collects the arrivals).
    #[track_caller]
    pub fn monitored_barrier(&self, timeout: Duration) -> Result<()> {
        let fp = self.fingerprint(OpKind::MonitoredBarrier);
        let opts = OpOptions { timeout: Some(timeout), ..OpOptions::default() };
        let route = self.route(&fp, &opts, 0, 0)?;
        self.run_op(fp, &opts, route, |b, env| b.monitored_barrier(env, route, timeout))
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
        let route = self.route(&fp, &opts, total * T::DTYPE.size(), total)?;
        let n = self.size();
        self.run_op(fp, &opts, route, |b, env| {
            b.all_reduce_coalesced(env, route, bufs, op.combiner())?;
            bufs.iter_mut().for_each(|buf| reduce::finish_avg(buf, op, n));
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
        let opts = OpOptions::default();
        let route = self.route(&fp, &opts, total * T::DTYPE.size(), total)?;
        self.run_op(fp, &opts, route, |b, env| b.all_gather_coalesced(env, route, inputs, outputs))
    }
}
