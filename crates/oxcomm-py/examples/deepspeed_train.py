"""Train a small model with ``deepspeed.initialize`` on CPU ranks over oxcomm.

One command, from the repository root (either launcher)::

    torchrun --standalone --nproc-per-node 2 crates/oxcomm-py/examples/deepspeed_train.py
    oxcomm launch -n 2 -- python3 crates/oxcomm-py/examples/deepspeed_train.py

Options: ``--steps N``, ``--optimizer adam|onebit`` (``onebit``: :class:`oxcomm.torch.OnebitAdam`
as DeepSpeed's client optimizer, exact averaging until ``--freeze-step``, then 1-bit compressed
momenta), ``--backend oxcomm|gloo`` (the same script on gloo, for comparison).

The task: regress a fixed random "teacher" MLP's outputs (plus noise) with a student MLP; each
rank trains on its own shard, and rank 0 prints the loss on a held-out set shared by all ranks.
The helpers (``make_model``, ``make_data``, ``batch``, ``evaluate``) are imported by the tests.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

IN, HIDDEN, OUT = 32, 64, 4
MICRO_BATCH = 32
SHARD = 2048
LR = 3e-3
DEFAULT_STEPS = 200
NOISE = 0.1


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, OUT),
    )


@torch.no_grad()
def _teacher_labels(x):
    teacher = make_model(seed=12345)
    return teacher(x) * 3.0


def make_data(rank):
    """This rank's shard: (inputs, noisy teacher outputs)."""
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(SHARD, IN, generator=gen)
    y = _teacher_labels(x) + NOISE * torch.randn(SHARD, OUT, generator=gen)
    return x, y


def batch(data, step):
    x, y = data
    at = (step * MICRO_BATCH) % SHARD
    return x[at : at + MICRO_BATCH], y[at : at + MICRO_BATCH]


@torch.no_grad()
def evaluate(model):
    """Mean squared error on a held-out set (the same on every rank)."""
    gen = torch.Generator().manual_seed(4242)
    x = torch.randn(4096, IN, generator=gen)
    y = _teacher_labels(x) + NOISE * torch.randn(4096, OUT, generator=gen)
    return torch.nn.functional.mse_loss(model(x), y).item()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    p.add_argument("--optimizer", choices=("adam", "onebit"), default="adam")
    p.add_argument("--freeze-step", type=int, default=None, help="OnebitAdam's warm-up steps (default steps / 5)")
    p.add_argument("--backend", choices=("oxcomm", "gloo"), default="oxcomm")
    args = p.parse_args()

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    import deepspeed

    import oxcomm.torch  # noqa: F401  (registers the "oxcomm" backend)

    deepspeed.init_distributed(dist_backend=args.backend, verbose=False)
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()

    model = make_model(seed=0)
    if args.optimizer == "onebit":
        freeze = args.freeze_step if args.freeze_step is not None else max(2, args.steps // 5)
        optimizer = oxcomm.torch.OnebitAdam(model.parameters(), lr=LR, freeze_step=freeze)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "train_batch_size": MICRO_BATCH * world,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 0},
    }
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    if args.optimizer == "onebit":
        optimizer.bind_engine(engine)

    data = make_data(rank)
    start = time.perf_counter()
    for step in range(args.steps):
        x, y = batch(data, step)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        if rank == 0 and (step % 50 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  train loss {loss.item():.4f}", flush=True)
    elapsed = time.perf_counter() - start
    final = evaluate(engine.module)
    if rank == 0:
        print(
            f"final loss {final:.5f} on held-out data after {args.steps} steps "
            f"({args.optimizer}, {args.backend}, {world} ranks, {elapsed / max(1, args.steps) * 1e3:.2f} ms/step)",
            flush=True,
        )
    deepspeed.comm.destroy_process_group()


if __name__ == "__main__":
    main()
