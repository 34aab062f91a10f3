#!/usr/bin/env python3
"""Two oxcomm binaries against each other: `oxcomm bench --transport shm` (f32, sum where the op
reduces, root 0), op by op, with binary A then binary B, alternating --rounds times, on 2 and 4
ranks; prints the median time per op, size and mode of each and B/A. For "did this change make
anything slower": one invocation of a benchmark per binary moves by up to 1.5x on a shared VM,
taking turns spreads that drift over both. A benchmark, not a test.

    cp target/release/oxcomm /tmp/oxcomm-before   # before the change
    cargo build --release -p oxcomm-cli           # after it
    python3 bench/ab_ops.py /tmp/oxcomm-before target/release/oxcomm
    python3 bench/ab_ops.py A B --ops all_gather,scatter --ranks 2 --max 64M --fresh

Sizes below 64 KiB run 2000 timed calls after 200 warm-up ones, from 64 KiB 20 after 5
(--iters/--warmup change the second pair), as bench/vs_openmpi.sh does. --fresh passes
--fresh-inputs (each call's inputs rewritten, then a barrier, both untimed).

--placement tags every A/B pair with where the host placed the two vCPUs: bench/floor_cma.c
(built with gcc into a temporary folder) measures a cache line's round trip between two pinned
processes before and after the pair; below 60 ns the vCPUs share a core ("smt"), below 180 ns
they are near ("near"), above that far apart ("far"; docs/perf_large_fresh.md). The 2-core
test VM moves between the three within minutes, and each changes the small ops by 1.2-1.5x
and the large ones by up to 8x; a pair whose two probes disagree is dropped. The table then
has one row per placement seen, with the number of pairs.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile

OPS = "all_reduce,all_gather,reduce_scatter,broadcast,reduce,all_to_all,gather,scatter"
SMALL_LIMIT = 65536


def ranges(lo, hi, iters, warmup):
    """(first size, last size, timed calls, warm-up calls): small sizes need many calls per timing."""
    out = []
    if lo < SMALL_LIMIT:
        out.append((lo, min(hi, SMALL_LIMIT // 2), 2000, 200))
    if hi >= SMALL_LIMIT:
        out.append((max(lo, SMALL_LIMIT), hi, iters, warmup))
    return out


def size(text):
    """Bytes from '8', '64K', '256M' (binary units)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def run(binary, n, op, lo, hi, iters, warmup, fresh):
    """One `oxcomm bench` invocation: {(size, in_place): time_us}."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [binary, "bench", "--quiet", "--transport", "shm", "--world-size", str(n), "--op", op]
        cmd += ["--dtype", "f32", "--redop", "sum", "--root", "0", "-b", str(lo), "-e", str(hi)]
        cmd += ["-f", "2", "-n", str(iters), "-w", str(warmup), "--json", f.name]
        if fresh:
            cmd.append("--fresh-inputs")
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        rows = [json.loads(line) for line in open(f.name) if line.strip()]
    return {(r["size_bytes"], bool(r.get("in_place"))): r["time_us"] for r in rows}


def placement_probe():
    """A function that returns the vCPUs' placement now ('smt', 'near', 'far'; see the docs)."""
    out = tempfile.mkdtemp(prefix="ab_ops_probe")
    exe = os.path.join(out, "floor_cma")
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "floor_cma.c")
    subprocess.run(["gcc", "-O2", "-o", exe, src], check=True)

    def probe():
        text = subprocess.run([exe, "1"], env=dict(os.environ, MODES="none"), capture_output=True, text=True).stdout
        ns = int(re.search(r"round trip between the two processes: (\d+) ns", text).group(1))
        return "smt" if ns < 60 else "near" if ns < 180 else "far"

    return probe


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a", help="the first binary (before)")
    p.add_argument("b", help="the second binary (after)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--ops", default="all_reduce", help=f"comma-separated, or 'all' ({OPS})")
    p.add_argument("--min", default="8")
    p.add_argument("--max", default="256M")
    p.add_argument("--iters", type=int, default=20, help="timed calls from 64 KiB")
    p.add_argument("--warmup", type=int, default=5, help="warm-up calls from 64 KiB")
    p.add_argument("--fresh", action="store_true", help="rewrite every call's inputs first")
    p.add_argument("--placement", action="store_true", help="tag each pair with the vCPUs' placement")
    args = p.parse_args()
    probe = placement_probe() if args.placement else (lambda: "-")
    ranks = [int(n) for n in args.ranks.split(",")]
    ops = (OPS if args.ops == "all" else args.ops).split(",")
    spans = ranges(size(args.min), size(args.max), args.iters, args.warmup)
    times = {}
    for n in ranks:
        for op in ops:
            for _ in range(args.rounds):
                before = probe()
                pair = {}
                for name, binary in (("a", args.a), ("b", args.b)):
                    for lo, hi, iters, warmup in spans:
                        for key, t in run(binary, n, op, lo, hi, iters, warmup, args.fresh).items():
                            pair[(n, op) + key + (name,)] = t
                if probe() != before:
                    continue
                for key, t in pair.items():
                    times.setdefault(key + (before,), []).append(t)
    print(f"# median of {args.rounds} alternating runs; A = {args.a}, B = {args.b}" + (", fresh inputs" if args.fresh else ""))
    print("%5s %-14s %10s %5s %5s %11s %11s %6s %11s %11s %6s" % ("ranks", "op", "size(B)", "place", "pairs", "oop A(us)", "B(us)", "B/A", "ip A(us)", "B(us)", "B/A"))
    for n in ranks:
        for op in ops:
            for s in sorted({k[2] for k in times if k[:2] == (n, op)}):
                for place in ("smt", "near", "far", "-"):
                    pairs = len(times.get((n, op, s, False, "a", place), []))
                    if not pairs:
                        continue
                    line = "%5d %-14s %10d %5s %5d" % (n, op, s, place, pairs)
                    for in_place in (False, True):
                        a, b = (times.get((n, op, s, in_place, x, place)) for x in ("a", "b"))
                        if a and b:
                            a, b = statistics.median(a), statistics.median(b)
                            line += " %11.2f %11.2f %6.2f" % (a, b, b / a)
                        else:
                            line += " %11s %11s %6s" % ("-", "-", "-")
                    print(line)


if __name__ == "__main__":
    main()
