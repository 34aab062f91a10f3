"""The dtypes after the first eight (bool, int16, uint16/32/64, complex64/128, float8) and
``ReduceOp.PREMUL_SUM``: numpy ops on 2 ranks against exact references, and the torch backend
against gloo in the same job where gloo has the dtype and op (else an exact reference).

Ranks are processes spawned by ``_torch_ranks.run``: ``case_*`` run in the ranks, ``test_*``
in pytest.
"""

from __future__ import annotations

import pytest

import _torch_ranks

pytest.importorskip("numpy")

# numpy dtype -> the reduce ops (oxcomm names) that apply, as torch defines them.
_NUMPY_OPS = {
    "bool": ["SUM", "PROD", "MIN", "MAX", "BAND", "BOR", "BXOR"],
    "int16": ["SUM", "AVG", "PROD", "MIN", "MAX", "BAND", "BOR", "BXOR"],
    "uint16": ["SUM", "AVG", "PROD", "MIN", "MAX", "BAND", "BOR", "BXOR"],
    "uint32": ["SUM", "AVG", "PROD", "MIN", "MAX", "BAND", "BOR", "BXOR"],
    "uint64": ["SUM", "AVG", "PROD", "MIN", "MAX", "BAND", "BOR", "BXOR"],
    "complex64": ["SUM", "AVG", "PROD"],
    "complex128": ["SUM", "AVG", "PROD"],
}


def _values(np, dtype, rank, n=37):
    """Small values whose every reduction is exact (complex: small Gaussian integers)."""
    i = np.arange(n)
    if dtype == "bool":
        return ((i * 5 + rank * 7) % 3 != 0).astype(np.bool_)
    if dtype.startswith("complex"):
        return (((i * 7 + rank * 3) % 5 - 2) + 1j * ((i * 3 + rank * 5) % 3 - 1)).astype(dtype)
    return ((i * 7 + rank * 3) % 5 + 1).astype(dtype)


