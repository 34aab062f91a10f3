"""torch.distributed.all_reduce of f32 tensors on backend "oxcomm" against "gloo" in the same
run (2 ranks, one process each), beside oxcomm's own Rust figure (`oxcomm bench`).

    python3 bench/py_allreduce.py                     # 8 B .. 256 MiB
    python3 bench/py_allreduce.py -b 8 -e 1M -n 5     # a quick run

The script starts its ranks itself (the environment torchrun gives; the job's TCPStore is bound
to port 0 by this parent and the ranks join it as clients) and then runs `oxcomm bench --op
all_reduce` with the same sizes and iteration counts (built with cargo unless OXCOMM names a
binary; --no-rust skips it). Both backends see the same tensors, in the same process group
world: the default group is oxcomm, the gloo group is `new_group(backend="gloo")`.

Method (as oxcomm bench): per size, a barrier, -w warm-up calls, a barrier, then n calls back
to back, timed as a whole; time = total / n, the maximum over ranks. Sizes below 64 KiB run
--small-iters calls after --small-warmup; from 64 KiB, n is enough calls to move
--bytes-per-run (at least -n, at most 1000). The Rust figure is `oxcomm bench` at each size with
the same n and warm-up. Within a run, per size: gloo, then oxcomm through torch, oxcomm's own
Python Communicator ("native") and the floor take turns --rounds times (median of each). The
torch run and the Rust run alternate --repeats times and each column is the median over
repeats, so the machine's drift reaches both alike.
busbw = size / time · 2(n−1)/n (GB/s, 1e9 B/s). One row per size: the time and busbw of gloo,
of oxcomm through torch and of oxcomm in Rust, then gloo/oxcomm latency, oxcomm/gloo busbw
and torch/Rust time. A benchmark, not a test: the machine's load moves its figures.
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


def parse_size(raw):
    s = raw.strip().lower().removesuffix("ib").removesuffix("b")
    shift = {"k": 10, "m": 20, "g": 30}.get(s[-1:], 0)
    digits = s[:-1] if shift else s
    if not digits.isdigit():
        raise argparse.ArgumentTypeError(f"{raw!r} is not a size (examples: 8, 1K, 64M)")
    return int(digits) << shift


def sizes(args):
    out, size = [], max(args.minbytes, 4)
    while size <= args.maxbytes:
        out.append(size // 4 * 4)
        size *= 2
    return out


def iters_for(args, size):
    """(timed calls, warm-up calls) at ``size``: from 64 KiB, enough calls to move --bytes-per-run
    (a run of 20 calls of 1 MiB lasts ~2 ms, where one scheduler hiccup is a 10% error)."""
    if size < 65536:
        return args.small_iters, args.small_warmup
    return max(args.iters, min(1000, args.bytes_per_run // size)), args.warmup


# ------------------------------------------------------------------------------------- a rank


def rank_main(args):
    import torch
    import torch.distributed as dist

    import oxcomm.torch

    torch.set_num_threads(1)
    dist.init_process_group("oxcomm")
    gloo = dist.new_group(backend="gloo")
    floor = _noop_group()
    native = oxcomm.torch.communicator(None)  # the binding without torch.distributed
    n = dist.get_world_size()
    rows = []
    for size in sizes(args):
        # A tensor per size, as oxcomm bench allocates per size: slices of one 256 MiB tensor
        # made every 1 MiB all-reduce in the process ~30% slower on this VM (70 -> 95 us, even
        # on a separate 1 MiB tensor), so the comparison would not be like for like.
        t = torch.ones(size // 4, dtype=torch.float32)
        iters, warmup = iters_for(args, size)
        row = {"size": size}
        calls = {
            "gloo": lambda: dist.all_reduce(t, group=gloo),
            "oxcomm": lambda: dist.all_reduce(t),
            "native": lambda: native.all_reduce(t),
            "floor": lambda: dist.all_reduce(t, group=floor),
        }
        # gloo once, then oxcomm, native and floor taking turns --rounds times, the median of
        # each: on this VM the run right after gloo's is up to a third slower, whichever op it is
        # (measured with native first), and the median leaves that run out.
        times = {name: [] for name in calls}
        for name in ["gloo"] + ["oxcomm", "native", "floor"] * max(1, args.rounds):
            call = calls[name]
            dist.barrier(group=gloo)
            for _ in range(warmup):
                call()
            dist.barrier(group=gloo)
            start = time.perf_counter()
            for _ in range(iters):
                call()
            us = torch.tensor([(time.perf_counter() - start) * 1e6 / iters], dtype=torch.float64)
            dist.all_reduce(us, op=dist.ReduceOp.MAX, group=gloo)
            times[name].append(us.item())
        for name, got in times.items():
            row[name] = statistics.median(got)
        # check: small integers whose sum is exact
        t.copy_(torch.arange(t.numel(), dtype=torch.float32) % 7 + dist.get_rank())
        want = (torch.arange(t.numel(), dtype=torch.float32) % 7) * n + sum(range(n))
        dist.all_reduce(t)
        row["wrong"] = int((t != want).sum().item())
        t.fill_(1.0)
        rows.append(row)
    if dist.get_rank() == 0:
        with open(os.environ["PY_ALLREDUCE_OUT"], "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def _noop_group():
    """A torch group whose all_reduce does nothing and returns a completed Work: the cost of
    torch.distributed's Python path and of a Python backend's call, which bounds any Python
    backend's small-message latency from below."""
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


