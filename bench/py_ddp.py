"""DDP training step time of a communication-heavy model on backend "oxcomm" against "gloo", in
the same run: an MLP of about 25 M parameters (--width 2048, --layers 6), a small batch, 2
ranks, one process each.

    python3 bench/py_ddp.py                           # 25 M parameters, 30 timed steps
    python3 bench/py_ddp.py --width 256 --steps 5     # a quick run

Per backend, from the same seed: DDP (default bucketing, default all-reduce) with SGD, --warmup
untimed steps, then --steps timed steps of forward, backward (gradients all-reduced by DDP,
overlapped with the backward pass) and optimizer step. Beside them run the same model without
DDP ("compute": forward, backward and SGD, no communication) and DDP on an oxcomm group whose
all-reduce does nothing ("ddp-noop": DDP's own bucket copies and division by the world size,
no communication), the floor of any backend's DDP step. The four take turns step by step (gloo, oxcomm, ddp-noop, compute, gloo, ...), so the
machine's drift reaches all of them alike. A step's time is the maximum over ranks; rank 0
prints the median, mean and min per row, the oxcomm/gloo ratio of the medians and the
ddp-noop/gloo ratio (the lowest oxcomm/gloo any backend could reach), then checks that both
backends ended with the same parameters (up to summation order). The default group is oxcomm;
gloo runs on `new_group(backend="gloo")`. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def rank_main(args):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import oxcomm.torch  # noqa: F401

    torch.set_num_threads(args.threads)
    dist.init_process_group("oxcomm")
    gloo = dist.new_group(backend="gloo")
    rank = dist.get_rank()

    def model():
        torch.manual_seed(0)
        layers = []
        for _ in range(args.layers):
            layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers[:-1])

    runs = {}
    for name, group in (("gloo", gloo), ("oxcomm", None), ("ddp-noop", _noop_group()), ("compute", None)):
        net = model() if name == "compute" else DDP(model(), process_group=group)
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(args.batch, args.width, generator=gen)
        y = torch.randn(args.batch, args.width, generator=gen)
        runs[name] = (net, torch.optim.SGD(net.parameters(), lr=1e-4), x, y, [])
    for step in range(args.warmup + args.steps):
        for name, (net, opt, x, y, times) in runs.items():
            dist.barrier(group=gloo)
            start = time.perf_counter()
            opt.zero_grad(set_to_none=False)
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
            t = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=gloo)
            if step >= args.warmup:
                times.append(t.item() * 1e3)
    results = {name: run[4] for name, run in runs.items()}
    finals = {name: torch.cat([p.detach().flatten() for p in run[0].parameters()]) for name, run in runs.items()}
    params = finals["gloo"].numel()
    if rank == 0:
        diff = (finals["oxcomm"] - finals["gloo"]).abs().max().item()
        print(
            f"# DDP step, MLP {args.layers} x {args.width} ({params / 1e6:.1f} M parameters, "
            f"{params * 4 / 2**20:.0f} MiB of f32 gradients), batch {args.batch}, {dist.get_world_size()} ranks, "
            f"{args.threads} thread(s) each; host {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}"
        )
        print("%8s %12s %12s %12s" % ("backend", "median(ms)", "mean(ms)", "min(ms)"))
        for name, times in results.items():
            print("%8s %12.2f %12.2f %12.2f" % (name, statistics.median(times), statistics.mean(times), min(times)))
        gloo_median = statistics.median(results["gloo"])
        ratio = statistics.median(results["oxcomm"]) / gloo_median
        floor = statistics.median(results["ddp-noop"]) / gloo_median
        print(f"oxcomm/gloo step time (medians): {ratio:.2f}; max |parameter difference| {diff:.3g}")
        print(f"ddp-noop/gloo (the floor of any backend's ratio on this machine): {floor:.2f}")
    dist.destroy_process_group()


def _noop_group():
    """An oxcomm group whose all_reduce does nothing (a completed Work holding the tensors, as
    DDP's hooks expect): DDP on it costs all DDP does except communicating (its set-up checks
    still run on oxcomm)."""
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import _create_work_from_future

    group = dist.new_group(backend="oxcomm")
    backend = group._get_backend(torch.device("cpu"))

    def allreduce(tensors, opts=None):
        fut = torch.futures.Future()
        fut.set_result(tensors)
        return _create_work_from_future(fut)

    backend.allreduce = allreduce
    return group


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--deadline", type=float, default=1800.0, help="seconds before the ranks are killed")
    p.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_worker:
        return rank_main(args)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from py_spawn import spawn

    spawn(__file__, sys.argv[1:], args.ranks, args.deadline)


if __name__ == "__main__":
    main()
