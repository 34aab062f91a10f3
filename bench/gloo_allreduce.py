"""torch.distributed's gloo all_reduce, timed and printed like `oxcomm bench --op all_reduce`.

Run it under torchrun (one process per rank, CPU tensors):

    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/gloo_allreduce.py -b 8 -e 256M

Same method as oxcomm bench: f32 sum; per size and mode a barrier, -w warm-up calls, a barrier,
then -n calls back to back, timed as a whole (time = total / n) and one by one (the median);
each is the maximum over ranks. Out-of-place is emulated as oxcomm's is (copy the input to the
output, then the in-place all_reduce, both timed); in-place is all_reduce on the buffer. With
-c 1 each mode is run once more on small integers (rank + 1 + i mod 7) whose sum is exact, and
#wrong counts the elements that differ, summed over ranks. Rank 0 prints the rows in oxcomm's
15 columns: size count type redop root, then time algbw busbw #wrong for out-of-place and for
in-place, then the two medians. algbw = size / time (GB/s, 1e9 B/s); busbw = algbw * 2(n-1)/n.
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist


def parse_size(raw):
    s = raw.strip().lower().removesuffix("ib").removesuffix("b")
    shift = {"k": 10, "m": 20, "g": 30, "t": 40}.get(s[-1:], 0)
    digits = s[:-1] if shift else s
    if not digits.isdigit():
        raise argparse.ArgumentTypeError(f"{raw!r} is not a size (examples: 8, 1K, 64M)")
    return int(digits) << shift


def fmt_us(us):
    if us >= 10000:
        return f"{us:.0f}"
    if us >= 100:
        return f"{us:.1f}"
    return f"{us:.2f}"


def timed(op, warmup, iters):
    """Mean and median time of one call in microseconds, each the maximum over ranks."""
    dist.barrier()
    for _ in range(warmup):
        op()
    dist.barrier()
    each = []
    start = time.perf_counter()
    for _ in range(iters):
        t = time.perf_counter()
        op()
        each.append(time.perf_counter() - t)
    total = time.perf_counter() - start
    stats = torch.tensor([total * 1e6 / iters, statistics.median(each) * 1e6], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    return stats[0].item(), stats[1].item()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-b", "--minbytes", type=parse_size, default=8)
    p.add_argument("-e", "--maxbytes", type=parse_size, default=64 << 20)
    p.add_argument("-f", "--stepfactor", type=int, default=2)
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("-w", "--warmup_iters", type=int, default=5)
    p.add_argument("-c", "--check", type=int, choices=(0, 1), default=1)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    sizes = []
    size = max(args.minbytes, 4)
    while size <= args.maxbytes:
        sizes.append(size // 4 * 4)
        size *= args.stepfactor
    count_max = args.maxbytes // 4
    # Allocated and touched once, at the largest size, as oxcomm bench does.
    inp = torch.ones(count_max, dtype=torch.float32)
    out = torch.zeros(count_max, dtype=torch.float32)
    factor = 2 * (n - 1) / n

    if rank == 0:
        print(
            f"# gloo bench  ranks: {n}  torch: {torch.__version__}  dtype: f32  minBytes: {args.minbytes}  "
            f"maxBytes: {args.maxbytes}  step: {args.stepfactor}(factor)  warmup iters: {args.warmup_iters}  "
            f"iters: {args.iters}  validation: {args.check}"
        )
        print("#       size         count      type   redop    root       time   algbw   busbw  #wrong"
              "       time   algbw   busbw  #wrong    oop_p50    ip_p50")
    wrong_total = 0
    for size in sizes:
        count = size // 4
        i, o = inp[:count], out[:count]

        def oop():
            o.copy_(i)
            dist.all_reduce(o)

        def ip():
            dist.all_reduce(o)

        cols = []
        medians = []
        for op in (oop, ip):
            t, med = timed(op, args.warmup_iters, args.iters)
            wrong = "N/A"
            if args.check:
                idx = torch.arange(count, dtype=torch.int64)
                i.copy_((rank + 1 + idx % 7).to(torch.float32))
                if op is oop:
                    o.fill_(-1.0)
                else:
                    o.copy_(i)
                op()
                expect = (n * (n + 1) // 2 + n * (idx % 7)).to(torch.float32)
                bad = torch.tensor([int((o != expect).sum().item())], dtype=torch.int64)
                dist.all_reduce(bad)
                wrong = int(bad.item())
                wrong_total += wrong
                i.fill_(1.0)
            algbw = size / t / 1e3 if t > 0 else 0.0
            cols.append(f"  {fmt_us(t):>9}  {algbw:6.2f}  {algbw * factor:6.2f}  {wrong:>6}")
            medians.append(med)
        if rank == 0:
            head = f"{size:>12}  {count:>12}  {'f32':>8}  {'sum':>6}  {-1:>6}"
            print(head + "".join(cols) + f"  {fmt_us(medians[0]):>9} {fmt_us(medians[1]):>9}", flush=True)
    if rank == 0:
        print(f"# Out of bounds values : {wrong_total} {'OK' if wrong_total == 0 else 'FAILED'}")
    dist.destroy_process_group()
    raise SystemExit(1 if wrong_total else 0)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