# ----------------------------------------------------------------------------------- the parent


def rust_figures(args):
    """{size: time_us} from `oxcomm bench --op all_reduce` (in-place rows), one invocation per
    size with the same calls and warm-up as the torch run."""
    binary = os.environ.get("OXCOMM")
    if not binary:
        subprocess.run(["cargo", "build", "--release", "-q", "-p", "oxcomm-cli"], cwd=ROOT, check=True)
        target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
        binary = os.path.join(target, "release", "oxcomm")
    out = {}
    for size in sizes(args):
        iters, warmup = iters_for(args, size)
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [binary, "bench", "--quiet", "--world-size", str(args.ranks), "--op", "all_reduce", "--dtype", "f32"]
            cmd += ["--redop", "sum", "-b", str(size), "-e", str(size), "-n", str(iters), "-w", str(warmup)]
            subprocess.run(cmd + ["--json", f.name], check=True, timeout=args.deadline)
            with open(f.name) as rows:
                lines = rows.read().splitlines()
            for line in lines:
                if line.strip():
                    r = json.loads(line)
                    if r.get("in_place"):
                        out[r["size_bytes"]] = r["time_us"]
    return out


def torch_figures(args):
    """The ranks' rows (see rank_main), from one spawn of --ranks processes."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from py_spawn import spawn

        spawn(__file__, sys.argv[1:], args.ranks, args.deadline, {"PY_ALLREDUCE_OUT": f.name})
        with open(f.name) as fh:
            return json.load(fh)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-b", "--minbytes", type=parse_size, default=8)
    p.add_argument("-e", "--maxbytes", type=parse_size, default=256 << 20)
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("-w", "--warmup", type=int, default=5)
    p.add_argument("--small-iters", type=int, default=2000)
    p.add_argument("--small-warmup", type=int, default=200)
    p.add_argument("--bytes-per-run", type=parse_size, default=256 << 20, help="from 64 KiB: calls per timed run")
    p.add_argument("--repeats", type=int, default=3, help="torch and Rust runs, alternating; medians are shown")
    p.add_argument("--rounds", type=int, default=3, help="per size and run: turns of oxcomm, native and floor")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--deadline", type=float, default=1800.0, help="seconds before the ranks are killed")
    p.add_argument("--no-rust", action="store_true", help="skip oxcomm bench")
    p.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_worker:
        return rank_main(args)

    # torch, Rust, torch, Rust, ...: the machine's drift reaches both alike; medians per size.
    runs, rust_runs = [], []
    for _ in range(max(1, args.repeats)):
        runs.append(torch_figures(args))
        if not args.no_rust:
            rust_runs.append(rust_figures(args))
    rows = []
    for i, first in enumerate(runs[0]):
        row = {"size": first["size"], "wrong": sum(run[i]["wrong"] for run in runs)}
        for key in ("gloo", "oxcomm", "native", "floor"):
            row[key] = statistics.median(run[i][key] for run in runs)
        rows.append(row)
    rust = {}
    for size in (r["size"] for r in rows):
        got = [run[size] for run in rust_runs if size in run]
        if got:
            rust[size] = statistics.median(got)
    n = args.ranks
    factor = 2 * (n - 1) / n

    def bw(size, us):
        return size / us / 1e3 * factor if us else 0.0

    print(
        f"# torch.distributed.all_reduce f32 sum, {n} ranks, host {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}"
    )
    print(
        f"# time = mean of back-to-back calls (max over ranks), median of {max(1, args.repeats)} alternating "
        "torch/Rust runs; busbw in GB/s; rust = `oxcomm bench` in place, same calls per size"
    )
    print("# floor = dist.all_reduce on a Python backend that does nothing (torch's and a Python backend's own cost)")
    print("# native = the same tensor through oxcomm's Python Communicator, without torch.distributed")
    head = (
        "size(B)",
        "gloo(us)",
        "busbw",
        "oxcomm(us)",
        "busbw",
        "rust(us)",
        "busbw",
        "gloo/ox",
        "ox/gloo bw",
        "torch/rust",
        "floor(us)",
        "native(us)",
        "wrong",
    )
    print("%12s %11s %7s %11s %7s %11s %7s %8s %10s %10s %9s %10s %6s" % head)
    for r in rows:
        s, g, o = r["size"], r["gloo"], r["oxcomm"]
        ru = rust.get(s)
        print(
            "%12d %11.2f %7.3f %11.2f %7.3f %11s %7s %8.1f %10.2f %10s %9.2f %10.2f %6d"
            % (
                s,
                g,
                bw(s, g),
                o,
                bw(s, o),
                f"{ru:.2f}" if ru else "-",
                f"{bw(s, ru):.3f}" if ru else "-",
                g / o,
                bw(s, o) / bw(s, g) if g else 0,
                f"{o / ru:.2f}" if ru else "-",
                r["floor"],
                r["native"],
                r["wrong"],
            )
        )


if __name__ == "__main__":
    main()
