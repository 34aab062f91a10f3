"""What each ProcessGroup call computes, on gloo and oxcomm side by side (``oxcomm/torch/ops.py``):
several tensors per rank (an all-reduce of a list reduces across the list and the ranks; a
broadcast's ``rootTensor``; an all-gather of several inputs), the same tensor twice, a
reduce-scatter whose blocks differ in size, several sparse inputs, ranks that disagree on a
root (an error on every rank, never a silent success), inference mode, and the group's timeout
through its options.

The cases run in the ranks through ``_conformance.run_cases``.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

import _conformance as conf
from _conformance import f as _f, i64 as _i, opts as _opts, waited as _waited
import _torch_ranks

pytest.importorskip("torch")

CASES = []
case = conf.case


# ------------------------------------------------------------------ all-reduce of a list


def _list_case(op_name, make):
    @case(CASES, f"allreduce(list) {op_name}")
    def _(g, rank, n):
        import torch.distributed as dist

        ts = make(rank)
        return _waited(g.allreduce(ts, _opts("AllreduceOptions", reduceOp=getattr(dist.ReduceOp, op_name))), *ts)


for _name in ("SUM", "PRODUCT", "MIN", "MAX"):
    _list_case(_name, lambda rank: [_f(1, rank + 2, -1), _f(2, 3, rank - 1), _f(rank, 1, 2)])


@case(
    CASES,
    "allreduce(list) AVG",
    differs="gloo averages tensors[0] only and leaves the sum in the others; oxcomm gives every tensor the average",
    expect=lambda rank, n: [_avg_of_list(n)] * 3,
)
def _(g, rank, n):
    import torch.distributed as dist

    ts = [_f(1, rank + 2, -1), _f(2, 3, rank - 1), _f(rank, 1, 2)]
    return _waited(g.allreduce(ts, _opts("AllreduceOptions", reduceOp=dist.ReduceOp.AVG)), *ts)


def _avg_of_list(n):
    import torch

    total = sum(_f(1, r + 2, -1) + _f(2, 3, r - 1) + _f(r, 1, 2) for r in range(n))
    return (total / n).to(torch.float32)
for _name in ("BAND", "BOR", "BXOR"):
    _list_case(_name, lambda rank: [_i(7, rank + 2, 12), _i(5, 3, rank + 9), _i(rank + 1, 6, 10)])


@case(CASES, "allreduce(list) of two [1, 2]: every tensor gets the grand total")
def _(g, rank, n):
    a, b = _f(1), _f(2)
    return _waited(g.allreduce([a, b]), a, b)


@case(
    CASES,
    "allreduce(list) of non-contiguous tensors",
    differs="gloo combines a list's tensors by memory position; oxcomm by index, as torch ops do",
    expect=lambda rank, n: [_noncontig_total(n)] * 2,
)
def _(g, rank, n):
    import torch

    a = torch.arange(6.0).view(2, 3).t() + rank
    b = torch.ones(3, 2)
    return _waited(g.allreduce([a, b]), a, b)


def _noncontig_total(n):
    import torch

    return sum((torch.arange(6.0).view(2, 3) + r).t() + torch.ones(3, 2) for r in range(n))


@case(CASES, "allreduce(list): the same tensor twice")
def _(g, rank, n):
    a = _f(1, 2)
    return _waited(g.allreduce([a, a]), a)


@case(CASES, "allreduce_coalesced: the same tensor twice")
def _(g, rank, n):
    a, b = _f(1, 2 + rank), _f(5)
    return _waited(g.allreduce_coalesced([a, b, a]), a, b)


@case(CASES, "allreduce_coalesced: overlapping views")
def _(g, rank, n):
    import torch

    base = torch.arange(6.0) + rank
    return _waited(g.allreduce_coalesced([base[0:4], base[2:6]]), base)


@case(
    CASES,
    "allreduce(list) PREMUL_SUM",
    lenient="oxcomm takes PREMUL_SUM (NCCL's) where gloo has no kernel for it",
    expect=lambda rank, n: [_f(*[2.0 * sum(1 + r for r in range(n)) * 2] * 2)] * 2,
)
def _(g, rank, n):
    import torch.distributed as dist

    a, b = _f(rank + 1, rank + 1), _f(rank + 1, rank + 1)
    op = dist._make_nccl_premul_sum(2.0)
    return _waited(g.allreduce([a, b], _opts("AllreduceOptions", reduceOp=op)), a, b)


# ------------------------------------------------------------------ broadcast


@case(CASES, "broadcast of several tensors, rootTensor 1")
def _(g, rank, n):
    a, b, c = _f(rank, 1), _f(rank, 10), _f(rank, 100)
    return _waited(g.broadcast([a, b, c], _opts("BroadcastOptions", rootRank=n - 1, rootTensor=1)), a, b, c)


@case(CASES, "broadcast of several non-contiguous tensors")
def _(g, rank, n):
    import torch

    a = (torch.arange(6.0).view(2, 3) + rank).t()
    b = torch.zeros(3, 2)
    return _waited(g.broadcast([a, b], _opts("BroadcastOptions", rootRank=1, rootTensor=0)), a, b)


_AGREEING = "on 3+ ranks gloo completes on the ranks that agree with a real root; oxcomm raises on every rank"


def _two_roots(rank, n):
    return rank % 2


@case(
    CASES,
    "broadcast: ranks disagree on the root",
    stricter=_AGREEING,
    timeout=3.0,
    breaks=True,
)
def _(g, rank, n):
    a = _f(rank, rank)
    return _waited(g.broadcast(a, _two_roots(rank, n)), a)


@case(
    CASES,
    "reduce: ranks disagree on the root",
    stricter="gloo's reduce completes when every rank names itself the root; oxcomm raises MismatchError",
    timeout=3.0,
    breaks=True,
)
def _(g, rank, n):
    a = _f(rank, rank)
    g.reduce(a, _two_roots(rank, n)).wait()
    return []


@case(
    CASES,
    "gather: ranks disagree on the root",
    stricter=_AGREEING,
    timeout=3.0,
    breaks=True,
)
def _(g, rank, n):
    import torch

    root = _two_roots(rank, n)
    o = [[torch.zeros(2) for _ in range(n)]] if rank == root else []
    return _waited(g.gather(o, [_f(rank, rank)], _opts("GatherOptions", rootRank=root)))


@case(
    CASES,
    "scatter: ranks disagree on the root",
    stricter=_AGREEING,
    timeout=3.0,
    breaks=True,
)
def _(g, rank, n):
    import torch

    root = _two_roots(rank, n)
    i = [[_f(k, k) for k in range(n)]] if rank == root else []
    o = torch.zeros(2)
    return _waited(g.scatter([o], i, _opts("ScatterOptions", rootRank=root)), o)


@case(CASES, "broadcast: the root's call is refused (bad rootTensor)", timeout=3.0, breaks=True)
def _(g, rank, n):
    a = _f(rank)
    bad = 5 if rank == 0 else 0
    return _waited(g.broadcast([a], _opts("BroadcastOptions", rootRank=0, rootTensor=bad)), a)


# ------------------------------------------------------------------ all-gather, reduce-scatter


@case(CASES, "allgather of two inputs")
def _(g, rank, n):
    import torch

    outs = [[torch.zeros(2) for _ in range(2 * n)] for _ in range(2)]
    g.allgather(outs, [_f(rank, 1), _f(rank, 2)]).wait()
    return outs


@case(CASES, "reduce_scatter with blocks of different sizes")
def _(g, rank, n):
    import torch

    ins = [torch.arange(float(k + 1)) + rank for k in range(n)]
    o = torch.zeros(rank + 1)
    return _waited(g.reduce_scatter([o], [ins]), o)


@case(CASES, "reduce_scatter with blocks of different sizes, MAX, flat form")
def _(g, rank, n):
    import torch
    import torch.distributed as dist

    ins = [torch.arange(float(2 * k + 1)) * (rank + 1) for k in range(n)]
    o = torch.zeros(2 * rank + 1)
    return _waited(g.reduce_scatter(o, ins, dist.ReduceOp.MAX), o)


# ------------------------------------------------------------------ sparse


@case(CASES, "allreduce of one sparse tensor")
def _(g, rank, n):
    import torch

    s = torch.sparse_coo_tensor([[rank, 2]], [1.0, 2.0], (4,))
    g.allreduce([s], _opts("AllreduceOptions")).wait()
    return [s.coalesce()]


@case(CASES, "allreduce of several sparse tensors")
def _(g, rank, n):
    import torch

    s = torch.sparse_coo_tensor([[rank]], [1.0], (4,))
    t = torch.sparse_coo_tensor([[3, rank]], [2.0, 5.0], (4,))
    g.allreduce([s, t], _opts("AllreduceOptions")).wait()
    return [s.coalesce(), t.coalesce()]


# ------------------------------------------------------------------ inference mode


def _inference(fn):
    import torch

    with torch.inference_mode():
        return fn()


@case(CASES, "inference mode: async all_gather")
def _(g, rank, n):
    import torch
    import torch.distributed as dist

    def run():
        o = [torch.zeros(2) for _ in range(n)]
        dist.all_gather(o, _f(rank, rank), group=g, async_op=True).wait()
        return o

    return _inference(run)


@case(CASES, "inference mode: async all_reduce of a non-contiguous tensor")
def _(g, rank, n):
    import torch
    import torch.distributed as dist

    def run():
        a = (torch.arange(6.0).view(2, 3) + rank).t()
        dist.all_reduce(a, group=g, async_op=True).wait()
        return [a]

    return _inference(run)


@case(CASES, "inference mode: broadcast of several tensors")
def _(g, rank, n):
    def run():
        a, b = _f(rank, 1), _f(rank, 2)
        return _waited(g.broadcast([a, b], _opts("BroadcastOptions", rootRank=1)), a, b)

    return _inference(run)


@case(CASES, "inference mode: gather into separate tensors")
def _(g, rank, n):
    import torch

    def run():
        o = [torch.zeros(2) for _ in range(n)] if rank == 0 else []
        return _waited(g.gather(o, _f(rank, rank), 0), *o)

    return _inference(run)


@case(
    CASES,
    "inference mode: recv into a non-contiguous tensor",
    lenient="oxcomm receives into a non-contiguous tensor (gloo: 'input tensor has to be contiguous')",
    expect=lambda rank, n: [] if rank > 1 else [_f(0, 2, 1, 3).view(2, 2)],
)
def _(g, rank, n):
    import torch

    def run():
        if rank > 1:
            return conf.SKIP
        a = (torch.arange(4.0).view(2, 2) + rank).t()
        w = g.send([a], 1, 0) if rank == 0 else g.recv([a], 0, 0)
        w.wait()
        return [a]

    return _inference(run)


# ------------------------------------------------------------------ the group's timeout


def _backend(g):
    import torch

    return g._get_backend(torch.device("cpu"))


@case(CASES, "options._timeout after _set_default_timeout")
def _(g, rank, n):
    b = _backend(g)
    before = b.options._timeout
    b._set_default_timeout(timedelta(seconds=7))
    after = b.options._timeout
    b._set_default_timeout(before)
    return [str(before), str(after), str(b.options._timeout)]


@case(CASES, "_set_default_timeout governs the group's ops", timeout=30.0, breaks=True)
def _(g, rank, n):
    _backend(g)._set_default_timeout(timedelta(seconds=1))
    if rank == 0:
        return conf.SKIP
    t0 = time.monotonic()
    try:
        g.allreduce([_f(1)]).wait()
    except RuntimeError:
        return ["raised", time.monotonic() - t0 < 15]
    return ["completed"]


# ------------------------------------------------------------------ in the ranks / in pytest


def case_ops():
    return conf.run_cases(CASES)


def test_ops_compute_as_gloo():
    conf.check(_torch_ranks.run(2, "test_torch_ops:case_ops", timeout=300))


def test_ops_compute_as_gloo_3_ranks():
    conf.check(_torch_ranks.run(3, "test_torch_ops:case_ops", timeout=300))
