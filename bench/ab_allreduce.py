#!/usr/bin/env python3
"""Two oxcomm binaries against each other: `oxcomm bench --transport shm --op all_reduce` (f32
sum, in place) with binary A then binary B, alternating --rounds times, 2 and 4 ranks, 8 B to
256 MiB; prints the median time per size of each and B/A. For "did this change make anything
slower": one invocation of a benchmark per binary moves by up to 1.5× on a shared VM, taking
turns spreads that drift over both. A benchmark, not a test.

    cp target/release/oxcomm /tmp/oxcomm-before   # before the change
    cargo build --release -p oxcomm-cli           # after it
    python3 bench/ab_allreduce.py /tmp/oxcomm-before target/release/oxcomm
"""

import argparse
import json
import statistics
import subprocess
import tempfile

# (first size, last size, timed calls, warm-up calls): small sizes need many calls per timing.
RANGES = [("8", "32K", "2000", "200"), ("64K", "256M", "20", "5")]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a", help="the first binary (before)")
    p.add_argument("b", help="the second binary (after)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ranks", default="2,4")
    args = p.parse_args()
    ranks = [int(n) for n in args.ranks.split(",")]
    times = {}
    for n in ranks:
        for _ in range(args.rounds):
            for name, binary in (("a", args.a), ("b", args.b)):
                for lo, hi, iters, warmup in RANGES:
                    with tempfile.NamedTemporaryFile(suffix=".json") as f:
                        cmd = [binary, "bench", "--quiet", "--transport", "shm", "--world-size", str(n)]
                        cmd += ["--op", "all_reduce", "--dtype", "f32", "--redop", "sum", "-b", lo, "-e", hi]
                        cmd += ["-f", "2", "-n", iters, "-w", warmup, "--json", f.name]
                        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
                        for line in open(f.name):
                            row = json.loads(line) if line.strip() else {}
                            if row.get("in_place"):
                                times.setdefault((n, row["size_bytes"], name), []).append(row["time_us"])
    print(f"# median of {args.rounds} alternating runs; A = {args.a}, B = {args.b}")
    print("%5s %10s %11s %11s %6s" % ("ranks", "size(B)", "A(us)", "B(us)", "B/A"))
    for n in ranks:
        for size in sorted({k[1] for k in times if k[0] == n}):
            a = statistics.median(times[(n, size, "a")])
            b = statistics.median(times[(n, size, "b")])
            print("%5d %10d %11.2f %11.2f %6.2f" % (n, size, a, b, b / a))


if __name__ == "__main__":
    main()
