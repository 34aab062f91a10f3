"""What the ranks of the CUDA tests share: exact data, the two sides of a comparison, and the ways
an async op is completed.

A case is a function ``fn(side, async_op)`` that makes its tensors with ``side.t(values)``, runs
an op and returns the tensors to compare. :func:`check` runs each case twice per way of
completing it: on the *reference* side (host tensors, as on a machine without the device) and on
the *device* side (``_on_device.target()``: CUDA, or the fake device), on a non-default current
stream with the input written by a late kernel and the output read right after the op, and
requires the same values, exactly (integer-valued data: every sum is exact in every dtype used).
"""

from __future__ import annotations

import torch

from _on_device import target

#: The ways an async op is completed before its output is read (``sync``: the blocking call).
FINISHES = ("sync", "wait", "synchronize", "future")


class Cases(dict):
    """name -> case; ``@cases.case(name)`` adds the function below it."""

    def case(self, name):
        def put(fn):
            self[name] = fn
            return fn

        return put


def data(dtype, n, rank, salt=0):
    if dtype.is_floating_point:
        return ((torch.arange(n, dtype=torch.float64) * 7 + rank * 3 + salt) % 5 - 2).to(dtype)
    return ((torch.arange(n, dtype=torch.int64) * 7 + rank * 3 + salt) % 11 - 5).to(dtype)


def done(work, finish):
    """Complete ``work`` (a torch or an oxcomm Work) as ``finish`` says."""
    if work is None or finish == "sync":
        return
    if finish == "wait":
        work.wait()
    elif finish == "synchronize":
        getattr(work, "synchronize", work.wait)()
        assert work.is_completed(), "synchronize returned before the op completed"
    elif finish == "future":
        fut = work.get_future()
        fut.result(timeout=120) if hasattr(fut, "result") else fut.wait()  # concurrent or torch
        assert work.is_completed(), "the future completed before the Work"
    else:
        raise ValueError(finish)


class Side:
    """One run of a case: ``reference`` (host tensors) or on the device."""

    def __init__(self, reference, finish):
        self.reference, self.finish = reference, finish
        self.tg = target()
        self.async_op = finish != "sync"

    def t(self, values):
        return values.clone() if self.reference else self.tg.tensor(values)

    def done(self, work):
        done(work, self.finish if self.async_op else "wait")

    def read(self, outs):
        if self.reference:
            return [o.clone() for o in outs]
        return [self.tg.host(o) for o in outs]


def check(cases, finishes=FINISHES, *, label=""):
    """Every case of ``cases`` (name -> fn(side, async_op)) with each way of completing it,
    device against reference; the names checked."""
    tg = target()
    stream = tg.stream()
    checked = []
    for name, fn in cases.items():
        for finish in finishes:
            a = finish != "sync"
            with tg.reference():
                side = Side(True, finish)
                want = side.read(fn(side, a))
            with tg.on(stream):
                side = Side(False, finish)
                got = side.read(fn(side, a))
            assert len(got) == len(want), (name, len(got), len(want))
            for i, (g, w) in enumerate(zip(got, want)):
                assert g.dtype == w.dtype and g.shape == w.shape, (name, i, g.dtype, w.dtype, g.shape, w.shape)
                assert torch.equal(g, w), (
                    f"{tg.describe()}: {label}{name} {finish} [{i}]: device {g.flatten()[:10].tolist()} "
                    f"!= reference {w.flatten()[:10].tolist()}"
                )
            checked.append(f"{name} {finish}")
    tg.check()
    return checked
