"""gloo and oxcomm side by side: the same call on a gloo group and on an oxcomm group of one job,
with the same inputs, and the outcomes compared (the torch backend's contract is gloo's).

Used by ``test_torch_forms.py`` (call forms and argument checks), ``test_torch_futures.py``
(what a Work's future and ``result()`` hold) and ``test_torch_ops.py`` (what each call
computes). A test lists its cases with :func:`case`; ``run_cases(cases)`` runs in each rank
(under ``_torch_ranks.run``) and returns the disagreements, which the test requires empty.

A case is ``fn(group, rank, size)``: it makes the call (on ``group``'s object itself, as torch's
process-group tests, DDP hooks and torchft do) and returns what it sees (tensors, lists,
numbers, strings), or raises; it returns :data:`SKIP` on a rank that does not take part. The
outcomes agree when:

- both return: the values are equal (same structure; tensors of the same dtype and shape,
  equal element for element — the inputs are small integers, exact in any order);
- both raise: oxcomm's exception is an instance of gloo's exception's class (oxcomm's
  argument errors are ``RuntimeError`` and ``ValueError`` at once, its empty-list error also a
  ``NotImplementedError``), and an argument error names the rank and the call;
- gloo raises and oxcomm returns: only for a case marked ``lenient`` (oxcomm deliberately
  takes more; the README lists it), whose value is then checked against ``expect``;
- both return different values: only for a case marked ``differs`` (gloo's answer is wrong or
  inconsistent there; the README lists it), whose value is checked against ``expect``;
- gloo returns and oxcomm raises: only for a case marked ``stricter`` (gloo answers without
  checking what oxcomm checks; the README lists it).

A case marked ``gloo=False`` runs on oxcomm alone (gloo crashes the process on it); oxcomm must
raise ``error``.

A case marked ``breaks`` leaves the groups unusable (a timeout): fresh groups follow it. After
every other case both groups must still work (an all-reduce on each).
"""

from __future__ import annotations

import os
import traceback
from datetime import timedelta

SKIP = "skip"


class Case:
    def __init__(
        self,
        name,
        fn,
        lenient=None,
        differs=None,
        stricter=None,
        expect=None,
        breaks=False,
        timeout=10.0,
        error=None,
        where=None,
        gloo=True,
    ):
        self.name, self.fn, self.expect = name, fn, expect
        self.lenient, self.differs, self.stricter = lenient, differs, stricter
        self.breaks, self.timeout, self.error, self.where, self.gloo = breaks, timeout, error, where, gloo


def case(cases, name, **kw):
    """Decorator: add ``fn`` to ``cases`` as case ``name`` (keywords: see :class:`Case`;
    ``lenient``: why oxcomm answers where gloo raises; ``expect(rank, size)``: that answer;
    ``error``: the exception class to require of oxcomm where gloo's is an accident of its
    transport (a store timeout for a rank that does not exist); ``where``: run only on a world
    size for which ``where(size)`` holds)."""

    def add(fn):
        cases.append(Case(name, fn, **kw))
        return fn

    return add


# ------------------------------------------------------------------ what the cases build on


def f(*v):
    """A float32 tensor of ``v``."""
    import torch

    return torch.tensor(v, dtype=torch.float32)


def i64(*v):
    """An int64 tensor of ``v``."""
    import torch

    return torch.tensor(v, dtype=torch.int64)


def opts(name, **fields):
    """c10d's options object ``name`` (``"AllreduceOptions"``, ...) with ``fields`` set."""
    import torch
    import torch.distributed as dist

    cls = getattr(dist, name, None) or getattr(torch._C._distributed_c10d, name)
    o = cls()
    for k, v in fields.items():
        setattr(o, k, v)
    return o


def waited(work, *tensors):
    """``tensors`` once ``work`` completed."""
    work.wait()
    return list(tensors)


# ------------------------------------------------------------------ running the cases


def _groups(timeout):
    import torch.distributed as dist

    t = timedelta(seconds=timeout)
    return dist.new_group(backend="gloo", timeout=t), dist.new_group(backend="oxcomm", timeout=t)


def _outcome(fn, g, rank, n):
    try:
        return ("ok", fn(g, rank, n))
    except Exception as e:  # noqa: BLE001 - the exception is the outcome compared
        return ("err", e)


