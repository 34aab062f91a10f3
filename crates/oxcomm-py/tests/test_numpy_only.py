"""The package without torch: ``import oxcomm`` loads no torch module, and every op runs on
numpy arrays of every numpy dtype oxcomm takes, on 2 ranks, with exact answers computed by
numpy on every rank's input. The ranks are started by the installed ``oxcomm`` command
(``oxcomm launch -n 2 -- python this_file``), so this also checks the wheel's launcher.

``.ci/numpy_only.sh`` runs this file in a fresh venv with numpy and pytest only and sets
``OXCOMM_EXPECT_NO_TORCH=1``: there torch must not be importable at all. In the full test
environment the same ops run and only the import of torch by oxcomm is checked.
"""

import functools
import importlib.util
import os
import subprocess
import sys

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)

import _cli_script  # noqa: E402 - needs the path above

DTYPES = ["float32", "float64", "float16", "int8", "uint8", "int32", "int64"]
FLOAT_OPS = ["sum", "avg", "prod", "min", "max"]
INT_OPS = ["sum", "prod", "min", "max", "band", "bor", "bxor"]
LENGTH = 5  # odd, so no op's blocks line up with a vector width


def _input(rank, dtype, length=LENGTH):
    """Rank ``rank``'s input: small integers, exact in every dtype and under every op."""
    return np.arange(length, dtype=np.int64).astype(dtype) + (rank + 1)


