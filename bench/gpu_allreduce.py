"""CUDA all_reduce through the "oxcomm" torch backend against gloo's CUDA all_reduce, 2 ranks
sharing one GPU, with what the staged path is made of measured in the same run.

    python3 bench/gpu_allreduce.py                       # 64 KiB .. 256 MiB on cuda:0
    python3 bench/gpu_allreduce.py --ipc                 # also: CUDA IPC copy vs staged broadcast
    python3 bench/gpu_allreduce.py --device cpu -e 1M    # smoke run without a GPU

The script starts its ranks itself (torchrun's environment; the job's TCPStore is bound to port
0 by this parent and the ranks join it as clients). In each rank the default group is "oxcomm"
(serving cpu and cuda) and a second group is gloo. Per size, f32 sum, every column timed the same
way: -w warm-up calls, a barrier, then n calls back to back, and the device synchronized once at
the end; time = total / n, the maximum over ranks; n moves --bytes-per-run (at least -n, at most
200). Columns:

  gloo      dist.all_reduce of a CUDA tensor on the gloo group (gloo stages through the host)
  oxcomm    dist.all_reduce of a CUDA tensor on the oxcomm group (staged: oxcomm._cuda)
  host      oxcomm's all_reduce of a pinned CPU tensor of the same size (the host collective)
  d2h, h2d  one copy of the tensor device -> pinned host, and back (non_blocking, then a sync)
  staged/parts = oxcomm / (host + d2h + h2d): 1.0 means staging adds nothing to its parts,
            below 1 means the chunked pipeline overlaps them (target: at most 1.3)

busbw = size / time · 2(n−1)/n (GB/s, 1e9 B/s). With --ipc, for each size also: rank 1 copies
rank 0's device buffer into its own through CUDA IPC (torch.multiprocessing's sharing of CUDA
tensors: the peer's device pointer, one device-to-device copy) against dist.broadcast of the same
bytes on the oxcomm group (staged), so that a GPU session can decide whether a direct path pays.
With --device cpu the "CUDA" tensors are CPU tensors and the copies are host copies: it only
proves that the script runs. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import time


def parse_size(raw):
    s = raw.strip().lower().removesuffix("ib").removesuffix("b")
    shift = {"k": 10, "m": 20, "g": 30}.get(s[-1:], 0)
    digits = s[:-1] if shift else s
    if not digits.isdigit():
        raise argparse.ArgumentTypeError(f"{raw!r} is not a size (examples: 64K, 1M, 256M)")
    return int(digits) << shift


def human(n):
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def sizes(args):
    out, size = [], max(args.minbytes, 4)
    while size <= args.maxbytes:
        out.append(size // 4 * 4)
        size *= 2
    return out


def iters_for(args, size):
    return max(args.iters, min(200, args.bytes_per_run // max(size, 1)))


# ------------------------------------------------------------------------------- in a rank


class Rank:
    def __init__(self, args):
        import torch
        import torch.distributed as dist

        import oxcomm.torch  # noqa: F401  (registers "oxcomm")

        self.torch, self.dist, self.args = torch, dist, args
        dist.init_process_group("oxcomm")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.gloo = dist.new_group(backend="gloo")
        self.cuda = args.device == "cuda"
        self.device = torch.device("cuda", 0) if self.cuda else torch.device("cpu")
        if self.cuda:
            torch.cuda.set_device(self.device)
        self.comm = oxcomm.torch.communicator()

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def timed(self, size, fn):
        """Seconds per call of ``fn`` (the maximum over ranks): warm-up, barrier, n calls, one
        device sync at the end."""
        n = iters_for(self.args, size)
        for _ in range(self.args.warmup):
            fn()
        self.sync()
        self.dist.barrier(group=self.gloo)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        self.sync()
        mine = (time.perf_counter() - t0) / n
        t = self.torch.tensor([mine], dtype=self.torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.gloo)
        return t.item()

    def row(self, size):
        torch, dist = self.torch, self.dist
        count = size // 4
        x = torch.ones(count, dtype=torch.float32, device=self.device)
        pinned = torch.ones(count, dtype=torch.float32, pin_memory=self.cuda)
        copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        out = {"size": size}
        out["gloo"] = self.timed(size, lambda: dist.all_reduce(x, group=self.gloo))
        out["oxcomm"] = self.timed(size, lambda: dist.all_reduce(x))
        out["host"] = self.timed(size, lambda: self.comm.all_reduce(pinned))

        def d2h():
            if self.cuda:
                with torch.cuda.stream(copy_stream):
                    pinned.copy_(x, non_blocking=True)
                copy_stream.synchronize()
            else:
                pinned.copy_(x)

        def h2d():
            if self.cuda:
                with torch.cuda.stream(copy_stream):
                    x.copy_(pinned, non_blocking=True)
                copy_stream.synchronize()
            else:
                x.copy_(pinned)

        out["d2h"] = self.timed(size, d2h)
        out["h2d"] = self.timed(size, h2d)
        # the answer is right (every element the sum of the ranks' values) after all that
        y = torch.full((count,), float(self.rank + 1), device=self.device)
        dist.all_reduce(y)
        self.sync()
        want = self.world * (self.world + 1) / 2
        out["wrong"] = int((y != want).sum().item())
        if self.args.ipc:
            out.update(self.ipc(size))
        return out

    def ipc(self, size):
        """Rank 1 copies rank 0's buffer through CUDA IPC, against the staged broadcast."""
        torch, dist = self.torch, self.dist
        count = size // 4
        mine = torch.full((count,), float(self.rank), device=self.device)
        res = {"bcast": self.timed(size, lambda: dist.broadcast(mine, src=0))}
        if not self.cuda or self.world < 2:
            res["ipc"] = None
            return res
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing  # noqa: F401  (registers the CUDA tensor reducer)

        store = dist.distributed_c10d._get_default_store()
        key = f"gpu_allreduce/ipc/{size}"
        if self.rank == 0:
            store.set(key, bytes(ForkingPickler.dumps(mine)))
        peer = pickle.loads(store.get(key)) if self.rank == 1 else None
        dst = torch.empty_like(mine)

        def pull():
            if self.rank == 1:
                dst.copy_(peer)

        res["ipc"] = self.timed(size, pull)
        if self.rank == 1:
            self.sync()
            assert torch.equal(dst, torch.zeros_like(dst)), "IPC copy: wrong bytes"
        dist.barrier(group=self.gloo)  # rank 0 keeps its buffer alive until rank 1 is done
        peer = None  # rank 1 drops its mapping of rank 0's buffer
        return res