def same(a, b, where="value"):
    """None when ``a`` and ``b`` are equal as described above, else what differs."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{where}: {type(a).__name__} vs {type(b).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape or a.layout != b.layout:
            return f"{where}: {a.dtype}{tuple(a.shape)} {a.layout} vs {b.dtype}{tuple(b.shape)} {b.layout}"
        if a.layout != torch.strided:
            a, b = a.coalesce().to_dense(), b.coalesce().to_dense()
        if not torch.equal(a, b):
            return f"{where}: {a.flatten()[:8].tolist()} vs {b.flatten()[:8].tolist()}"
        return None
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        if not (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple))):
            return f"{where}: {type(a).__name__} vs {type(b).__name__}"
        if len(a) != len(b):
            return f"{where}: {len(a)} vs {len(b)} items"
        for k, (x, y) in enumerate(zip(a, b)):
            d = same(x, y, f"{where}[{k}]")
            if d:
                return d
        return None
    return None if a == b else f"{where}: {a!r} vs {b!r}"


def _describe(o):
    kind, v = o
    if kind == "err":
        return f"{type(v).__name__}: {str(v).splitlines()[0][:300] if str(v) else ''}"
    return repr(v)[:300]


def _judge(c, gl, ox, rank, n):
    """None when the outcomes agree, else the disagreement."""
    (gk, gv), (ok, ov) = gl, ox
    if gk == "ok" and gv == SKIP:
        return None if ok == "ok" and ov == SKIP else f"oxcomm ran where gloo skipped: {_describe(ox)}"
    if ok == "ok" and ov == SKIP:
        return f"oxcomm skipped where gloo ran: {_describe(gl)}"
    if gk == "ok" and ok == "ok":
        d = same(gv, ov)
        if d and c.differs is not None:
            return _expected(c, ov, rank, n)
        if not d and c.differs is not None:
            return f"marked 'differs' but oxcomm's answer is gloo's: {_describe(ox)}"
        return f"values differ ({d}): gloo {_describe(gl)}, oxcomm {_describe(ox)}" if d else None
    if gk == "ok":
        if c.stricter is None:
            return f"gloo answered {_describe(gl)}, oxcomm raised {_describe(ox)}"
        return None
    if ok == "ok":
        if c.lenient is None:
            return f"gloo raised {_describe(gl)}, oxcomm answered {_describe(ox)}"
        return _expected(c, ov, rank, n)
    want = c.error or type(gv)
    if not isinstance(ov, want):
        return f"gloo raised {_describe(gl)}, oxcomm {_describe(ox)}: not a {want.__name__}"
    import oxcomm

    if isinstance(ov, oxcomm.InvalidArgumentError) and f"rank {rank}" not in str(ov):
        return f"oxcomm's argument error does not name the rank: {_describe(ox)}"
    return None


def _expected(c, value, rank, n):
    if c.expect is None:
        return "no expected value given"
    d = same(value, c.expect(rank, n), "oxcomm's value")
    return f"oxcomm's answer is wrong ({d}): {value!r}"[:600] if d else None


def _usable(g):
    import torch

    t = torch.ones(1)
    try:
        g.allreduce([t]).wait()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e)[:200]}"
    return None if t.item() == g.size() else f"sum {t.item()}"


def run_cases(cases):
    """In a rank: every case on gloo then oxcomm; the disagreements ("name: what")."""
    import torch
    import torch.distributed as dist

    import oxcomm.torch  # noqa: F401  (registers "oxcomm")

    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    only = os.environ.get("OXCOMM_CASE")
    failures, ran = [], []
    groups = {}
    for c in cases:
        if (only and only not in c.name) or (c.where is not None and not c.where(n)):
            continue
        if c.timeout not in groups:
            groups[c.timeout] = _groups(c.timeout)
        gloo, ox = groups[c.timeout]
        try:
            if c.gloo:
                gl = _outcome(c.fn, gloo, rank, n)
            else:
                gl = ("err", (c.error or RuntimeError)("gloo not run"))
            dist.barrier()
            xo = _outcome(c.fn, ox, rank, n)
            dist.barrier()
            bad = _judge(c, gl, xo, rank, n)
        except Exception:  # noqa: BLE001 - a bug in the case itself
            bad = "case failed: " + traceback.format_exc()[-800:]
        if bad:
            failures.append(f"{c.name}: {bad}")
        ran.append(c.name)
        if c.breaks:
            del groups[c.timeout]
            continue
        g_ok, x_ok = _usable(gloo), _usable(ox)
        if g_ok is None and x_ok is not None:
            failures.append(f"{c.name}: gloo's group still works after it, oxcomm's does not ({x_ok})")
        if g_ok is not None or x_ok is not None:
            del groups[c.timeout]
        dist.barrier()
    return {"failures": failures, "ran": ran}


def check(results):
    """In pytest: every rank ran the cases and none disagreed."""
    assert results and all(r["ran"] for r in results), results
    bad = [f"rank {r}: {f}" for r, res in enumerate(results) for f in res["failures"]]
    assert not bad, "oxcomm departs from gloo:\n" + "\n".join(bad)
