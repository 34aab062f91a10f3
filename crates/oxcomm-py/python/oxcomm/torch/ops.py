"""The ops: each c10d call's body, its arguments put in their one normal form by :mod:`.forms`,
laid out for the communicator (:mod:`.layout`) and issued (:mod:`.issue`).

This module owns what each call computes, as gloo computes it, and what its Work's future
holds (gloo's shapes: the list of output tensors, flat for a one-input all-gather or gather).
It does not check arguments (:mod:`.forms`), order ops or complete them (:mod:`.issue`,
:mod:`.work`).

Several tensors per rank take gloo's meaning: an all-reduce of a list reduces across the list
and across ranks and gives every tensor the total; a broadcast sends ``tensors[rootTensor]``
of the root into every tensor of every rank; an all-gather of several inputs fills each output
list with every rank's inputs, rank by rank. A reduce-scatter's blocks may differ in size from
rank to rank (padded to the largest for the one native reduce-scatter).

Coalesced calls are one oxcomm op per dtype, not loops: ``allreduce_coalesced`` and
``allgather_coalesced``/``allgather_into_tensor_coalesced`` run the communicator's coalesced
all-reduce and all-gather, ``reduce_scatter_tensor_coalesced`` one reduce-scatter of the inputs
packed rank block by rank block.

Results are copied into the caller's tensors by a ``finish`` that may run on the group's
waiter thread; under ``torch.inference_mode()`` at the call it runs in inference mode too
(inference tensors may only be written there).
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

from . import forms as _forms
from .forms import _FAST_OPS, _on_device, _premul_factor, _reduce_op, _scaled, _timeout
from .issue import _DONE, _Issuer, _last
from .layout import _adjacent_base, _by_dtype, _contiguous_out, _flat, _overlaps_earlier
from .work import _done

_STRIDED = torch.strided
_AllreduceOptions = dist.AllreduceOptions


def _late_ranks(message):
    """The ranks a monitored barrier's timeout names ("rank(s) 1, 3 did not join"), or []."""
    found = re.search(r"rank\(s\) ([0-9, ]+) did not join", message)
    return [int(r) for r in found.group(1).replace(" ", "").split(",") if r] if found else []


def _as_caller(finish):
    """``finish`` run in inference mode when the call was made in it (the waiter thread is
    not), so that it may write the caller's inference tensors."""
    if finish is None or not torch.is_inference_mode_enabled():
        return finish

    def in_inference_mode():
        with torch.inference_mode():
            finish()

    return in_inference_mode


def _op_and_factor(opts, call):
    """(oxcomm's op, PREMUL_SUM's factor or None) of a call's ``opts.reduceOp``."""
    factor = _premul_factor(opts.reduceOp)
    return (oxcomm.ReduceOp.SUM if factor is not None else _reduce_op(opts.reduceOp, call)), factor


# How a list's tensors combine on this rank before the reduction across ranks (gloo's order:
# tensors[0] with tensors[1], then with tensors[2], ...). AVG sums here and averages across.
_LOCAL = {
    oxcomm.ReduceOp.SUM: torch.Tensor.add_,
    oxcomm.ReduceOp.AVG: torch.Tensor.add_,
    oxcomm.ReduceOp.PROD: torch.Tensor.mul_,
    oxcomm.ReduceOp.MIN: lambda a, b: torch.minimum(a, b, out=a),
    oxcomm.ReduceOp.MAX: lambda a, b: torch.maximum(a, b, out=a),
    oxcomm.ReduceOp.BAND: torch.Tensor.bitwise_and_,
    oxcomm.ReduceOp.BOR: torch.Tensor.bitwise_or_,
    oxcomm.ReduceOp.BXOR: torch.Tensor.bitwise_xor_,
}


def _local_reduce(tensors, op, factor):
    """A new contiguous tensor: ``tensors`` combined with ``op`` (each scaled by ``factor``
    first for PREMUL_SUM)."""
    first = tensors[0] if factor is None else _scaled(tensors[0], factor, False)
    acc = first.contiguous().clone() if factor is None else first.contiguous()
    combine = _LOCAL[op]
    for t in tensors[1:]:
        combine(acc, t if factor is None else _scaled(t, factor, False))
    return acc