def child(args):
    r = Rank(args)
    rows = [r.row(size) for size in sizes(args)]
    if r.rank == 0:
        print("@@rows@@ " + json.dumps(rows), flush=True)
    r.dist.destroy_process_group()


# ------------------------------------------------------------------------------- the parent


def busbw(size, seconds, world):
    return size / seconds * 2 * (world - 1) / world / 1e9 if seconds else 0.0


def report(rows, args):
    n = args.world
    print(f"# gpu_allreduce: {n} ranks on {args.device}, f32 sum; times in µs (max over ranks), busbw in GB/s")
    head = ("size", "gloo us", "busbw", "oxcomm us", "busbw", "ox/gloo")
    head += ("host us", "d2h us", "h2d us", "staged/parts", "#wrong")
    fmt = "%9s %10s %7s %10s %7s %8s %9s %8s %8s %12s %6s"
    if args.ipc:
        head += ("bcast us", "ipc us", "ipc/bcast")
        fmt += " %9s %8s %9s"
    print(fmt % head)
    gains, parts = [], []
    for r in rows:
        size = r["size"]
        g, o = busbw(size, r["gloo"], n), busbw(size, r["oxcomm"], n)
        ratio = o / g if g else 0.0
        staged = r["oxcomm"] / (r["host"] + r["d2h"] + r["h2d"])
        if size >= 1 << 20:
            gains.append((ratio, size))
            parts.append((staged, size))
        cols = (
            human(size),
            f"{r['gloo'] * 1e6:.1f}",
            f"{g:.2f}",
            f"{r['oxcomm'] * 1e6:.1f}",
            f"{o:.2f}",
            f"{ratio:.2f}",
            f"{r['host'] * 1e6:.1f}",
            f"{r['d2h'] * 1e6:.1f}",
            f"{r['h2d'] * 1e6:.1f}",
            f"{staged:.2f}",
            str(r["wrong"]),
        )
        if args.ipc:
            ipc = r.get("ipc")
            cols += (
                f"{r['bcast'] * 1e6:.1f}",
                "n/a" if ipc is None else f"{ipc * 1e6:.1f}",
                "n/a" if ipc is None else f"{ipc / r['bcast']:.2f}",
            )
        print(fmt % cols)
    wrong = sum(r["wrong"] for r in rows)
    if gains:
        worst_gain = min(gains)
        worst_parts = max(parts)
        print(
            f"# gpu_allreduce summary ({args.device}, {n} ranks): from 1 MiB, oxcomm/gloo busbw >= "
            f"{worst_gain[0]:.2f} (lowest at {human(worst_gain[1])}; target 1.5), staged/(host + d2h + h2d) <= "
            f"{worst_parts[0]:.2f} (highest at {human(worst_parts[1])}; target 1.3), wrong elements {wrong}"
        )
    else:
        print(f"# gpu_allreduce summary ({args.device}, {n} ranks): no size from 1 MiB; wrong elements {wrong}")
    return 0 if wrong == 0 else 1


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("64K"))
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("256M"))
    p.add_argument("-n", "--iters", type=int, default=5, help="timed calls per size, at least")
    p.add_argument("-w", "--warmup", type=int, default=2)
    p.add_argument("--bytes-per-run", type=parse_size, default=parse_size("1G"))
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--ipc", action="store_true", help="also time a CUDA IPC copy against the staged broadcast")
    p.add_argument("--timeout", type=float, default=540.0, help="seconds before the ranks are killed")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    import gpu_ranks

    rows = gpu_ranks.start(__file__, args, child, args.world, "@@rows@@ ")
    if isinstance(rows, int):
        return rows
    return report(rows, args)


if __name__ == "__main__":
    sys.exit(main())