def _expected(inputs, op, dtype):
    stack = np.stack(inputs)
    if op == "sum":
        return stack.sum(axis=0).astype(dtype)
    if op == "avg":
        return (stack.astype(np.float64).sum(axis=0) / len(inputs)).astype(dtype)
    if op == "prod":
        return stack.prod(axis=0).astype(dtype)
    if op == "min":
        return stack.min(axis=0)
    if op == "max":
        return stack.max(axis=0)
    fn = {"band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}[op]
    return functools.reduce(fn, inputs)


class _Checks:
    """Counts the checks a rank ran; each compares arrays exactly (dtype included)."""

    def __init__(self, rank):
        self.rank = rank
        self.count = 0

    def eq(self, got, want, what):
        got, want = np.asarray(got), np.asarray(want)
        assert got.dtype == want.dtype and np.array_equal(got, want), f"rank {self.rank}: {what}: {got!r} != {want!r}"
        self.count += 1


def _collectives(c, ck, dtype):
    n, r = c.size, c.rank
    ins = [_input(k, dtype) for k in range(n)]
    for op in FLOAT_OPS if dtype.startswith("float") else INT_OPS:
        x = ins[r].copy()
        c.all_reduce(x, op)
        ck.eq(x, _expected(ins, op, dtype), f"all_reduce {dtype} {op}")
        out = np.zeros(LENGTH, dtype)
        c.all_reduce_into(ins[r].copy(), out, op)
        ck.eq(out, _expected(ins, op, dtype), f"all_reduce_into {dtype} {op}")
    total = _expected(ins, "sum", dtype)
    x = ins[r].copy()
    c.reduce(x, 1)
    ck.eq(x, total if r == 1 else ins[r], f"reduce {dtype}")
    out = np.zeros(LENGTH, dtype) if r == 0 else None
    c.reduce_into(ins[r].copy(), out, 0)
    if r == 0:
        ck.eq(out, total, f"reduce_into {dtype}")
    x = ins[r].copy()
    c.broadcast(x, 1)
    ck.eq(x, ins[1], f"broadcast {dtype}")

    gathered = np.concatenate(ins)
    out = np.zeros(n * LENGTH, dtype)
    c.all_gather(ins[r].copy(), out)
    ck.eq(out, gathered, f"all_gather {dtype}")
    buf = np.zeros(n * LENGTH, dtype)
    buf[r * LENGTH : (r + 1) * LENGTH] = ins[r]
    c.all_gather_in_place(buf)
    ck.eq(buf, gathered, f"all_gather_in_place {dtype}")

    big = [_input(k, dtype, n * LENGTH) for k in range(n)]
    block = _expected(big, "sum", dtype)[r * LENGTH : (r + 1) * LENGTH]
    out = np.zeros(LENGTH, dtype)
    c.reduce_scatter(big[r].copy(), out)
    ck.eq(out, block, f"reduce_scatter {dtype}")
    buf = big[r].copy()
    c.reduce_scatter_in_place(buf)
    ck.eq(buf[r * LENGTH : (r + 1) * LENGTH], block, f"reduce_scatter_in_place {dtype}")

    # all_to_all: block j of rank i's send is i * 10 + j (+ the element's index).
    def send_of(i):
        return np.concatenate([np.arange(LENGTH, dtype=np.int64) + i * 10 + j for j in range(n)]).astype(dtype)

    want = np.concatenate([send_of(i)[r * LENGTH : (r + 1) * LENGTH] for i in range(n)])
    out = np.zeros(n * LENGTH, dtype)
    c.all_to_all(send_of(r), out)
    ck.eq(out, want, f"all_to_all {dtype}")
    buf = send_of(r)
    c.all_to_all_in_place(buf)
    ck.eq(buf, want, f"all_to_all_in_place {dtype}")
    # all_to_all_v: rank i sends i + j + 1 elements to rank j.
    sends = [[i + j + 1 for j in range(n)] for i in range(n)]
    send = np.arange(sum(sends[r]), dtype=np.int64).astype(dtype) + r
    recv_counts = [sends[i][r] for i in range(n)]
    out = np.zeros(sum(recv_counts), dtype)
    c.all_to_all_v(send, sends[r], out, recv_counts)
    want = np.concatenate(
        [(np.arange(sum(sends[i]), dtype=np.int64).astype(dtype) + i)[sum(sends[i][:r]) :][: sends[i][r]] for i in range(n)]
    )
    ck.eq(out, want, f"all_to_all_v {dtype}")

    out = np.zeros(n * LENGTH, dtype) if r == 0 else None
    c.gather(ins[r].copy(), out, 0)
    if r == 0:
        ck.eq(out, gathered, f"gather {dtype}")
    buf = np.zeros(n * LENGTH, dtype) if r == 1 else ins[r].copy()
    if r == 1:
        buf[LENGTH:] = ins[1]
    c.gather_in_place(buf, 1)
    if r == 1:
        ck.eq(buf, gathered, f"gather_in_place {dtype}")
    out = np.zeros(LENGTH, dtype)
    c.scatter(gathered.copy() if r == 0 else None, out, 0)
    ck.eq(out, ins[r], f"scatter {dtype}")
    buf = gathered.copy() if r == 1 else np.zeros(LENGTH, dtype)
    c.scatter_in_place(buf, 1)
    ck.eq(buf[r * LENGTH : (r + 1) * LENGTH] if r == 1 else buf, ins[r], f"scatter_in_place {dtype}")

    bufs = [ins[r].copy(), ins[r][:2].copy()]
    c.all_reduce_coalesced(bufs)
    ck.eq(bufs[0], total, f"all_reduce_coalesced[0] {dtype}")
    ck.eq(bufs[1], total[:2], f"all_reduce_coalesced[1] {dtype}")
    outs = [np.zeros(n * LENGTH, dtype), np.zeros(n * 2, dtype)]
    c.all_gather_coalesced([ins[r].copy(), ins[r][:2].copy()], outs)
    ck.eq(outs[0], gathered, f"all_gather_coalesced[0] {dtype}")
    ck.eq(outs[1], np.concatenate([x[:2] for x in ins]), f"all_gather_coalesced[1] {dtype}")

    # Point to point on a ring, blocking and async.
    nxt, prv = (r + 1) % n, (r - 1) % n
    got = np.zeros(LENGTH, dtype)
    if r % 2 == 0:
        c.send(ins[r], nxt, tag=3)
        c.recv(got, prv, tag=3)
    else:
        c.recv(got, prv, tag=3)
        c.send(ins[r], nxt, tag=3)
    ck.eq(got, ins[prv], f"send/recv {dtype}")
    got = np.zeros(LENGTH, dtype)
    works = [c.isend(ins[r], nxt, tag=4), c.irecv(got, prv, tag=4)]
    for w in works:
        assert w.wait(timeout=60.0), f"rank {r}: isend/irecv {dtype} did not finish in 60 s"
    ck.eq(got, ins[prv], f"isend/irecv {dtype}")

    x = ins[r].copy()
    work = c.all_reduce(x, async_op=True)
    assert work.wait(timeout=60.0), f"rank {r}: async all_reduce {dtype} did not finish in 60 s"
    ck.eq(x, total, f"async all_reduce {dtype}")


def _the_rest(c, ck):
    import oxcomm

    n, r = c.size, c.rank
    c.barrier()
    c.monitored_barrier(60.0)
    assert c.barrier(async_op=True).wait(timeout=60.0)
    ck.eq(c.broadcast_object({"from": r}, 1)["from"], 1, "broadcast_object")
    ck.eq([o["r"] for o in c.all_gather_object({"r": r})], list(range(n)), "all_gather_object")

    for sub in (c.new_group(list(range(n))), c.group(list(range(n))), c.split(0, key=-r)):
        x = np.full(3, r + 1, np.int32)
        sub.all_reduce(x)
        ck.eq(x, np.full(3, n * (n + 1) // 2, np.int32), f"all_reduce on a sub-group ({sub.size} ranks)")
    assert c.split(None) is None

    # DeepSpeed's compressed collectives on numpy arrays.
    x = np.full(64, float(r + 1), np.float32)
    state = oxcomm.onebit.State(x.size, c)
    oxcomm.onebit.all_reduce(c, x, state)
    ck.eq(x, np.full(64, (n + 1) / 2, np.float32), "onebit.all_reduce of equal values")
    parts = oxcomm.coalesced.reduce_scatter_coalesced(c, [np.full(10, float(r), np.float32), np.ones(3, np.float32)])
    ck.eq(parts[0], np.full(len(parts[0]), (n - 1) / 2, np.float32), "reduce_scatter_coalesced")
    parts = oxcomm.coalesced.all_to_all_quant_reduce(c, [np.full((4, 8 * n), 1.0 + r, np.float32)])
    # int4 codes: within the documented bound (2/W) · Σ_ranks amax_r / 8 of the mean.
    bound = 2 / n * sum((1.0 + k) / 8 for k in range(n))
    assert parts[0].dtype == np.float32 and parts[0].size > 0, parts[0]
    assert np.abs(parts[0] - (1.0 + (n - 1) / 2)).max() <= bound, parts[0]
    ck.count += 1
    opt = oxcomm.onebit.Adam(lr=0.1, freeze_step=10)
    params = np.ones(16, np.float32)
    for _ in range(3):
        opt.step(c, params, np.full(16, float(r + 1), np.float32))
    # The first call only averages; the next ones move against the (positive) gradient.
    assert opt.steps == 3 and np.all(params < 1.0), (opt.steps, params)
    every = np.zeros(16 * n, np.float32)
    c.all_gather(params, every)
    ck.eq(every, np.tile(params, n), "onebit.Adam keeps every rank's parameters equal")


def rank_main():
    """One rank of the job ``test_ops_on_numpy_arrays`` starts."""
    import oxcomm

    c = oxcomm.init()
    ck = _Checks(c.rank)
    for dtype in DTYPES:
        _collectives(c, ck, dtype)
    _the_rest(c, ck)
    loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
    assert not loaded, f"rank {c.rank}: oxcomm imported torch modules: {loaded[:5]}"
    c.barrier()
    print(f"numpy-only rank {c.rank}: ok, {ck.count} checks", flush=True)


def test_import_oxcomm_loads_no_torch():
    code = "import sys, oxcomm, oxcomm.onebit, oxcomm.coalesced; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
    if os.environ.get("OXCOMM_EXPECT_NO_TORCH") == "1":
        assert importlib.util.find_spec("torch") is None, "torch is installed in the numpy-only environment"


def test_ops_on_numpy_arrays():
    res = _cli_script.run(["launch", "-n", "2", "--", sys.executable, os.path.abspath(__file__)], timeout=240)
    assert res.returncode == 0, f"exit status {res.returncode}\n{res.stdout}\n{res.stderr}"
    for r in range(2):
        assert f"numpy-only rank {r}: ok" in res.stdout, res.stdout


if __name__ == "__main__":
    rank_main()
