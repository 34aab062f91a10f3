"""What confirming a rooted op costs: ``dist.broadcast`` on backend "oxcomm" with the barrier
that follows every rooted call on host tensors (``_Calls._confirmed``: ranks that disagree on
the root fail on every rank instead of keeping different data) and without it, in one run,
the two taking turns round by round.

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/torch_rooted.py
    ... bench/torch_rooted.py --rounds 9 --sizes 8,1048576

Each row: the median over rounds of (total time of -n back-to-back broadcasts after a barrier)
/ n on rank 0, in µs. A benchmark, not a test: the machine's load moves its figures; only the
ratio between the rows of one run means something. Figures: docs/perf_torch_path.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import oxcomm.torch  # noqa: F401  (registers "oxcomm")
from oxcomm.torch import ops


def _unconfirmed(self, start, device=False):
    return start


def _per_call_us(t, n):
    for _ in range(max(n // 10, 10)):
        dist.broadcast(t, 0)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        dist.broadcast(t, 0)
    dist.barrier()
    return (time.perf_counter() - t0) / n * 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--sizes", default="8,1048576", help="bytes per broadcast (f32), comma-separated")
    args = p.parse_args()
    dist.init_process_group("oxcomm")
    confirmed = ops._Calls._confirmed
    variants = (("confirmed", confirmed), ("unconfirmed", _unconfirmed))
    times = {}
    for _ in range(args.rounds):
        for size in (int(s) for s in args.sizes.split(",")):
            t = torch.ones(max(size // 4, 1))
            n = 5000 if size <= 4096 else max(200, 200_000_000 // max(size, 1) // 10)
            for name, fn in variants:
                ops._Calls._confirmed = fn
                times.setdefault((size, name), []).append(_per_call_us(t, n))
    ops._Calls._confirmed = confirmed
    if dist.get_rank() == 0:
        print(f"dist.broadcast, {dist.get_world_size()} ranks, median of {args.rounds} rounds (µs per call)")
        for size in (int(s) for s in args.sizes.split(",")):
            on, off = (statistics.median(times[(size, v)]) for v, _ in variants)
            print(f"{size:>10} B  confirmed {on:9.2f}  unconfirmed {off:9.2f}  ratio {on / off:5.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
