"""torch's 8 B all_reduce through backend "oxcomm" against oxcomm's Rust time in the same run,
with each layer in between timed alone and the floors of any Python and any C++ backend.

    python3 bench/torch_small_op.py                  # 2 ranks, 8 B f32, 3 repeats
    python3 bench/torch_small_op.py -n 20000 --repeats 5

Issue 27's target: ``torch`` ≤ 2.5 × ``rust``. The script starts its ranks itself (as
bench/py_allreduce.py: torchrun's environment, the job's TCPStore on port 0 of this parent),
and alternates that spawn with ``oxcomm bench --op all_reduce -b SIZE -e SIZE`` (built with
cargo unless OXCOMM names a binary) --repeats times; every figure is the median over repeats.

Rows, from the bottom layer up (each is a loop of -n back-to-back calls on one tensor after -w
warm-up calls and a barrier; time = total / n, the maximum over ranks; inside one spawn the rows
take turns --rounds times, the median of each):

  rust        `oxcomm bench`: the Rust communicator, no Python
  binding     ``_native.Communicator.all_reduce_at`` with the address read once (PyO3's
              call, the GIL released and taken back, the op): what the group's fast path calls
  native      ``oxcomm.Communicator.all_reduce(t)``: the Python buffer checks added
  group       ``pg.allreduce([t], opts)`` on the oxcomm process group with ``opts`` made once:
              our process group's own cost (no torch.distributed wrapper)
  torch       ``dist.all_reduce(t)``: what a user calls (the target)
  floor_py    ``dist.all_reduce(t)`` on a Python ProcessGroup whose allreduce returns a
              completed Work: torch's wrapper plus a Python backend's call, moving nothing
  floor_cpp   ``dist.all_reduce(t)`` on torch's C++ FakeProcessGroup (moves nothing): torch's
              wrapper plus a C++ backend's call, the floor of a native process group

``--cpu`` runs the rows (and two of torch's own pieces: ``torch_opts``, the option object
``dist.all_reduce`` builds per call; ``read_op``, reading its reduce op) in one process as a world
of 1, timed in thread CPU time: each layer's software cost without a peer, which a loaded
machine moves far less than the wall-clock run. Where the time goes, and the figures:
docs/perf_torch_path.md.

A benchmark, not a test: the machine's load moves its figures (the header prints it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS = ("binding", "native", "group", "torch", "floor_py", "floor_cpp")


def layer_calls(t):
    """{row: a call} over the default (oxcomm) group, for the rows of the module docs."""
    import torch.distributed as dist

    import oxcomm.torch
    from oxcomm._buffers import DTYPE_CODES, buffer

    pg = dist.distributed_c10d._get_default_group()
    comm = oxcomm.torch.communicator(None)
    addr, count, _, _ = buffer(t, "tensor")
    dtype, op = DTYPE_CODES[t.dtype], oxcomm._native.REDUCE_OPS.index("sum")
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    floor_py = _noop_group()
    floor_cpp = _fake_group()
    return {
        "binding": lambda: comm._c.all_reduce_at(addr, count, dtype, op),
        "native": lambda: comm.all_reduce(t),
        "group": lambda: pg.allreduce([t], opts),
        "torch": lambda: dist.all_reduce(t),
        "floor_py": lambda: dist.all_reduce(t, group=floor_py),
        "floor_cpp": lambda: dist.all_reduce(t, group=floor_cpp),
    }


def rank_main(args):
    import torch
    import torch.distributed as dist

    import oxcomm.torch  # noqa: F401  (registers "oxcomm")

    torch.set_num_threads(1)
    dist.init_process_group("oxcomm")
    gloo = dist.new_group(backend="gloo")
    t = torch.ones(args.size // 4, dtype=torch.float32)
    calls = layer_calls(t)
    times = {name: [] for name in calls}
    for _ in range(max(1, args.rounds)):
        for name, call in calls.items():
            dist.barrier(group=gloo)
            for _ in range(args.warmup):
                call()
            dist.barrier(group=gloo)
            start = time.perf_counter()
            for _ in range(args.iters):
                call()
            us = torch.tensor([(time.perf_counter() - start) * 1e6 / args.iters], dtype=torch.float64)
            dist.all_reduce(us, op=dist.ReduceOp.MAX, group=gloo)
            times[name].append(us.item())
    # the sum is exact: small integers
    t.fill_(dist.get_rank() + 1)
    dist.all_reduce(t)
    n = dist.get_world_size()
    wrong = int((t != n * (n + 1) // 2).sum().item())
    if dist.get_rank() == 0:
        with open(os.environ["TORCH_SMALL_OP_OUT"], "w") as f:
            json.dump({**{k: statistics.median(v) for k, v in times.items()}, "wrong": wrong}, f)
    dist.destroy_process_group()


def cpu_main(args):
    """--cpu: every row in this one process, as the only rank of a world of 1, timed in this
    thread's CPU time (a descheduled thread's wait is not counted, so a loaded machine moves
    the figures far less than wall time; no peer to wait for, so this is each layer's software
    cost). Rows take turns --rounds times; the minimum and the median are printed."""
    import torch
    import torch.distributed as dist

    import oxcomm.torch  # noqa: F401  (registers "oxcomm")

    torch.set_num_threads(1)
    dist.init_process_group("oxcomm", store=dist.HashStore(), rank=0, world_size=1)
    t = torch.ones(args.size // 4, dtype=torch.float32)
    calls = layer_calls(t)
    opts = dist.AllreduceOptions()

    def torch_opts():  # what dist.all_reduce builds per call, whatever the backend
        o = dist.AllreduceOptions()
        o.reduceOp = dist.ReduceOp.SUM
        o.asyncOp = False

    calls["torch_opts"] = torch_opts
    calls["read_op"] = lambda: hash(opts.reduceOp)
    times = {name: [] for name in calls}
    for r in range(max(1, args.rounds) + 1):
        for name, call in calls.items():
            for _ in range(args.warmup):
                call()
            start = time.thread_time_ns()
            for _ in range(args.iters):
                call()
            if r:  # the first round warms every row up
                times[name].append((time.thread_time_ns() - start) / args.iters / 1e3)
    rust = [rust_time(args, world=1) for _ in range(max(1, args.repeats))]
    print(
        f"# one process, world size 1, all_reduce {args.size} B f32 sum: thread CPU time per call, "
        f"{args.iters} calls x {max(1, args.rounds)} rounds; rust = `oxcomm bench --world-size 1` (wall, "
        f"median of {len(rust)}); load {os.getloadavg()[0]:.2f}"
    )
    print(f"{'row':10s} {'min us':>8s} {'median':>8s}")
    print(f"{'rust':10s} {min(rust):8.3f} {statistics.median(rust):8.3f}")
    for name, got in times.items():
        print(f"{name:10s} {min(got):8.3f} {statistics.median(got):8.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rust": rust, **times}, f)
    dist.destroy_process_group()


def _noop_group():
    """A Python ProcessGroup whose all_reduce does nothing (the floor of a Python backend)."""
    import torch.distributed as dist

    from oxcomm.torch import _DONE

    class Noop(dist.ProcessGroup):
        def allreduce(self, tensors, opts=None):
            return _DONE

        def getBackendName(self):
            return "noop"

    if "PYNOOP" not in dist.Backend._plugins:
        dist.Backend.register_backend(
            "pynoop", lambda o, _: Noop(o.group_rank, o.group_size), extended_api=True, devices=["cpu"]
        )
    return dist.new_group(backend="pynoop")


def _fake_group():
    """torch's C++ FakeProcessGroup as a group of this world (the floor of a C++ backend)."""
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")

    return dist.new_group(backend="fake")