class _Calls(_Issuer):
    """torch's c10d calls on an oxcomm communicator; :mod:`.process_group`'s two classes add
    what a ``ProcessGroup`` and a ``Backend`` each need around them."""

    def _issue(self, call, opts, start, result, finish=None, device=False):
        """:meth:`_run`, with ``finish`` in the caller's inference mode."""
        return self._run(call, opts, start, result, _as_caller(finish), device)

    def _confirmed(self, start, device=False):
        """``start`` (a rooted op) followed by a barrier of the group, in one Work.

        oxcomm's rooted ops let a sender finish early: a broadcast's root, a reduce's or a
        gather's other ranks publish their part and return, so ranks that disagree on the root,
        or a rank whose call was refused, would leave the others with a successful ``wait()``
        and the wrong data, the mismatch surfacing only at the group's next op. gloo's senders
        wait for their receivers. The barrier makes every rank's Work complete only when every
        rank ran the same op (the barrier compares the ranks' last ops: a root mismatch raises
        ``oxcomm.MismatchError``, a rank that never came a timeout) — at the price of one
        barrier per rooted call.

        Not on device tensors yet (``device``): there the barrier, a host job on the staging
        lane, does not complete in order with the staged op (test_cuda_staging's
        ``case_torch_calls`` hangs); the ordered issue path of issue 37 is to take it."""
        if device:
            return start

        def confirmed(a):
            work = start(a)
            check = self.comm.barrier(async_op=a)
            return _last([work, check], a)

        return confirmed

    # ------------------------------------------------------------------ reductions

    def allreduce(self, *args, **kwargs):
        # The blocking one-tensor call a training step makes most (torch's ``all_reduce``:
        # a list and an AllreduceOptions): straight to the native communicator, each check
        # made once and inline (each 0.1 µs here is 0.1 µs of every small all-reduce;
        # docs/perf_torch_path.md). The tensor passes only if it is of a class and dtype that
        # _buffers.buffer() accepted before, on the host, strided and contiguous; the op only
        # if torch's ReduceOp hashes to a plain one (not PREMUL_SUM). Anything else takes the
        # general path below: every call form, checked by forms.allreduce. It bypasses the
        # communicator's lane, so it is taken only when nothing is queued there.
        if len(args) == 2 and not kwargs:
            tensors, opts = args
            if (
                tensors.__class__ is list
                and opts.__class__ is _AllreduceOptions
                and len(tensors) == 1
                and not opts.asyncOp
                and self._idle()
            ):
                t = tensors[0]
                if t.__class__ in _HOST_CLASSES and (not _dev.OVERRIDDEN or not _dev.owns(t)):
                    dtype = _DTYPE_CODES.get(t.dtype)
                    if dtype is not None and t.is_cpu and t.layout is _STRIDED and t.is_contiguous():
                        op = _FAST_OPS.get(hash(opts.reduceOp))
                        if op is not None:
                            self._native.all_reduce_at(t.data_ptr(), t.numel(), dtype, op)
                            return _DONE
        tensors, opts = _forms.allreduce(self, args, kwargs)
        if tensors[0].layout == torch.sparse_coo:
            return self._allreduce_sparse(tensors, opts)
        op, factor = _op_and_factor(opts, "allreduce")
        dev = _on_device("allreduce", *tensors)
        if len(tensors) == 1:
            if factor is not None:
                _scaled(tensors[0], factor, True)
            buf, finish = _contiguous_out(tensors[0], None)
        else:
            # gloo's meaning: across the list, then across ranks; every tensor gets the total
            buf = _local_reduce(tensors, op, factor)

            def finish():
                for t in tensors:
                    t.copy_(buf.view(t.shape))

        start = lambda a: self.comm.all_reduce(buf, op, async_op=a)  # noqa: E731
        return self._issue("allreduce", opts, start, tensors, finish, device=dev)

    def allreduce_coalesced(self, *args, **kwargs):
        tensors, opts = _forms.allreduce_coalesced(self, args, kwargs)
        op, factor = _op_and_factor(opts, "allreduce_coalesced")
        dev = _on_device("allreduce_coalesced", *tensors)
        finish = None
        bufs = []
        for k, t in enumerate(tensors):
            if _overlaps_earlier(tensors, k):
                # The same tensor twice (or two views that overlap): as gloo, each entry is
                # reduced from its value at the call, and copied back in list order.
                b = t.contiguous().clone()
                finish = _copy_back(t, b, finish)
            else:
                b, finish = _contiguous_out(t, finish)
            if factor is not None:
                _scaled(b, factor, True)
            bufs.append(b)
        groups = _by_dtype(bufs)

        def start(a):
            works = [self.comm.all_reduce_coalesced([bufs[k] for k in idx], op, async_op=a) for idx in groups]
            return _last(works, a)

        return self._issue("allreduce_coalesced", opts, start, tensors, finish, device=dev)

    def allreduce_sparse(self, *args, **kwargs):
        tensors, opts = _forms.allreduce(self, args, kwargs)
        return self._allreduce_sparse(tensors, opts)

    def _allreduce_sparse(self, tensors, opts):
        """All-reduce (SUM) of sparse COO tensors on the host, as gloo's: the list's tensors are
        summed on this rank, then every rank's coalesced indices and values are all-gathered
        (padded to the largest count) and summed into one coalesced tensor, which replaces
        each input's contents. Runs blocking, after the group's ops in flight; O(total
        nonzeros) bytes per rank."""
        call = "allreduce (sparse)"
        for k, t in enumerate(tensors):
            if t.layout != torch.sparse_coo:
                raise _forms._bad(self, call, f"tensors[{k}] is a {t.layout} tensor, tensors[0] sparse COO")
            if not t.is_cpu:
                raise NotImplementedError("oxcomm: all_reduce of sparse tensors on a device is not supported")
        if _premul_factor(opts.reduceOp) is not None or _reduce_op(opts.reduceOp, call) != oxcomm.ReduceOp.SUM:
            raise NotImplementedError("oxcomm: all_reduce of sparse tensors supports SUM only (as gloo)")
        self._drain()
        local = tensors[0]
        for t in tensors[1:]:
            local = local + t
        c = local.coalesce()
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
        total = torch.sparse_coo_tensor(indices, values, local.shape, dtype=local.dtype).coalesce()
        for t in tensors:
            t.copy_(total)
        return _done(list(tensors))

    def reduce(self, *args, **kwargs):
        tensors, opts = _forms.reduce(self, args, kwargs)
        op, factor = _op_and_factor(opts, "reduce")
        t = tensors[0]
        dev = _on_device("reduce", t)
        root = opts.rootRank
        if factor is not None and self.rank() != root:
            # Other ranks' tensors stay as they were: they send a scaled copy.
            buf, finish = _scaled(t, factor, False).contiguous(), None
        else:
            if factor is not None:
                _scaled(t, factor, True)
            buf, finish = _contiguous_out(t, None)
        start = self._confirmed(lambda a: self.comm.reduce(buf, root, op, async_op=a), dev)
        return self._issue("reduce", opts, start, tensors, finish, device=dev)

    def broadcast(self, *args, **kwargs):
        tensors, opts = _forms.broadcast(self, args, kwargs)
        dev = _on_device("broadcast", *tensors)
        src = tensors[opts.rootTensor]
        buf, finish = _contiguous_out(src, None)
        if len(tensors) > 1:
            # every tensor of every rank gets the root's tensors[rootTensor], as gloo's
            others = [t for k, t in enumerate(tensors) if k != opts.rootTensor]
            first = finish

            def finish():
                if first is not None:
                    first()
                for t in others:
                    t.copy_(src)

        root = opts.rootRank
        start = self._confirmed(lambda a: self.comm.broadcast(buf, root, async_op=a), dev)
        return self._issue("broadcast", opts, start, tensors, finish, device=dev)

    # ------------------------------------------------------------------ gathers

    def allgather(self, *args, **kwargs):
        outputs, inputs, opts = _forms.allgather(self, args, kwargs)
        n, k = self.size(), len(inputs)
        dev = _on_device("allgather", *inputs, *(t for outs in outputs for t in outs))
        m = inputs[0].numel()
        if k == 1:
            inp = inputs[0].contiguous()
            flat = _adjacent_base(outputs[0]) if len(outputs) == 1 else None
        else:
            inp = torch.cat([_flat(t.contiguous()) for t in inputs])
            flat = None
        finish = None
        if flat is None:
            flat = inp.new_empty((inp.numel() * n,))

            def finish():
                # block j of the gathered buffer is rank j // k's input j % k
                for outs in outputs:
                    for j, o in enumerate(outs):
                        o.copy_(flat[j * m : (j + 1) * m].view(o.shape))

        src = _flat(inp)
        start = lambda a: self.comm.all_gather(src, flat, async_op=a)  # noqa: E731
        result = outputs[0] if len(outputs) == 1 else outputs
        return self._issue("allgather", opts, start, result, finish, device=dev)

    def all_gather_single(self, *args, **kwargs):
        output, inp, opts = _forms.allgather_base(self, args, kwargs)
        dev = _on_device("all_gather_into_tensor", output, inp)
        src = _flat(inp.contiguous())
        out, finish = _contiguous_out(output, None)
        dst = _flat(out)
        start = lambda a: self.comm.all_gather(src, dst, async_op=a)  # noqa: E731
        return self._issue("allgather_into_tensor", opts, start, _chunks(output, self.size()), finish, device=dev)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, *args, **kwargs):
        """``all_gather_into_tensor`` of each input into the matching output, as one
        ``all_gather_coalesced`` per dtype."""
        outputs, inputs, opts = _forms.allgather_into_tensor_coalesced(self, args, kwargs)
        call = "allgather_into_tensor_coalesced"
        n = self.size()
        if len(outputs) != len(inputs):
            raise _forms._bad(self, call, f"{len(outputs)} outputs for {len(inputs)} inputs")
        dev = _on_device(call, *outputs, *inputs)
        ins, outs, finish = [], [], None
        for j, (o, i) in enumerate(zip(outputs, inputs)):
            if o.numel() != i.numel() * n or o.dtype != i.dtype:
                raise _forms._bad(
                    self, call, f"outputs[{j}] ({_forms._describe(o)}) for inputs[{j}] ({_forms._describe(i)}) in a group of {n}"
                )
            buf, finish = _contiguous_out(o, finish)
            ins.append(_flat(i.contiguous()))
            outs.append(_flat(buf))
        # gloo's future: rank r's blocks of every output, rank by rank
        chunks = [_chunks(o, n) for o in outputs]
        result = [[c[r] for c in chunks] for r in range(n)] if all(len(c) == n for c in chunks) else list(outputs)
        return self._gather_coalesced(call, opts, ins, outs, result, finish, dev)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather_coalesced(self, *args, **kwargs):
        """``all_gather_coalesced``: ``output_lists[r][j]`` gets rank r's ``inputs[j]``; one
        ``all_gather_coalesced`` per dtype, into each tensor's outputs in place when they lie
        back to back in one storage, else into scratch copied out."""
        output_lists, inputs, opts = _forms.allgather_coalesced(self, args, kwargs)
        call = "allgather_coalesced"
        n = self.size()
        if len(output_lists) != n or any(len(o) != len(inputs) for o in output_lists):
            raise _forms._bad(
                self,
                call,
                f"outputs must be {n} lists (one per rank) of {len(inputs)} tensors, got {[len(o) for o in output_lists]}",
            )
        dev = _on_device(call, *inputs, *(t for o in output_lists for t in o))
        ins, outs, copies = [], [], []
        for j, i in enumerate(inputs):
            per_rank = [output_lists[r][j] for r in range(n)]
            if any(t.numel() != i.numel() or t.dtype != i.dtype for t in per_rank):
                raise _forms._bad(self, call, f"output_lists[r][{j}] differ from input_list[{j}] in size or dtype")
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

        return self._gather_coalesced(call, opts, ins, outs, output_lists, finish, dev)

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

        return self._issue(call, opts, start, result, finish, device=dev)

    def gather(self, *args, **kwargs):
        outs, inp, opts = _forms.gather(self, args, kwargs)
        inp = inp.contiguous()
        root = opts.rootRank
        finish = None
        flat = None
        dev = _on_device("gather", inp, *outs)
        if outs:
            flat = _adjacent_base(outs)
            if flat is None:
                flat = inp.new_empty((inp.numel() * len(outs),))
                finish = _copy_blocks(flat, outs, inp.numel())
        src = _flat(inp)
        start = self._confirmed(lambda a: self.comm.gather(src, flat, root, async_op=a), dev)
        return self._issue("gather", opts, start, outs, finish, device=dev)

    def scatter(self, *args, **kwargs):
        out, ins, opts = _forms.scatter(self, args, kwargs)
        root = opts.rootRank
        flat = None
        dev = _on_device("scatter", out, *ins)
        if ins:
            flat = _adjacent_base(ins)
            if flat is None:
                flat = torch.cat([_flat(t.contiguous()) for t in ins])
        buf, finish = _contiguous_out(out, None)
        dst = _flat(buf)
        start = self._confirmed(lambda a: self.comm.scatter(flat, dst, root, async_op=a), dev)
        return self._issue("scatter", opts, start, [out], finish, device=dev)

    # ------------------------------------------------------------------ reduce-scatter

    def reduce_scatter(self, *args, **kwargs):
        out, ins, opts = _forms.reduce_scatter(self, args, kwargs)
        op, factor = _op_and_factor(opts, "reduce_scatter")
        dev = _on_device("reduce_scatter", out, *ins)
        sizes = [t.numel() for t in ins]
        top = max(sizes)
        if len(set(sizes)) == 1:
            flat = _adjacent_base(ins)
            if flat is None:
                flat = torch.cat([_flat(t.contiguous()) for t in ins])
        else:
            # Blocks of different sizes (gloo's reduce_scatter takes them): each padded to the
            # largest, so one native reduce-scatter does it; the padding is never read.
            flat = out.new_zeros((top * len(ins),))
            for r, t in enumerate(ins):
                flat[r * top : r * top + sizes[r]].copy_(_flat(t.contiguous()))
        if factor is not None:
            flat = _scaled(flat, factor, False)
        if top == out.numel():
            buf, finish = _contiguous_out(out, None)
            dst = _flat(buf)
        else:
            dst = out.new_empty((top,))
            finish = _copy_back(out, dst[: out.numel()], None)
        start = lambda a: self.comm.reduce_scatter(flat, dst, op, async_op=a)  # noqa: E731
        return self._issue("reduce_scatter", opts, start, [out], finish, device=dev)

    def reduce_scatter_single(self, *args, **kwargs):
        output, inp, opts = _forms.reduce_scatter_base(self, args, kwargs)
        op, factor = _op_and_factor(opts, "reduce_scatter_tensor")
        dev = _on_device("reduce_scatter_tensor", output, inp)
        src = _flat(inp.contiguous())
        if factor is not None:
            src = _scaled(src, factor, False)
        buf, finish = _contiguous_out(output, None)
        dst = _flat(buf)
        start = lambda a: self.comm.reduce_scatter(src, dst, op, async_op=a)  # noqa: E731
        return self._issue("reduce_scatter_tensor", opts, start, [output], finish, device=dev)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, *args, **kwargs):
        """``reduce_scatter_tensor`` of each input into the matching output, as one native
        reduce-scatter per dtype: the inputs are packed rank block by rank block (block r of
        the packed buffer is block r of every input, back to back), so rank r's block of the
        reduction holds its block of every input's reduction, copied out into the outputs.
        (oxcomm has no coalesced reduce-scatter with a reduce op for Python yet; the pack costs
        one copy of the inputs and of the outputs.)"""
        outputs, inputs, opts = _forms.reduce_scatter_tensor_coalesced(self, args, kwargs)
        call = "reduce_scatter_tensor_coalesced"
        op = _reduce_op(opts.reduceOp, call)
        n = self.size()
        if len(outputs) != len(inputs):
            raise _forms._bad(self, call, f"{len(outputs)} outputs for {len(inputs)} inputs")
        dev = _on_device(call, *outputs, *inputs)
        for j, (o, i) in enumerate(zip(outputs, inputs)):
            if i.numel() != o.numel() * n or o.dtype != i.dtype:
                raise _forms._bad(
                    self, call, f"inputs[{j}] ({_forms._describe(i)}) for outputs[{j}] ({_forms._describe(o)}) in a group of {n}"
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

        return self._issue(call, opts, start, list(outputs), finish, device=dev)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # ------------------------------------------------------------------ all-to-all

    def alltoall(self, *args, **kwargs):
        output_tensors, input_tensors, opts = _forms.alltoall(self, args, kwargs)
        n = self.size()
        if len(output_tensors) != n or len(input_tensors) != n:
            raise _forms._bad(
                self, "alltoall", f"{len(input_tensors)} inputs and {len(output_tensors)} outputs for a group of {n}"
            )
        dev = _on_device("alltoall", *output_tensors, *input_tensors)
        dtype = input_tensors[0].dtype
        if any(t.dtype != dtype for t in (*input_tensors, *output_tensors)):
            raise _forms._bad(self, "alltoall", "tensors of different dtypes")
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
        return self._issue("alltoall", opts, start, output_tensors, finish, device=dev)

    def all_to_all_single(self, *args, **kwargs):
        output, input, output_split_sizes, input_split_sizes, opts = _forms.alltoall_base(self, args, kwargs)
        dev = _on_device("alltoall_base", output, input)
        src = _flat(input.contiguous())
        buf, finish = _contiguous_out(output, None)
        dst = _flat(buf)
        if not output_split_sizes and not input_split_sizes:
            start = lambda a: self.comm.all_to_all(src, dst, async_op=a)  # noqa: E731
        else:
            n = self.size()
            in_row = math.prod(input.shape[1:]) if input.dim() > 1 else 1
            out_row = math.prod(output.shape[1:]) if output.dim() > 1 else 1
            send_counts = [s * in_row for s in input_split_sizes] if input_split_sizes else [input.numel() // n] * n
            recv_counts = [s * out_row for s in output_split_sizes] if output_split_sizes else [output.numel() // n] * n
            if len(send_counts) != n or len(recv_counts) != n:
                raise _forms._bad(self, "alltoall_base", f"split sizes must have {n} entries (the group size)")
            start = lambda a: self.comm.all_to_all_v(src, send_counts, dst, recv_counts, async_op=a)  # noqa: E731
        return self._issue("alltoall_base", opts, start, [output], finish, device=dev)

    alltoall_base = all_to_all_single

    # ------------------------------------------------------------------ barriers and p2p

    def barrier(self, *args, **kwargs):
        opts = _forms.barrier(self, args, kwargs)
        return self._issue("barrier", opts, lambda a: self.comm.barrier(async_op=a), [])

    def monitored_barrier(self, opts=None, wait_all_ranks=False, timeout=None):
        if timeout is not None:
            opts = timeout
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

    def send(self, *args, **kwargs):
        t, dst, tag = _forms.p2p(self, "send", args, kwargs)
        dev = _on_device("send", t)
        buf = t.contiguous()
        return self._p2p("send", lambda: self.comm.isend(buf, dst, tag), [t], None, dev)

    def recv(self, *args, **kwargs):
        t, src, tag = _forms.p2p(self, "recv", args, kwargs)
        dev = _on_device("recv", t)
        buf, finish = _contiguous_out(t, None)
        return self._p2p("recv", lambda: self.comm.irecv(buf, src, tag), [t], _as_caller(finish), dev)

    def recv_anysource(self, *args, **kwargs):
        """``recv``/``irecv`` without ``src``: the first message with ``tag`` from any rank
        of the group; the Work's ``_source_rank()`` names its sender (torch's ``recv``
        returns it)."""
        t, _, tag = _forms.p2p(self, "recv_anysource", args, kwargs)
        dev = _on_device("recv", t)
        buf, finish = _contiguous_out(t, None)
        start = lambda: self.comm.irecv(buf, None, tag)  # noqa: E731
        return self._p2p("recv", start, [t], _as_caller(finish), dev, any_source=True)

    recvAnysource = recv_anysource


def _chunks(output, n):
    """gloo's future value of an all-gather into one tensor: the output's n blocks along its
    first dimension (views), or the output alone when it does not split so."""
    if output.dim() > 0 and output.shape[0] % n == 0:
        return list(output.chunk(n)) if output.shape[0] else [output] * n
    return [output]


def _copy_back(t, scratch, finish):
    """``finish`` followed by copying ``scratch`` into ``t``."""

    def copy_back():
        if finish is not None:
            finish()
        t.copy_(scratch.view(t.shape) if scratch.is_contiguous() else scratch)

    return copy_back


def _copy_blocks(flat, outs, m):
    """A finish copying block k of ``flat`` (``m`` elements each) into ``outs[k]``."""

    def finish():
        for k, o in enumerate(outs):
            o.copy_(flat[k * m : (k + 1) * m].view(o.shape))

    return finish