def _reference(np, dtype, op, world, n=37):
    vals = [_values(np, dtype, r, n) for r in range(world)]
    acc = vals[0].copy()
    for v in vals[1:]:
        if dtype == "bool":
            acc = {
                "SUM": acc | v,
                "MAX": acc | v,
                "BOR": acc | v,
                "PROD": acc & v,
                "MIN": acc & v,
                "BAND": acc & v,
                "BXOR": acc ^ v,
            }[op]
        else:
            acc = {
                "SUM": lambda a, b: a + b,
                "AVG": lambda a, b: a + b,
                "PROD": lambda a, b: a * b,
                "MIN": np.minimum,
                "MAX": np.maximum,
                "BAND": np.bitwise_and,
                "BOR": np.bitwise_or,
                "BXOR": np.bitwise_xor,
            }[op](acc, v).astype(dtype)
    if op == "AVG":
        acc = (acc / world).astype(dtype) if dtype.startswith("complex") else (acc // world).astype(dtype)
    return acc


def case_numpy():
    import numpy as np

    import oxcomm
    from test_native import _join

    comm = _join()
    rank, world = comm.rank, comm.size
    checked = 0
    for dtype, ops in _NUMPY_OPS.items():
        for op in ops:
            buf = _values(np, dtype, rank)
            comm.all_reduce(buf, getattr(oxcomm.ReduceOp, op))
            want = _reference(np, dtype, op, world)
            assert buf.dtype == want.dtype and np.array_equal(buf, want), (dtype, op, buf[:6], want[:6])
            if dtype == "bool":
                assert set(buf.view(np.uint8).tolist()) <= {0, 1}, (op, buf.view(np.uint8)[:8])
            checked += 1
        # Moves.
        buf = _values(np, dtype, rank)
        comm.broadcast(buf, world - 1)
        assert np.array_equal(buf, _values(np, dtype, world - 1)), dtype
        out = np.zeros(37 * world, dtype=dtype)
        comm.all_gather(_values(np, dtype, rank), out)
        assert np.array_equal(out, np.concatenate([_values(np, dtype, r) for r in range(world)])), dtype
        checked += 2
    # What torch refuses, oxcomm refuses, naming the op and the dtype.
    refused = []
    for dtype, op in [("complex64", "MAX"), ("complex128", "MIN"), ("bool", "AVG"), ("complex64", "BXOR")]:
        try:
            comm.all_reduce(_values(np, dtype, rank), getattr(oxcomm.ReduceOp, op))
        except oxcomm.OxcommError as e:
            text = str(e)
            assert f"rank {rank}" in text and op.lower() in text and ("c64" in text or "c128" in text or "bool" in text), text
            refused.append(type(e).__name__)
    assert len(refused) == 4, refused
    return {"checked": checked, "refused": refused}


def test_numpy_new_dtypes_2_ranks():
    pytest.importorskip("torch")  # the rank spawner's store is torch's
    res = _torch_ranks.run(2, "test_dtypes:case_numpy", timeout=180)
    assert all(r["checked"] == sum(len(v) + 2 for v in _NUMPY_OPS.values()) for r in res), res
    assert all(r["refused"] == ["UnsupportedError"] * 4 for r in res), res


# ------------------------------------------------------------------------------------ torch


def _torch_values(torch, dtype, rank, n=29):
    i = torch.arange(n, dtype=torch.int64)
    if dtype == torch.bool:
        return (i * 5 + rank * 7) % 3 != 0
    if dtype.is_complex:
        re = ((i * 7 + rank * 3) % 5 - 2).double()
        im = ((i * 3 + rank * 5) % 3 - 1).double()
        return torch.complex(re, im).to(dtype)
    if dtype.is_floating_point:
        return (((i * 7 + rank * 3) % 5) * 0.5).to(dtype)
    return ((i * 7 + rank * 3) % 5 + 1).to(dtype)


def _torch_reference(torch, dtype, op, world):
    vals = [_torch_values(torch, dtype, r) for r in range(world)]
    if dtype == torch.bool:
        stack = torch.stack(vals)
        return stack.any(0) if op in ("SUM", "MAX", "BOR") else stack.all(0)
    wide = torch.stack([v.to(torch.complex128 if dtype.is_complex else torch.float64) for v in vals])
    out = {"SUM": wide.sum(0), "AVG": wide.sum(0) / world, "PROD": wide.prod(0)}.get(op)
    if out is None:
        out = wide.min(0).values if op == "MIN" else wide.max(0).values
    if op == "AVG" and not (dtype.is_floating_point or dtype.is_complex):
        out = torch.div(out, 1, rounding_mode="trunc")
    return out.to(dtype)


def _as_bits(torch, t):
    """A tensor compared exactly: bool as truth values (gloo sums bool bytes as uint8)."""
    if t.dtype == torch.bool:
        return t.view(torch.uint8) != 0
    return t


def case_torch():
    import torch
    import torch.distributed as dist

    import oxcomm.torch  # noqa: F401  (registers "oxcomm")

    torch.set_num_threads(1)
    dist.init_process_group("oxcomm")
    gloo = dist.new_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    Op = dist.ReduceOp
    report = {"gloo": [], "reference": [], "refused": [], "premul": []}
    reducing = {
        torch.bool: ["SUM", "PRODUCT", "MIN", "MAX"],
        torch.int16: ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BXOR"],
        torch.uint16: ["SUM", "PRODUCT", "MIN", "MAX"],
        torch.uint32: ["SUM", "PRODUCT", "MIN", "MAX"],
        torch.uint64: ["SUM", "PRODUCT", "MIN", "MAX"],
        torch.complex64: ["SUM", "AVG"],
        torch.complex128: ["SUM", "AVG"],
    }
    for dtype, ops in reducing.items():
        for name in ops:
            op = getattr(Op, name)
            mine = _torch_values(torch, dtype, rank)
            dist.all_reduce(mine, op=op)
            ref_name = {"PRODUCT": "PROD"}.get(name, name)
            try:
                theirs = _torch_values(torch, dtype, rank)
                dist.all_reduce(theirs, op=op, group=gloo)
                source = "gloo"
            except (RuntimeError, ValueError, TypeError):
                theirs = _torch_reference(torch, dtype, ref_name, world) if name != "BXOR" else None
                source = "reference"
            if theirs is None:
                vals = [_torch_values(torch, dtype, r) for r in range(world)]
                theirs = vals[0]
                for v in vals[1:]:
                    theirs = theirs ^ v
            assert torch.equal(_as_bits(torch, mine), _as_bits(torch, theirs)), (dtype, name, source, mine[:6], theirs[:6])
            if dtype == torch.bool:
                assert set(mine.view(torch.uint8).tolist()) <= {0, 1}, (name, mine.view(torch.uint8)[:8])
            report[source].append(f"{dtype} {name}")
    # Moves, float8 included: broadcast, all_gather, all_to_all, send/recv.
    f8 = [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n)]
    for dtype in [torch.bool, torch.int16, torch.uint16, torch.uint32, torch.uint64, torch.complex64, *f8]:
        x = _torch_values(torch, torch.float32, rank).to(dtype)
        b = x.clone()
        dist.broadcast(b, 0)
        assert torch.equal(b.view(torch.uint8), _torch_values(torch, torch.float32, 0).to(dtype).view(torch.uint8)), dtype
        outs = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(outs, x)
        for r in range(world):
            want = _torch_values(torch, torch.float32, r).to(dtype)
            assert torch.equal(outs[r].view(torch.uint8), want.view(torch.uint8)), (dtype, r)
        if world == 2:
            got = torch.empty_like(x)
            if rank == 0:
                dist.send(x, 1)
            else:
                dist.recv(got, 0)
                want = _torch_values(torch, torch.float32, 0).to(dtype)
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), dtype
        report["reference"].append(f"{dtype} moves")
    # Reducing float8 is refused with the op and the dtype named.
    for dtype in f8[:2]:
        try:
            dist.all_reduce(torch.zeros(4, dtype=dtype))
        except Exception as e:  # noqa: BLE001 - the type is checked below
            assert "is not supported" in str(e) and "f8e" in str(e), str(e)
            report["refused"].append(type(e).__name__)
    # PREMUL_SUM: sum_i(factor * x_i), with a number and with a one-element tensor.
    if not _torch_ranks.premul_sum_exposed():
        t = _torch_values(torch, torch.float32, rank)
        _torch_ranks.refuses_premul_sum(lambda: dist.all_reduce(t, op=dist._make_nccl_premul_sum(2.5)))
        report["premul"] = ["refused (torch hides the factor)"]
    for factor in (2.5, torch.tensor([0.5])) if _torch_ranks.premul_sum_exposed() else ():
        f = float(factor) if not isinstance(factor, torch.Tensor) else float(factor.item())
        vals = [_torch_values(torch, torch.float32, r).double() for r in range(world)]
        want = sum(f * v for v in vals).float()
        t = _torch_values(torch, torch.float32, rank)
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(factor))
        assert torch.equal(t, want), ("all_reduce", factor, t[:6], want[:6])
        t = _torch_values(torch, torch.float32, rank)
        dist.reduce(t, 0, op=dist._make_nccl_premul_sum(factor))
        if rank == 0:
            assert torch.equal(t, want), ("reduce", factor)
        else:
            assert torch.equal(t, _torch_values(torch, torch.float32, rank)), "reduce changed a non-root input"
        inp = torch.cat([_torch_values(torch, torch.float32, rank)] * world)
        before = inp.clone()
        out = torch.empty(29)
        dist.reduce_scatter_tensor(out, inp, op=dist._make_nccl_premul_sum(factor))
        assert torch.equal(out, want), ("reduce_scatter_tensor", factor)
        assert torch.equal(inp, before), "reduce_scatter_tensor changed its input"
        report["premul"].append(type(factor).__name__)
    dist.destroy_process_group()
    return report


def test_torch_backend_new_dtypes_and_premul_sum_2_ranks():
    pytest.importorskip("torch")
    res = _torch_ranks.run(2, "test_dtypes:case_torch", timeout=240)
    for r in res:
        want = ["float", "Tensor"] if _torch_ranks.premul_sum_exposed() else ["refused (torch hides the factor)"]
        assert r["premul"] == want, r
        assert len(r["refused"]) == 2, r
        assert r["gloo"], r  # gloo has bool, int16 and complex (as real views) at least
    print(res[0])

