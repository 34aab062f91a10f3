"""A plain torch.distributed + DDP training script: the same script runs on gloo or on oxcomm.

    torchrun --standalone --nproc-per-node 2 crates/oxcomm-py/examples/ddp_train.py --backend oxcomm
    oxcomm launch -n 2 -- python3 crates/oxcomm-py/examples/ddp_train.py --backend oxcomm

The only oxcomm-specific line is `import oxcomm.torch`, which registers the backend name.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import oxcomm.torch  # noqa: F401  (registers "oxcomm")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="oxcomm")
    p.add_argument("--steps", type=int, default=100)
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(rank)
    w = torch.randn(16, 1, generator=torch.Generator().manual_seed(7))
    for step in range(args.steps):
        x = torch.randn(32, 16, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), x @ w)
        opt.zero_grad()
        loss.backward()
        opt.step()
    mean = torch.tensor([loss.item()])
    dist.all_reduce(mean)
    mean /= dist.get_world_size()
    if rank == 0:
        print(
            f"{args.backend}: loss after {args.steps} steps {mean.item():.5f} (mean over {dist.get_world_size()} ranks)"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
