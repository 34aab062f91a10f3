"""The ops: each c10d call's body, its arguments (normalised by :mod:`.forms`) laid out for
the communicator (:mod:`.layout`) and issued (:mod:`.issue`).

This module owns what each call computes: which oxcomm op (or ops, one per dtype) it runs, on
which buffers, and what the call's Work holds. It does not order ops or complete them.

What torch can ask for and oxcomm cannot do raises ``NotImplementedError`` naming the call:
``PREMUL_SUM`` on the coalesced calls, sparse all-reduce other than SUM on the host,
all-gather/gather/scatter lists whose tensors differ in shape, and multi-tensor (multi-device)
variants of the single-tensor collectives.

Coalesced calls are one oxcomm op per dtype, not loops: ``allreduce_coalesced`` and
``allgather_coalesced``/``allgather_into_tensor_coalesced`` run the communicator's coalesced
all-reduce and all-gather, ``reduce_scatter_tensor_coalesced`` one reduce-scatter of the inputs
packed rank block by rank block.
"""

from __future__ import annotations

import math
import re
from datetime import timedelta

import torch
import torch.distributed as dist

import oxcomm
from oxcomm._buffers import DTYPE_CODES as _DTYPE_CODES
from oxcomm._buffers import TORCH_CLASSES as _HOST_CLASSES
from oxcomm._cuda import device as _dev

from .forms import _FAST_OPS, _on_device, _premul_factor, _reduce_op, _same_shape, _scaled, _single, _timeout
from .issue import _DONE, _Issuer, _last
from .layout import _adjacent_base, _by_dtype, _contiguous_out, _flat
from .work import _done

_c10d = torch._C._distributed_c10d
_STRIDED = torch.strided


def _late_ranks(message):
    """The ranks a monitored barrier's timeout names ("rank(s) 1, 3 did not join"), or []."""
    found = re.search(r"rank\(s\) ([0-9, ]+) did not join", message)
    return [int(r) for r in found.group(1).replace(" ", "").split(",") if r] if found else []


