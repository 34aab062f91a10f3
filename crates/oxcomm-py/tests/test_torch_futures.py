"""What a ProcessGroup call's Work holds, on gloo and oxcomm side by side: ``get_future().value()``
has gloo's shape for every call that gloo gives a future (the list of output tensors, so that
``fut.value()[0]`` is the tensor; a flat list after a one-input all-gather or a gather; the
output's blocks after an all-gather into one tensor), and ``result()`` the same.

The cases run in the ranks through ``_conformance.run_cases``.
"""

from __future__ import annotations

import pytest

import _conformance as conf
from _conformance import f as _f, opts as _opts
import _torch_ranks

pytest.importorskip("torch")

CASES = []
case = conf.case


def _value(work):
    """The future's value, and ``value()[0]`` as user code reads it."""
    fut = work.get_future()
    fut.wait()
    v = fut.value()
    return [v, v[0] if v else None]


def _zeros(k, *shape):
    import torch

    return [torch.zeros(*shape) for _ in range(k)]


@case(CASES, "allreduce(tensor): [tensor]")
def _(g, rank, n):
    import torch

    return _value(g.allreduce(torch.ones(3, 2) * rank))


@case(CASES, "allreduce(list of one)")
def _(g, rank, n):
    return _value(g.allreduce([_f(rank, 1)]))


@case(CASES, "allreduce(list of two)")
def _(g, rank, n):
    return _value(g.allreduce([_f(rank, 1), _f(2, 2)]))


@case(CASES, "allreduce_coalesced")
def _(g, rank, n):
    return _value(g.allreduce_coalesced([_f(rank, 1), _f(2)]))


@case(CASES, "broadcast(tensor, root): [tensor]")
def _(g, rank, n):
    import torch

    return _value(g.broadcast(torch.ones(2, 2) * rank, 1))


@case(CASES, "broadcast(list of two)")
def _(g, rank, n):
    return _value(g.broadcast([_f(rank, 1), _f(rank, 2)], _opts("BroadcastOptions", rootTensor=1)))


@case(CASES, "reduce at the root")
def _(g, rank, n):
    v = _value(g.reduce(_f(rank, 1), 0))
    return v if rank == 0 else [len(v[0])]


@case(CASES, "allgather(lists, list): flat")
def _(g, rank, n):
    return _value(g.allgather([_zeros(n, 2)], [_f(rank, rank)]))


@case(CASES, "allgather(list, tensor): flat")
def _(g, rank, n):
    return _value(g.allgather(_zeros(n, 2), _f(rank, rank)))


@case(CASES, "allgather of two inputs: nested")
def _(g, rank, n):
    return _value(g.allgather([_zeros(2 * n, 1), _zeros(2 * n, 1)], [_f(rank), _f(rank + 10)]))


@case(CASES, "_allgather_base: the output's blocks")
def _(g, rank, n):
    import torch

    return _value(g._allgather_base(torch.zeros(2 * n, 3), torch.ones(2, 3) * rank))


@case(CASES, "allgather_coalesced: nested")
def _(g, rank, n):
    return _value(g.allgather_coalesced([_zeros(2, 2) for _ in range(n)], [_f(rank, 1), _f(rank, 2)]))


@case(CASES, "allgather_into_tensor_coalesced: blocks by rank")
def _(g, rank, n):
    import torch

    outs = [torch.zeros(2 * n), torch.zeros(n)]
    return _value(g.allgather_into_tensor_coalesced(outs, [_f(rank, rank), _f(rank + 5)]))


@case(CASES, "gather: flat at the root, empty elsewhere")
def _(g, rank, n):
    o = [_zeros(n, 2)] if rank == 0 else []
    return _value(g.gather(o, [_f(rank, 1)], _opts("GatherOptions", rootRank=0)))[:1]


@case(CASES, "scatter")
def _(g, rank, n):
    i = [[_f(k, k) for k in range(n)]] if rank == 0 else []
    return _value(g.scatter(_zeros(1, 2), i, _opts("ScatterOptions", rootRank=0)))


@case(CASES, "alltoall")
def _(g, rank, n):
    return _value(g.alltoall(_zeros(n, 1), [_f(rank * 10 + k) for k in range(n)]))


@case(CASES, "alltoall_base")
def _(g, rank, n):
    import torch

    return _value(g.alltoall_base(torch.zeros(n), torch.arange(float(n)) + 10 * rank, [], []))


@case(CASES, "barrier: []")
def _(g, rank, n):
    fut = g.barrier().get_future()
    fut.wait()
    return fut.value()


@case(CASES, "result() of allreduce")
def _(g, rank, n):
    w = g.allreduce([_f(rank, 1)])
    w.wait()
    return w.result()


@case(CASES, "result() of allgather")
def _(g, rank, n):
    w = g.allgather([_zeros(n, 2)], [_f(rank, rank)])
    w.wait()
    return w.result()


@case(
    CASES,
    "result() of allgather_coalesced",
    lenient="oxcomm's result() returns the output lists where gloo refuses a list of lists",
    expect=lambda rank, n: [[_f(r, 1), _f(r, 2)] for r in range(n)],
)
def _(g, rank, n):
    w = g.allgather_coalesced([_zeros(2, 2) for _ in range(n)], [_f(rank, 1), _f(rank, 2)])
    w.wait()
    return w.result()


def case_futures():
    return conf.run_cases(CASES)


def test_future_values_as_gloo():
    conf.check(_torch_ranks.run(2, "test_torch_futures:case_futures", timeout=300))
