"""The torch backend's blocking one-tensor all_reduce path (``ProcessGroupOxcomm.allreduce``
straight to ``_native.Communicator.all_reduce_at``): which calls take it, that its answers are
exact for every plain reduce op and the dtypes tried, that whatever it does not take
(PREMUL_SUM, strided views, async calls) still gets the general path's answer, and that a dtype
oxcomm does not reduce, a peer's mismatch or a bad index is an error naming the op on it too.

Each test spawns its ranks with ``_torch_ranks.run``: the ``case_*`` functions below run in
the ranks, ``test_*`` in pytest.
"""

from __future__ import annotations

import pytest

import _torch_ranks

pytest.importorskip("torch")


# ------------------------------------------------------------------------------- in the ranks


class _Counting:
    """Stands in for the group's native communicator and counts ``all_reduce_at`` calls."""

    def __init__(self, native):
        self._inner = native
        self.fast = 0

    def all_reduce_at(self, *args):
        self.fast += 1
        return self._inner.all_reduce_at(*args)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _group():
    import torch
    import torch.distributed as dist

    import oxcomm.torch  # noqa: F401  (registers "oxcomm")

    torch.set_num_threads(1)
    dist.init_process_group("oxcomm")
    pg = dist.distributed_c10d._get_default_group()
    pg._native = counting = _Counting(pg._native)
    return pg, counting


def case_fast_path():
    """Every plain op on the fast path, exact; the calls it must not take still right."""
    import torch
    import torch.distributed as dist

    pg, counting = _group()
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}

    # The first call of a tensor class and dtype takes the general path (its checks admit them).
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    out["first"] = (counting.fast, t.tolist())

    plain = {
        "SUM": (torch.float32, sum(range(1, n + 1))),
        "AVG": (torch.float64, sum(range(1, n + 1)) / n),
        "PRODUCT": (torch.float32, float(torch.arange(1, n + 1).prod())),
        "MIN": (torch.int64, 1),
        "MAX": (torch.int32, n),
        "BAND": (torch.int64, 1 if n == 1 else 0),
        "BOR": (torch.int64, (1 << n) - 1),
        "BXOR": (torch.int64, (1 << n) - 1),
    }
    for name, (dtype, want) in plain.items():
        value = 1 << rank if name in ("BAND", "BOR", "BXOR") else rank + 1
        t = torch.full((3,), value, dtype=dtype)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, name))  # a dtype's first call may be general
        t.fill_(value)
        before = counting.fast
        dist.all_reduce(t, op=getattr(dist.ReduceOp, name))
        out[name] = (counting.fast - before, t.tolist() == [want] * 3)

    # Not taken: PREMUL_SUM, a strided view, an async call; each still exact.
    before = counting.fast
    t = torch.full((2,), float(rank + 1))
    if _torch_ranks.premul_sum_exposed():
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(2.0))
        out["premul"] = t.tolist() == [2.0 * sum(range(1, n + 1))] * 2
    else:  # this torch hides the factor: refused, naming the op
        out["premul"] = _torch_ranks.refuses_premul_sum(lambda: dist.all_reduce(t, op=dist._make_nccl_premul_sum(2.0)))
    base = torch.zeros(8)
    view = base[::2]
    view.fill_(float(rank + 1))
    dist.all_reduce(view)
    out["strided"] = (view.tolist() == [float(sum(range(1, n + 1)))] * 4, base[1::2].tolist() == [0.0] * 4)
    t = torch.ones(2)
    dist.all_reduce(t, async_op=True).wait()
    out["async"] = t.tolist() == [float(n)] * 2
    out["not_taken"] = counting.fast - before

    # A dtype oxcomm moves but does not reduce: refused naming the op, on the general path
    # (first call) and on the fast path (second), with the same error.
    out["refused"] = []
    for _ in range(2):
        before = counting.fast
        try:
            dist.all_reduce(torch.zeros(2, dtype=torch.float8_e4m3fn))
            out["refused"].append(None)
        except Exception as e:  # noqa: BLE001 - the test looks at what was raised
            out["refused"].append([counting.fast - before, type(e).__name__, str(e)[:200]])
    return out


def case_mismatch_on_fast_path():
    """After the fast path is warm, ranks pass different sizes: every rank raises, naming
    all_reduce (the library's fingerprint check, on the fast path too)."""
    import torch
    import torch.distributed as dist

    pg, counting = _group()
    dist.all_reduce(torch.ones(4))
    dist.all_reduce(torch.ones(4))
    warm = counting.fast
    try:
        dist.all_reduce(torch.ones(5 + dist.get_rank()))
        return {"raised": None}
    except RuntimeError as e:
        return {"raised": str(e)[:300], "fast": counting.fast - warm, "warm": warm}


def case_bad_indices():
    """``all_reduce_at`` refuses a dtype or op index outside the library's lists."""
    import torch
    import torch.distributed as dist

    from oxcomm import _native

    pg, _ = _group()
    t = torch.ones(2)
    errors = []
    for dtype, op in ((len(_native.DTYPES), 0), (0, len(_native.REDUCE_OPS))):
        try:
            pg._native.all_reduce_at(t.data_ptr(), t.numel(), dtype, op)
            errors.append(None)
        except (TypeError, ValueError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    pg._native.all_reduce_at(t.data_ptr(), t.numel(), _native.DTYPES.index("f32"), _native.REDUCE_OPS.index("sum"))
    return {"errors": errors, "sum": t.tolist(), "n": dist.get_world_size()}


# ------------------------------------------------------------------------------- in pytest


def test_fast_path_ops_exact_and_others_general():
    res = _torch_ranks.run(2, "test_torch_small_op:case_fast_path", timeout=120)
    for out in res:
        assert out["first"] == [0, [3.0] * 4], out
        for name in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"):
            assert out[name] == [1, True], (name, out[name])
        assert out["premul"] and out["strided"] == [True, True] and out["async"], out
        assert out["not_taken"] == 0, out
        (general, fast) = out["refused"]
        assert general[0] == 0 and fast[0] == 1 and general[1:] == fast[1:], out["refused"]
        assert "all_reduce" in fast[2] and fast[1] == "UnsupportedError", out["refused"]


def test_mismatch_on_fast_path_raises_on_every_rank():
    res = _torch_ranks.run(2, "test_torch_small_op:case_mismatch_on_fast_path", timeout=60)
    for out in res:
        assert out["raised"] and "all_reduce" in out["raised"], out
        assert out["warm"] >= 1 and out["fast"] == 1, out


def test_bad_indices_refused():
    (out,) = _torch_ranks.run(1, "test_torch_small_op:case_bad_indices", timeout=60)
    assert out["errors"][0].startswith("TypeError") and "dtype index" in out["errors"][0], out
    assert out["errors"][1].startswith("ValueError") and "op: index" in out["errors"][1], out
    assert out["sum"] == [1.0, 1.0], out
