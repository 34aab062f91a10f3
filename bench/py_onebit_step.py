"""One rank of bench/py_onebit_links.sh: training steps of an MLP with one of oxcomm's 1-bit
optimizers on oxcomm, or with exact data-parallel Adam (`--optimizer adam`: DDP +
torch.optim.Adam on --backend, gloo by default), all with betas (0.9, --beta2):

* `--optimizer onebit`: oxcomm.torch.OnebitAdam, exact warm-up until --freeze-step, then 1-bit
  compressed momenta;
* `--optimizer lamb`: oxcomm.torch.OnebitLamb, the same phases (lr 10x Adam's: LAMB scales its
  steps by ||p|| / ||update||);
* `--optimizer zoadam`: oxcomm.torch.ZeroOneAdam, variance steps (exact, at an interval doubling
  every 16 of them, 1-bit gradients between) until --freeze-step, then local steps synchronized
  by a 1-bit all-reduce every 1, 2, then 4 steps (the interval doubles every
  --local-step-scaler steps up to --local-step-clipper).

The MLP uses GELU, not ReLU: ReLU units that never fire leave exact zeros in Adam's second
moment, and 1-bit compression gives every element of a momentum the same magnitude, so those
elements get an update of scale/eps and the model diverges (DeepSpeed's own formulas do the same:
its answer is a user-given `exp_avg_mask`). beta2 0.99 and a warm-up of 30 steps give the frozen
second moments time to settle; with beta2 0.999 and a few steps the 1-bit run diverges too.

Run under torchrun (one process per rank); rank 0 prints the median, mean and min time per step
over the --steps timed steps that follow --warmup untimed ones (the warm-up covers 1-bit Adam's
exact phase), each step's time the maximum over ranks, and the last step's loss.

    torchrun --standalone --nproc-per-node 2 bench/py_onebit_step.py --optimizer onebit --steps 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--optimizer", choices=("onebit", "lamb", "zoadam", "adam"), required=True)
    p.add_argument("--backend", default=None, help="default: oxcomm for the 1-bit optimizers, gloo for adam")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=32)
    p.add_argument("--freeze-step", type=int, default=30)
    p.add_argument("--beta2", type=float, default=0.99)
    p.add_argument("--local-step-scaler", type=int, default=4, help="zoadam: local steps per doubling")
    p.add_argument("--local-step-clipper", type=int, default=4, help="zoadam: the longest local-step interval")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()

    import torch
    import torch.distributed as dist

    import oxcomm.torch

    torch.set_num_threads(args.threads)
    backend = args.backend or ("gloo" if args.optimizer == "adam" else "oxcomm")
    dist.init_process_group(backend)
    rank = dist.get_rank()
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers[:-1])
    betas = (0.9, args.beta2)
    net = model
    if args.optimizer == "onebit":
        opt = oxcomm.torch.OnebitAdam(model.parameters(), lr=1e-4, freeze_step=args.freeze_step, betas=betas)
    elif args.optimizer == "lamb":
        opt = oxcomm.torch.OnebitLamb(model.parameters(), lr=1e-3, freeze_step=args.freeze_step, betas=betas)
    elif args.optimizer == "zoadam":
        opt = oxcomm.torch.ZeroOneAdam(
            model.parameters(),
            lr=1e-4,
            betas=betas,
            var_freeze_step=args.freeze_step,
            local_step_scaler=args.local_step_scaler,
            local_step_clipper=args.local_step_clipper,
        )
    else:
        net = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.Adam(net.parameters(), lr=1e-4, betas=(0.9, args.beta2))
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=gen)
    y = torch.randn(args.batch, args.width, generator=gen)
    times = []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        t = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if step >= args.warmup:
            times.append(t.item() * 1e3)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(
            f"{args.optimizer:>7} on {backend:<7} {params / 1e6:5.1f} M params  median {statistics.median(times):9.1f} ms/step"
            f"  mean {statistics.mean(times):9.1f}  min {min(times):9.1f}  (loss {loss.item():.4f}, "
            f"{dist.get_world_size()} ranks, host load {os.getloadavg()[0]:.2f})",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
