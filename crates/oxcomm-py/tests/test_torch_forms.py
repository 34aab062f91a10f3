"""Every call form torch's ProcessGroup takes, and every bad argument, on gloo and oxcomm side by
side (``oxcomm/torch/forms.py``): lists and one-tensor forms, options objects and keyword
arguments give gloo's results; bad arguments raise gloo's exception classes at call time, on
the rank that passed them, before anything is sent (the group stays usable).

The cases run in the ranks through ``_conformance.run_cases``; ``OXCOMM_CASE=<part of a name>``
runs only the matching ones.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

import _conformance as conf
from _conformance import f as _f, i64 as _int, opts as _opts, waited as _waited
import _torch_ranks

pytest.importorskip("torch")

CASES = []
case = conf.case


def _R():
    import torch.distributed as dist

    return dist.ReduceOp


# ------------------------------------------------------------------ allreduce: every form


@case(CASES, "allreduce(list, opts)")
def _(g, rank, n):
    a = _f(rank, 1)
    return _waited(g.allreduce([a], _opts("AllreduceOptions", reduceOp=_R().MAX)), a)


@case(CASES, "allreduce(list)")
def _(g, rank, n):
    a = _f(rank, 1)
    return _waited(g.allreduce([a]), a)


@case(CASES, "allreduce(list, op)")
def _(g, rank, n):
    a = _f(rank, 1)
    return _waited(g.allreduce([a], _R().MIN), a)


@case(CASES, "allreduce(list, op=, timeout=)")
def _(g, rank, n):
    a = _f(rank, 1)
    return _waited(g.allreduce([a], op=_R().MAX, timeout=timedelta(seconds=30)), a)


@case(CASES, "allreduce(tensor)")
def _(g, rank, n):
    import torch

    a = torch.ones(4) * (rank + 1)  # a bare tensor is one tensor, not a list of its rows
    return _waited(g.allreduce(a), a)


@case(CASES, "allreduce(tensor, op)")
def _(g, rank, n):
    a = _f(rank, 2 - rank)
    return _waited(g.allreduce(a, _R().MAX), a)


@case(CASES, "allreduce(tensor, op=ReduceOp(...))")
def _(g, rank, n):
    import torch.distributed as dist

    a = _f(rank, 2 - rank)
    return _waited(g.allreduce(a, op=dist.ReduceOp(dist.ReduceOp.MIN)), a)


@case(CASES, "allreduce(tensor, op, timeout)")
def _(g, rank, n):
    a = _f(rank, 3)
    return _waited(g.allreduce(a, _R().SUM, timedelta(seconds=30)), a)


@case(CASES, "allreduce(tensors=, opts=)")
def _(g, rank, n):
    a = _f(rank, 3)
    return _waited(g.allreduce(tensors=[a], opts=_opts("AllreduceOptions")), a)


@case(CASES, "allreduce(tensor=, op=)")
def _(g, rank, n):
    a = _f(rank, 3)
    return _waited(g.allreduce(tensor=a, op=_R().PRODUCT), a)


@case(CASES, "allreduce(0-d tensor)")
def _(g, rank, n):
    import torch

    a = torch.tensor(float(rank + 2))
    return _waited(g.allreduce(a), a)


@case(CASES, "allreduce(tuple of tensors)")
def _(g, rank, n):
    a = _f(rank, 3)
    return _waited(g.allreduce((a,)), a)


@case(CASES, "allreduce(list, opts asyncOp=False)")
def _(g, rank, n):
    a = _f(rank, 3)
    return _waited(g.allreduce([a], _opts("AllreduceOptions", asyncOp=False)), a)


# ------------------------------------------------------------------ allreduce: bad arguments


@case(CASES, "allreduce: mixed dtypes")
def _(g, rank, n):
    import torch

    return _waited(g.allreduce([_f(1), torch.tensor([1.0], dtype=torch.float64)]))


@case(CASES, "allreduce: mixed sizes")
def _(g, rank, n):
    return _waited(g.allreduce([_f(1), _f(1, 2)]))


@case(CASES, "allreduce: mixed shapes")
def _(g, rank, n):
    return _waited(g.allreduce([_f(1, 2), _f(1, 2).view(2, 1)]))


@case(CASES, "allreduce: empty list")
def _(g, rank, n):
    return _waited(g.allreduce([]))


@case(CASES, "allreduce: op is a string")
def _(g, rank, n):
    return _waited(g.allreduce(_f(1), "sum"))


@case(CASES, "allreduce: options of another call")
def _(g, rank, n):
    return _waited(g.allreduce([_f(1)], _opts("BroadcastOptions")))


@case(CASES, "allreduce: unknown keyword")
def _(g, rank, n):
    return _waited(g.allreduce([_f(1)], root=0))


@case(CASES, "allreduce: a list of lists")
def _(g, rank, n):
    return _waited(g.allreduce([[_f(1)]]))


@case(CASES, "allreduce: sparse beside dense")
def _(g, rank, n):
    import torch

    s = torch.sparse_coo_tensor([[0]], [1.0], (1,))
    return _waited(g.allreduce([_f(1), s], _opts("AllreduceOptions")))


@case(CASES, "allreduce: BAND on floats")
def _(g, rank, n):
    a = _f(1)
    return _waited(g.allreduce(a, _R().BAND), a)


@case(CASES, "allreduce_coalesced: empty list")
def _(g, rank, n):
    return _waited(g.allreduce_coalesced([]))


@case(CASES, "allreduce_coalesced: a bare tensor")
def _(g, rank, n):
    return _waited(g.allreduce_coalesced(_f(1, 2)))


@case(
    CASES,
    "allreduce_coalesced: mixed dtypes",
    lenient="oxcomm reduces each dtype as its own coalesced op (gloo refuses mixed dtypes)",
    expect=lambda rank, n: [_f(*[float(n)] * 2), _int(n, n)],
)
def _(g, rank, n):
    a, b = _f(1, 1), _int(1, 1)
    return _waited(g.allreduce_coalesced([a, b]), a, b)


# ------------------------------------------------------------------ broadcast


@case(CASES, "broadcast(tensor, root)")
def _(g, rank, n):
    a = _f(rank, rank)
    return _waited(g.broadcast(a, n - 1), a)


@case(CASES, "broadcast(tensor, root=)")
def _(g, rank, n):
    a = _f(rank, rank)
    return _waited(g.broadcast(a, root=1), a)


@case(CASES, "broadcast(tensor, root, timeout=)")
def _(g, rank, n):
    a = _f(rank, rank)
    return _waited(g.broadcast(a, 1, timeout=timedelta(seconds=30)), a)


@case(CASES, "broadcast(list, opts)")
def _(g, rank, n):
    a = _f(rank, rank)
    return _waited(g.broadcast([a], _opts("BroadcastOptions", rootRank=1)), a)


@case(CASES, "broadcast(list)")
def _(g, rank, n):
    a = _f(rank, rank)
    return _waited(g.broadcast([a]), a)


@case(CASES, "broadcast: root == size")
def _(g, rank, n):
    a = _f(rank)
    return _waited(g.broadcast(a, n), a)


@case(CASES, "broadcast: root -1")
def _(g, rank, n):
    a = _f(rank)
    return _waited(g.broadcast(a, -1), a)


@case(CASES, "broadcast: root == size in options")
def _(g, rank, n):
    a = _f(rank)
    return _waited(g.broadcast([a], _opts("BroadcastOptions", rootRank=n)), a)


@case(CASES, "broadcast: rootTensor 1 of one tensor")
def _(g, rank, n):
    a = _f(rank)
    return _waited(g.broadcast([a], _opts("BroadcastOptions", rootTensor=1)), a)


@case(CASES, "broadcast: rootTensor -1")
def _(g, rank, n):
    a = _f(rank)
    return _waited(g.broadcast([a], _opts("BroadcastOptions", rootTensor=-1)), a)


@case(CASES, "broadcast: empty list")
def _(g, rank, n):
    return _waited(g.broadcast([]))


@case(CASES, "broadcast: mixed sizes")
def _(g, rank, n):
    return _waited(g.broadcast([_f(rank), _f(rank, 1)]))


@case(CASES, "broadcast: mixed dtypes")
def _(g, rank, n):
    return _waited(g.broadcast([_f(rank), _int(rank)]))


@case(CASES, "broadcast: root is a float")
def _(g, rank, n):
    return _waited(g.broadcast(_f(rank), 1.0))


@case(CASES, "broadcast: root missing")
def _(g, rank, n):
    return _waited(g.broadcast(_f(rank)))


# ------------------------------------------------------------------ reduce (the root's result only:
# gloo leaves other ranks' tensors in an unspecified state)


def _at_root(root, rank, a):
    return [a] if rank == root else []


@case(CASES, "reduce(tensor, root, op)")
def _(g, rank, n):
    a = _f(rank + 1, 5)
    g.reduce(a, n - 1, _R().MAX).wait()
    return _at_root(n - 1, rank, a)


@case(CASES, "reduce(tensor, root=, op=)")
def _(g, rank, n):
    a = _f(rank + 1, 5)
    g.reduce(a, root=0, op=_R().SUM).wait()
    return _at_root(0, rank, a)


@case(CASES, "reduce(list, opts)")
def _(g, rank, n):
    a = _f(rank + 1, 5)
    g.reduce([a], _opts("ReduceOptions", rootRank=1, reduceOp=_R().MIN)).wait()
    return _at_root(1, rank, a)


@case(CASES, "reduce: root == size")
def _(g, rank, n):
    return _waited(g.reduce(_f(1), n))


@case(CASES, "reduce: root -1")
def _(g, rank, n):
    return _waited(g.reduce([_f(1)], _opts("ReduceOptions", rootRank=-1)))


@case(CASES, "reduce: two tensors")
def _(g, rank, n):
    return _waited(g.reduce([_f(1), _f(2)]))


@case(CASES, "reduce: empty list")
def _(g, rank, n):
    return _waited(g.reduce([]))


# ------------------------------------------------------------------ allgather


def _zeros(k, *shape, dtype=None):
    import torch

    return [torch.zeros(*shape, dtype=dtype or torch.float32) for _ in range(k)]


@case(CASES, "allgather(lists, list, opts)")
def _(g, rank, n):
    o = _zeros(n, 2)
    return _waited(g.allgather([o], [_f(rank, rank)], _opts("AllgatherOptions")), *o)


@case(CASES, "allgather(list, tensor)")
def _(g, rank, n):
    o = _zeros(n, 2)
    return _waited(g.allgather(o, _f(rank, rank)), *o)


@case(CASES, "allgather(output_tensors=, input_tensor=, timeout=)")
def _(g, rank, n):
    o = _zeros(n, 2)
    return _waited(g.allgather(output_tensors=o, input_tensor=_f(rank, rank), timeout=timedelta(seconds=30)), *o)


@case(CASES, "allgather: too many outputs")
def _(g, rank, n):
    return _waited(g.allgather([_zeros(n + 1, 2)], [_f(rank, rank)]))


@case(CASES, "allgather: too few outputs (flat form)")
def _(g, rank, n):
    return _waited(g.allgather(_zeros(n - 1, 2), _f(rank, rank)))


@case(CASES, "allgather: outputs of another dtype")
def _(g, rank, n):
    import torch

    return _waited(g.allgather([_zeros(n, 2, dtype=torch.float64)], [_f(rank, rank)]))


@case(CASES, "allgather: outputs of another size")
def _(g, rank, n):
    return _waited(g.allgather([_zeros(n, 3)], [_f(rank, rank)]))


@case(CASES, "allgather: an output of another shape")
def _(g, rank, n):
    o = _zeros(n, 2)
    o[-1] = o[-1].view(1, 2)
    return _waited(g.allgather([o], [_f(rank, rank)]))


@case(CASES, "allgather: empty inputs")
def _(g, rank, n):
    return _waited(g.allgather([], []))


@case(CASES, "allgather: two inputs, outputs for one")
def _(g, rank, n):
    return _waited(g.allgather([_zeros(n, 2), _zeros(n, 2)], [_f(rank, rank), _f(1, 1)]))


@case(CASES, "_allgather_base")
def _(g, rank, n):
    import torch

    o = torch.zeros(2 * n)
    return _waited(g._allgather_base(o, _f(rank, rank)), o)


@case(CASES, "_allgather_base: output of another size")
def _(g, rank, n):
    import torch

    return _waited(g._allgather_base(torch.zeros(2 * n + 1), _f(rank, rank)))


@case(CASES, "_allgather_base: output of another dtype")
def _(g, rank, n):
    import torch

    return _waited(g._allgather_base(torch.zeros(2 * n, dtype=torch.float64), _f(rank, rank)))


# ------------------------------------------------------------------ gather and scatter


@case(CASES, "gather(lists, list, opts)")
def _(g, rank, n):
    o = [_zeros(n, 2)] if rank == 0 else []
    g.gather(o, [_f(rank, rank)], _opts("GatherOptions", rootRank=0)).wait()
    return o


@case(CASES, "gather(list, tensor, root)")
def _(g, rank, n):
    o = _zeros(n, 2) if rank == n - 1 else []
    return _waited(g.gather(o, _f(rank, rank), n - 1), *o)


@case(CASES, "gather(list, tensor, root=)")
def _(g, rank, n):
    o = _zeros(n, 2) if rank == 0 else []
    return _waited(g.gather(output_tensors=o, input_tensor=_f(rank, rank), root=0), *o)


@case(CASES, "gather: outputs passed on a non-root rank")
def _(g, rank, n):
    if rank == 0:
        return conf.SKIP
    return _waited(g.gather([_zeros(n, 2)], [_f(rank, rank)], _opts("GatherOptions", rootRank=0)))


@case(CASES, "gather: outputs of another dtype at the root")
def _(g, rank, n):
    import torch

    o = [_zeros(n, 2, dtype=torch.float64)] if rank == 0 else []
    return _waited(g.gather(o, [_f(rank, rank)], _opts("GatherOptions", rootRank=0)))


@case(CASES, "gather: outputs of another size at the root")
def _(g, rank, n):
    o = [_zeros(n, 3)] if rank == 0 else []
    return _waited(g.gather(o, [_f(rank, rank)], _opts("GatherOptions", rootRank=0)))


@case(CASES, "gather: too many outputs at the root")
def _(g, rank, n):
    o = [_zeros(n + 1, 2)] if rank == 0 else []
    return _waited(g.gather(o, [_f(rank, rank)], _opts("GatherOptions", rootRank=0)))


@case(CASES, "gather: root == size")
def _(g, rank, n):
    return _waited(g.gather([], [_f(rank, rank)], _opts("GatherOptions", rootRank=n)))


@case(CASES, "gather: two inputs")
def _(g, rank, n):
    o = [_zeros(n, 2)] if rank == 0 else []
    return _waited(g.gather(o, [_f(rank, rank), _f(1, 1)], _opts("GatherOptions", rootRank=0)))


@case(CASES, "scatter(list, lists, opts)")
def _(g, rank, n):
    i = [[_f(k, k) for k in range(n)]] if rank == 0 else []
    o = _zeros(1, 2)
    return _waited(g.scatter(o, i, _opts("ScatterOptions", rootRank=0)), *o)


@case(CASES, "scatter(tensor, list, root)")
def _(g, rank, n):
    i = [_f(k, k + 1) for k in range(n)] if rank == n - 1 else []
    o = _zeros(1, 2)[0]
    return _waited(g.scatter(o, i, n - 1), o)


@case(CASES, "scatter(output_tensor=, input_tensors=, root=)")
def _(g, rank, n):
    i = [_f(k, k + 1) for k in range(n)] if rank == 0 else []
    o = _zeros(1, 2)[0]
    return _waited(g.scatter(output_tensor=o, input_tensors=i, root=0), o)


@case(CASES, "scatter: inputs passed on a non-root rank")
def _(g, rank, n):
    if rank == 0:
        return conf.SKIP
    return _waited(g.scatter(_zeros(1, 2), [[_f(k, k) for k in range(n)]], _opts("ScatterOptions", rootRank=0)))


@case(CASES, "scatter: inputs of another size at the root")
def _(g, rank, n):
    i = [[_f(k, k, k) for k in range(n)]] if rank == 0 else []
    return _waited(g.scatter(_zeros(1, 2), i, _opts("ScatterOptions", rootRank=0)))


@case(CASES, "scatter: too few inputs at the root")
def _(g, rank, n):
    i = [[_f(k, k) for k in range(n - 1)]] if rank == 0 else []
    return _waited(g.scatter(_zeros(1, 2), i, _opts("ScatterOptions", rootRank=0)))


@case(CASES, "scatter: no output")
def _(g, rank, n):
    i = [[_f(k, k) for k in range(n)]] if rank == 0 else []
    return _waited(g.scatter([], i, _opts("ScatterOptions", rootRank=0)))


@case(CASES, "scatter: root -1")
def _(g, rank, n):
    return _waited(g.scatter(_zeros(1, 2), [], _opts("ScatterOptions", rootRank=-1)))


# ------------------------------------------------------------------ reduce-scatter, all-to-all, barrier, p2p


@case(CASES, "reduce_scatter(list, lists, opts)")
def _(g, rank, n):
    o = _zeros(1, 2)
    return _waited(g.reduce_scatter(o, [[_f(k, rank) for k in range(n)]], _opts("ReduceScatterOptions")), *o)


@case(CASES, "reduce_scatter(tensor, list, op)")
def _(g, rank, n):
    o = _zeros(1, 2)[0]
    return _waited(g.reduce_scatter(o, [_f(k, rank) for k in range(n)], _R().MAX), o)


@case(CASES, "reduce_scatter: too many inputs")
def _(g, rank, n):
    return _waited(g.reduce_scatter(_zeros(1, 2), [[_f(k, rank) for k in range(n + 1)]]))


@case(CASES, "reduce_scatter: output of another size")
def _(g, rank, n):
    return _waited(g.reduce_scatter(_zeros(1, 3), [[_f(k, rank) for k in range(n)]]))


@case(CASES, "_reduce_scatter_base")
def _(g, rank, n):
    import torch

    o = torch.zeros(2)
    return _waited(g._reduce_scatter_base(o, torch.arange(2.0 * n) + rank), o)


@case(CASES, "_reduce_scatter_base: input of another size")
def _(g, rank, n):
    import torch

    return _waited(g._reduce_scatter_base(torch.zeros(2), torch.arange(2.0 * n + 1)))


@case(CASES, "alltoall(list, list)")
def _(g, rank, n):
    o = _zeros(n, 1)
    return _waited(g.alltoall(o, [_f(rank * 10 + k) for k in range(n)]), *o)


@case(CASES, "alltoall_base(no splits)")
def _(g, rank, n):
    import torch

    o = torch.zeros(n)
    return _waited(g.alltoall_base(o, torch.arange(float(n)) + 10 * rank, [], []), o)


@case(CASES, "alltoall_base(splits, timeout=)")
def _(g, rank, n):
    import torch

    o = torch.zeros(n)
    return _waited(g.alltoall_base(o, torch.arange(float(n)) + 10 * rank, [1] * n, [1] * n, timeout=timedelta(seconds=30)), o)


@case(CASES, "barrier()")
def _(g, rank, n):
    return _waited(g.barrier())


@case(CASES, "barrier(opts)")
def _(g, rank, n):
    return _waited(g.barrier(_opts("BarrierOptions")))


@case(CASES, "barrier(timeout=)")
def _(g, rank, n):
    return _waited(g.barrier(timeout=timedelta(seconds=30)))


@case(CASES, "send/recv(list, peer, tag)")
def _(g, rank, n):
    a = _f(rank, 7)
    if rank > 1:
        return conf.SKIP
    w = g.send([a], 1, 3) if rank == 0 else g.recv([a], 0, 3)
    return _waited(w, a)


@case(CASES, "send: two tensors")
def _(g, rank, n):
    return _waited(g.send([_f(1), _f(2)], (rank + 1) % n, 0))


@case(CASES, "send: a bare tensor")
def _(g, rank, n):
    return _waited(g.send(_f(1), (rank + 1) % n, 0))


@case(CASES, "send: destination == size", gloo=False, error=RuntimeError)
def _(g, rank, n):
    # gloo waits for the store key of a rank that does not exist, then may crash the process
    return _waited(g.send([_f(1)], n, 0))


@case(CASES, "recv: source -1", gloo=False, error=RuntimeError)
def _(g, rank, n):
    return _waited(g.recv([_f(1)], -1, 0))


# ------------------------------------------------------------------ in the ranks / in pytest


def case_forms():
    return conf.run_cases(CASES)


def test_call_forms_and_bad_arguments_as_gloo():
    conf.check(_torch_ranks.run(2, "test_torch_forms:case_forms", timeout=300))