def rust_time(args, world=None):
    """`oxcomm bench`'s in-place all_reduce time at --size, with the same calls and warm-up."""
    binary = os.environ.get("OXCOMM")
    if not binary:
        subprocess.run(["cargo", "build", "--release", "-q", "-p", "oxcomm-cli"], cwd=ROOT, check=True)
        target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
        binary = os.path.join(target, "release", "oxcomm")
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [binary, "bench", "--quiet", "--world-size", str(world or args.ranks), "--op", "all_reduce"]
        cmd += ["--dtype", "f32", "--redop", "sum", "-b", str(args.size), "-e", str(args.size), "-n", str(args.iters)]
        cmd += ["-w", str(args.warmup), "--json", f.name]
        subprocess.run(cmd, check=True, timeout=args.deadline, stdout=subprocess.DEVNULL)
        with open(f.name) as rows:
            for line in rows.read().splitlines():
                if line.strip():
                    r = json.loads(line)
                    if r.get("in_place"):
                        return r["time_us"]
    raise SystemExit("oxcomm bench printed no in-place row")


def torch_times(args):
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from py_spawn import spawn

        spawn(__file__, sys.argv[1:], args.ranks, args.deadline, {"TORCH_SMALL_OP_OUT": f.name})
        with open(f.name) as fh:
            return json.load(fh)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-s", "--size", type=int, default=8, help="bytes (f32 elements x 4)")
    p.add_argument("-n", "--iters", type=int, default=10000)
    p.add_argument("-w", "--warmup", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3, help="turns of the rows inside one spawn (median)")
    p.add_argument("--repeats", type=int, default=3, help="torch and Rust runs, alternating (median)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--deadline", type=float, default=600.0, help="seconds before the ranks are killed")
    p.add_argument("--json", help="also write the figures here")
    p.add_argument("--cpu", action="store_true", help="one process, world of 1, CPU time per layer")
    p.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_worker:
        return rank_main(args)
    if args.cpu:
        return cpu_main(args)
    load = os.getloadavg()[0]
    runs, rust = [], []
    for _ in range(max(1, args.repeats)):
        runs.append(torch_times(args))
        rust.append(rust_time(args))
    fig = {k: statistics.median(r[k] for r in runs) for k in ROWS}
    fig["rust"] = statistics.median(rust)
    wrong = sum(r["wrong"] for r in runs)
    print(
        f"# all_reduce {args.size} B f32 sum, {args.ranks} ranks, {args.iters} calls per timing, "
        f"median of {max(1, args.repeats)} alternating torch/Rust runs x {max(1, args.rounds)} rounds; "
        f"host {os.cpu_count()} cores, load {load:.2f} -> {os.getloadavg()[0]:.2f}"
    )
    print(f"{'row':10s} {'us':>8s} {'x rust':>8s}")
    for k in ("rust", *ROWS):
        print(f"{k:10s} {fig[k]:8.2f} {fig[k] / fig['rust']:8.2f}")
    ratio = fig["torch"] / fig["rust"]
    print(f"# torch/rust = {ratio:.2f} (target <= 2.5); torch - floor_py = {fig['torch'] - fig['floor_py']:.2f} us ")
    print(f"# wrong elements: {wrong}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**fig, "wrong": wrong, "load": load, "rust_runs": rust, "runs": runs}, f)
    if wrong:
        sys.exit("wrong results")


if __name__ == "__main__":
    main()