class _Calls(_Issuer):
    """torch's c10d calls on an oxcomm communicator; :mod:`.process_group`'s two classes add
    what a ``ProcessGroup`` and a ``Backend`` each need around them."""

    # ------------------------------------------------------------------ reductions

    def allreduce(self, tensors, opts=None):
        # The blocking one-tensor call a training step makes most: straight to the native
        # communicator, each check made once and inline (each 0.1 µs here is 0.1 µs of every
        # small all-reduce; docs/perf_torch_path.md). The tensor passes only if it is of a
        # class and dtype that _buffers.buffer() accepted before, on the host, strided and
        # contiguous; the op only if torch's ReduceOp hashes to a plain one (not PREMUL_SUM).
        # Anything else takes the general path below, whose checks name the problem. It
        # bypasses the communicator's lane, so it is taken only when nothing is queued there.
        if opts is not None and len(tensors) == 1 and not opts.asyncOp and self._idle():
            t = tensors[0]
            if t.__class__ in _HOST_CLASSES and (not _dev.OVERRIDDEN or not _dev.owns(t)):
                dtype = _DTYPE_CODES.get(t.dtype)
                if dtype is not None and t.is_cpu and t.layout is _STRIDED and t.is_contiguous():
                    op = _FAST_OPS.get(hash(opts.reduceOp))
                    if op is not None:
                        self._native.all_reduce_at(t.data_ptr(), t.numel(), dtype, op)
                        return _DONE
        opts = opts or dist.AllreduceOptions()
        if len(tensors) == 1 and tensors[0].layout == torch.sparse_coo:
            return self.allreduce_sparse(tensors, opts)
        factor = _premul_factor(opts.reduceOp)
        op = oxcomm.ReduceOp.SUM if factor is not None else _reduce_op(opts.reduceOp, "all_reduce")
        dev = _on_device("all_reduce", *tensors)
        if len(tensors) != 1:
            return self.allreduce_coalesced(tensors, opts)
        if factor is not None:
            _scaled(tensors[0], factor, True)
        buf, finish = _contiguous_out(tensors[0], None)
        start = lambda a: self.comm.all_reduce(buf, op, async_op=a)  # noqa: E731
        return self._run("all_reduce", opts, start, tensors, finish, device=dev)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts or dist.AllreduceCoalescedOptions()
        factor = _premul_factor(opts.reduceOp)
        op = oxcomm.ReduceOp.SUM if factor is not None else _reduce_op(opts.reduceOp, "all_reduce_coalesced")
        dev = _on_device("all_reduce_coalesced", *tensors)
        for t in tensors if factor is not None else ():
            _scaled(t, factor, True)
        finish = None
        bufs = []
        for t in tensors:
            b, finish = _contiguous_out(t, finish)
            bufs.append(b)
        groups = _by_dtype(bufs)

        def start(a):
            works = [self.comm.all_reduce_coalesced([bufs[k] for k in idx], op, async_op=a) for idx in groups]
            return _last(works, a)

        return self._run("all_reduce_coalesced", opts, start, tensors, finish, device=dev)

    def allreduce_sparse(self, tensors, opts=None):
        """All-reduce (SUM) of a sparse COO tensor on the host, as gloo's: every rank's
        coalesced indices and values are all-gathered (padded to the largest count) and summed
        into one coalesced tensor, which replaces the input's contents. Runs blocking, after
        the group's ops in flight; O(total nonzeros) bytes per rank."""
        opts = opts or dist.AllreduceOptions()
        t = _single(tensors, "all_reduce (sparse)")
        if t.layout != torch.sparse_coo:
            raise ValueError(f"oxcomm: all_reduce (sparse): a {t.layout} tensor is not sparse COO")
        if not t.is_cpu:
            raise NotImplementedError("oxcomm: all_reduce of sparse tensors on a device is not supported")
        if _premul_factor(opts.reduceOp) is not None or _reduce_op(opts.reduceOp, "all_reduce") != oxcomm.ReduceOp.SUM:
            raise NotImplementedError("oxcomm: all_reduce of sparse tensors supports SUM only (as gloo)")
        self._drain()
        c = t.coalesce()
        idx, val = c.indices().contiguous(), c.values().contiguous()
        n, nnz = self.comm.size, idx.shape[1]
        counts = torch.zeros(n, dtype=torch.int64)
        self.comm.all_gather(torch.tensor([nnz], dtype=torch.int64), counts)
        top = int(counts.max())
        pad_idx = torch.zeros((idx.shape[0], top), dtype=torch.int64)
        pad_idx[:, :nnz] = idx
        pad_val = torch.zeros((top, *val.shape[1:]), dtype=val.dtype)
        pad_val[:nnz] = val
        all_idx = torch.empty((n, *pad_idx.shape), dtype=torch.int64)
        all_val = torch.empty((n, *pad_val.shape), dtype=val.dtype)
        self.comm.all_gather(pad_idx.reshape(-1), all_idx.reshape(-1))
        self.comm.all_gather(pad_val.reshape(-1), all_val.reshape(-1))
        keep = [int(k) for k in counts]
        indices = torch.cat([all_idx[r][:, : keep[r]] for r in range(n)], dim=1)
        values = torch.cat([all_val[r][: keep[r]] for r in range(n)], dim=0)
        total = torch.sparse_coo_tensor(indices, values, t.shape, dtype=t.dtype).coalesce()
        t.copy_(total)
        return _done([t])

    def reduce(self, tensors, opts=None):
        opts = opts or dist.ReduceOptions()
        factor = _premul_factor(opts.reduceOp)
        op = oxcomm.ReduceOp.SUM if factor is not None else _reduce_op(opts.reduceOp, "reduce")
        t = _single(tensors, "reduce")
        dev = _on_device("reduce", t)
        root = opts.rootRank
        if factor is not None and self.rank() != root:
            # Other ranks' tensors stay as they were: they send a scaled copy.
            buf, finish = _scaled(t, factor, False).contiguous(), None
        else:
            if factor is not None:
                _scaled(t, factor, True)
            buf, finish = _contiguous_out(t, None)
        start = lambda a: self.comm.reduce(buf, root, op, async_op=a)  # noqa: E731
        return self._run("reduce", opts, start, tensors, finish, device=dev)

    def broadcast(self, tensors, opts=None):
        opts = opts or dist.BroadcastOptions()
        t = _single(tensors, "broadcast")
        dev = _on_device("broadcast", t)
        buf, finish = _contiguous_out(t, None)
        root = opts.rootRank
        start = lambda a: self.comm.broadcast(buf, root, async_op=a)  # noqa: E731
        return self._run("broadcast", opts, start, tensors, finish, device=dev)

    # ------------------------------------------------------------------ gathers

    def allgather(self, output_tensors, input_tensors, opts=None):
        opts = opts or _c10d.AllgatherOptions()
        inp = _single(input_tensors, "all_gather").contiguous()
        outs = _single(output_tensors, "all_gather")
        dev = _on_device("all_gather", inp, *outs)
        if len(outs) != self.size():
            raise ValueError(f"oxcomm: all_gather: {len(outs)} output tensors for a group of {self.size()}")
        _same_shape(outs, "all_gather")
        flat = _adjacent_base(outs)
        finish = None
        if flat is None:
            flat = inp.new_empty((inp.numel() * len(outs),))

            def finish():
                for k, o in enumerate(outs):
                    o.copy_(flat[k * inp.numel() : (k + 1) * inp.numel()].view(o.shape))

        src = _flat(inp)
        start = lambda a: self.comm.all_gather(src, flat, async_op=a)  # noqa: E731
        return self._run("all_gather", opts, start, output_tensors, finish, device=dev)

    def all_gather_single(self, output, input, opts=None):
        opts = opts or _c10d.AllgatherOptions()
        dev = _on_device("all_gather_into_tensor", output, input)
        src = _flat(input.contiguous())
        out, finish = _contiguous_out(output, None)
        dst = _flat(out)
        start = lambda a: self.comm.all_gather(src, dst, async_op=a)  # noqa: E731
        return self._run("all_gather_into_tensor", opts, start, [output], finish, device=dev)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        """``all_gather_into_tensor`` of each input into the matching output, as one
        ``all_gather_coalesced`` per dtype."""
        opts = opts or _c10d.AllgatherOptions()
        call = "all_gather_into_tensor_coalesced"
        if len(outputs) != len(inputs):
            raise ValueError(f"oxcomm: {call}: {len(outputs)} outputs for {len(inputs)} inputs")
        dev = _on_device(call, *outputs, *inputs)
        ins, outs, finish = [], [], None
        for o, i in zip(outputs, inputs):
            if o.numel() != i.numel() * self.size():
                raise ValueError(
                    f"oxcomm: {call}: an output of {o.numel()} elements for an input of {i.numel()} "
                    f"in a group of {self.size()}"
                )
            buf, finish = _contiguous_out(o, finish)
            ins.append(_flat(i.contiguous()))
            outs.append(_flat(buf))
        return self._gather_coalesced(call, opts, ins, outs, list(outputs), finish, dev)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        """``all_gather_coalesced``: ``output_lists[r][j]`` gets rank r's ``inputs[j]``; one
        ``all_gather_coalesced`` per dtype, into each tensor's outputs in place when they lie
        back to back in one storage, else into scratch copied out."""
        opts = opts or _c10d.AllgatherOptions()
        call = "all_gather_coalesced"
        n = self.size()
        if len(output_lists) != n or any(len(o) != len(inputs) for o in output_lists):
            raise ValueError(
                f"oxcomm: {call}: outputs must be {n} lists (one per rank) of {len(inputs)} tensors, got "
                f"{[len(o) for o in output_lists]}"
            )
        dev = _on_device(call, *inputs, *(t for o in output_lists for t in o))
        ins, outs, copies = [], [], []
        for j, i in enumerate(inputs):
            per_rank = [output_lists[r][j] for r in range(n)]
            if any(t.numel() != i.numel() or t.dtype != i.dtype for t in per_rank):
                raise NotImplementedError(f"oxcomm: {call}: outputs[r][{j}] differ from inputs[{j}] in size or dtype")
            flat = _adjacent_base(per_rank)
            if flat is None:
                flat = i.new_empty((i.numel() * n,))
                copies.append((flat, per_rank))
            ins.append(_flat(i.contiguous()))
            outs.append(flat)
        finish = None
        if copies:

            def finish():
                for flat, per_rank in copies:
                    for k, o in enumerate(flat.chunk(n) if flat.numel() else [flat] * n):
                        per_rank[k].copy_(o.view(per_rank[k].shape))

        return self._gather_coalesced(call, opts, ins, outs, list(output_lists), finish, dev)

    def _gather_coalesced(self, call, opts, ins, outs, result, finish, dev):
        """One native ``all_gather_coalesced`` per dtype among ``ins`` (flat inputs) into
        ``outs`` (flat outputs, size × input each)."""
        groups = _by_dtype(ins)

        def start(a):
            works = [
                self.comm.all_gather_coalesced([ins[k] for k in idx], [outs[k] for k in idx], async_op=a)
                for idx in groups
            ]
            return _last(works, a)

        return self._run(call, opts, start, result, finish, device=dev)

    def gather(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.GatherOptions()
        inp = _single(input_tensors, "gather").contiguous()
        root = opts.rootRank
        finish = None
        flat = None
        dev = _on_device("gather", inp)
        if self.rank() == root:
            outs = _single(output_tensors, "gather")
            dev = _on_device("gather", inp, *outs)
            if len(outs) != self.size():
                raise ValueError(f"oxcomm: gather: {len(outs)} output tensors for a group of {self.size()}")
            _same_shape(outs, "gather")
            flat = _adjacent_base(outs)
            if flat is None:
                flat = inp.new_empty((inp.numel() * len(outs),))

                def finish():
                    for k, o in enumerate(outs):
                        o.copy_(flat[k * inp.numel() : (k + 1) * inp.numel()].view(o.shape))

        src = _flat(inp)
        return self._run(
            "gather", opts, lambda a: self.comm.gather(src, flat, root, async_op=a), output_tensors, finish, device=dev
        )

    def scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ScatterOptions()
        out = _single(output_tensors, "scatter")
        root = opts.rootRank
        flat = None
        dev = _on_device("scatter", out)
        if self.rank() == root:
            ins = _single(input_tensors, "scatter")
            dev = _on_device("scatter", out, *ins)
            if len(ins) != self.size():
                raise ValueError(f"oxcomm: scatter: {len(ins)} input tensors for a group of {self.size()}")
            _same_shape(ins, "scatter")
            flat = _adjacent_base(ins)
            if flat is None:
                flat = torch.cat([_flat(t.contiguous()) for t in ins])
        buf, finish = _contiguous_out(out, None)
        dst = _flat(buf)
        start = lambda a: self.comm.scatter(flat, dst, root, async_op=a)  # noqa: E731
        return self._run("scatter", opts, start, output_tensors, finish, device=dev)

    # ------------------------------------------------------------------ reduce-scatter

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        factor = _premul_factor(opts.reduceOp)
        op = oxcomm.ReduceOp.SUM if factor is not None else _reduce_op(opts.reduceOp, "reduce_scatter")
        out = _single(output_tensors, "reduce_scatter")
        ins = _single(input_tensors, "reduce_scatter")
        dev = _on_device("reduce_scatter", out, *ins)
        if len(ins) != self.size():
            raise ValueError(f"oxcomm: reduce_scatter: {len(ins)} input tensors for a group of {self.size()}")
        _same_shape(ins, "reduce_scatter")
        flat = _adjacent_base(ins)
        if flat is None:
            flat = torch.cat([_flat(t.contiguous()) for t in ins])
        if factor is not None:
            flat = _scaled(flat, factor, False)
        buf, finish = _contiguous_out(out, None)
        dst = _flat(buf)
        return self._run(
            "reduce_scatter",
            opts,
            lambda a: self.comm.reduce_scatter(flat, dst, op, async_op=a),
            output_tensors,
            finish,
            device=dev,
        )

    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        factor = _premul_factor(opts.reduceOp)
        op = oxcomm.ReduceOp.SUM if factor is not None else _reduce_op(opts.reduceOp, "reduce_scatter_tensor")
        dev = _on_device("reduce_scatter_tensor", output, input)
        src = _flat(input.contiguous())
        if factor is not None:
            src = _scaled(src, factor, False)
        buf, finish = _contiguous_out(output, None)
        dst = _flat(buf)
        return self._run(
            "reduce_scatter_tensor",
            opts,
            lambda a: self.comm.reduce_scatter(src, dst, op, async_op=a),
            [output],
            finish,
            device=dev,
        )

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        """``reduce_scatter_tensor`` of each input into the matching output, as one native
        reduce-scatter per dtype: the inputs are packed rank block by rank block (block r of
        the packed buffer is block r of every input, back to back), so rank r's block of the
        reduction holds its block of every input's reduction, copied out into the outputs.
        (oxcomm has no coalesced reduce-scatter with a reduce op for Python yet; the pack costs
        one copy of the inputs and of the outputs.)"""
        opts = opts or dist.ReduceScatterOptions()
        call = "reduce_scatter_tensor_coalesced"
        op = _reduce_op(opts.reduceOp, call)
        n = self.size()
        if len(outputs) != len(inputs):
            raise ValueError(f"oxcomm: {call}: {len(outputs)} outputs for {len(inputs)} inputs")
        dev = _on_device(call, *outputs, *inputs)
        for o, i in zip(outputs, inputs):
            if i.numel() != o.numel() * n:
                raise ValueError(
                    f"oxcomm: {call}: an input of {i.numel()} elements for an output of {o.numel()} "
                    f"in a group of {n}"
                )
        packs = []
        for idx in _by_dtype(inputs):
            src = torch.cat([inputs[k].contiguous().view(n, -1) for k in idx], dim=1).view(-1)
            packs.append((idx, src, src.new_empty((src.numel() // n,))))

        def start(a):
            works = [self.comm.reduce_scatter(src, dst, op, async_op=a) for _, src, dst in packs]
            return _last(works, a)

        def finish():
            for idx, _, dst in packs:
                at = 0
                for k in idx:
                    m = outputs[k].numel()
                    outputs[k].copy_(dst[at : at + m].view(outputs[k].shape))
                    at += m

        return self._run(call, opts, start, list(outputs), finish, device=dev)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # ------------------------------------------------------------------ all-to-all

    def alltoall(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.AllToAllOptions()
        n = self.size()
        if len(output_tensors) != n or len(input_tensors) != n:
            raise ValueError(
                f"oxcomm: all_to_all: {len(input_tensors)} inputs and {len(output_tensors)} outputs for a group of {n}"
            )
        dev = _on_device("all_to_all", *output_tensors, *input_tensors)
        dtype = input_tensors[0].dtype
        if any(t.dtype != dtype for t in (*input_tensors, *output_tensors)):
            raise NotImplementedError("oxcomm: all_to_all with tensors of different dtypes is not supported")
        send_counts = [t.numel() for t in input_tensors]
        recv_counts = [t.numel() for t in output_tensors]
        send = _adjacent_base(input_tensors) if len(set(send_counts)) == 1 else None
        if send is None:
            send = torch.cat([_flat(t.contiguous()) for t in input_tensors])
        recv = _adjacent_base(output_tensors) if len(set(recv_counts)) == 1 else None
        finish = None
        if recv is None:
            recv = output_tensors[0].new_empty((sum(recv_counts),))

            def finish():
                at = 0
                for o, c in zip(output_tensors, recv_counts):
                    o.copy_(recv[at : at + c].view(o.shape))
                    at += c

        if len(set(send_counts)) == 1 and len(set(recv_counts)) == 1:
            start = lambda a: self.comm.all_to_all(send, recv, async_op=a)  # noqa: E731
        else:
            start = lambda a: self.comm.all_to_all_v(send, send_counts, recv, recv_counts, async_op=a)  # noqa: E731
        return self._run("all_to_all", opts, start, output_tensors, finish, device=dev)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        opts = opts or dist.AllToAllOptions()
        dev = _on_device("all_to_all_single", output, input)
        src = _flat(input.contiguous())
        buf, finish = _contiguous_out(output, None)
        dst = _flat(buf)
        if not output_split_sizes and not input_split_sizes:
            start = lambda a: self.comm.all_to_all(src, dst, async_op=a)  # noqa: E731
        else:
            n = self.size()
            in_row = math.prod(input.shape[1:]) if input.dim() > 1 else 1
            out_row = math.prod(output.shape[1:]) if output.dim() > 1 else 1
            send_counts = (
                [int(s) * in_row for s in input_split_sizes] if input_split_sizes else [input.numel() // n] * n
            )
            recv_counts = (
                [int(s) * out_row for s in output_split_sizes] if output_split_sizes else [output.numel() // n] * n
            )
            if len(send_counts) != n or len(recv_counts) != n:
                raise ValueError(f"oxcomm: all_to_all_single: split sizes must have {n} entries")
            start = lambda a: self.comm.all_to_all_v(src, send_counts, dst, recv_counts, async_op=a)  # noqa: E731
        return self._run("all_to_all_single", opts, start, [output], finish, device=dev)

    alltoall_base = all_to_all_single

    # ------------------------------------------------------------------ barriers and p2p

    def barrier(self, opts=None):
        opts = opts or dist.BarrierOptions()
        return self._run("barrier", opts, lambda a: self.comm.barrier(async_op=a), [])

    def monitored_barrier(self, opts=None, wait_all_ranks=False):
        timeout = _timeout(opts) if opts is not None and not isinstance(opts, timedelta) else None
        if isinstance(opts, timedelta):
            timeout = opts.total_seconds()
        self._drain()
        seconds = timeout if timeout is not None else 1800.0
        if seconds <= 0:
            # gloo's words (torch's tests and users match them), oxcomm's error type
            raise oxcomm.TimeoutError(
                f"Rank {self.rank()} timed out in monitoredBarrier after 0 ms (oxcomm: the timeout was 0)"
            )
        try:
            self.comm.monitored_barrier(seconds)
        except oxcomm.TimeoutError as e:
            late = _late_ranks(str(e))
            if not late:
                raise
            who = f"Ranks {', '.join(map(str, late))}" if wait_all_ranks and len(late) > 1 else f"Rank {late[0]}"
            raise type(e)(f"{who} failed to pass monitoredBarrier in {seconds * 1000:.0f} ms ({e})") from e

    def send(self, tensors, dst, tag=0):
        t = _single(tensors, "send")
        dev = _on_device("send", t)
        buf = t.contiguous()
        return self._p2p("send", lambda: self.comm.isend(buf, dst, tag), tensors, None, dev)

    def recv(self, tensors, src, tag=0):
        t = _single(tensors, "recv")
        dev = _on_device("recv", t)
        buf, finish = _contiguous_out(t, None)
        return self._p2p("recv", lambda: self.comm.irecv(buf, src, tag), tensors, finish, dev)

    def recv_anysource(self, tensors, tag=0):
        """``recv``/``irecv`` without ``src``: the first message with ``tag`` from any rank
        of the group; the Work's ``_source_rank()`` names its sender (torch's ``recv``
        returns it)."""
        t = _single(tensors, "recv")
        dev = _on_device("recv", t)
        buf, finish = _contiguous_out(t, None)
        return self._p2p("recv", lambda: self.comm.irecv(buf, None, tag), tensors, finish, dev, any_source=True)

    recvAnysource = recv_anysource
