"""Train a small model with ``deepspeed.initialize`` on CPU ranks over oxcomm.

One command, from the repository root (either launcher)::

    torchrun --standalone --nproc-per-node 2 crates/oxcomm-py/examples/deepspeed_train.py
    oxcomm launch -n 2 -- python3 crates/oxcomm-py/examples/deepspeed_train.py

Options: ``--steps N``; ``--optimizer adam|onebit|lamb|zoadam``, the last three as DeepSpeed's
client optimizer (``deepspeed.initialize(optimizer=...)`` then ``bind_engine``): ``onebit`` is
:class:`oxcomm.torch.OnebitAdam` (exact averaging until ``--freeze-step``, then 1-bit compressed
momenta), ``lamb`` :class:`oxcomm.torch.OnebitLamb` (the same phases, LAMB's layer-wise
coefficients), ``zoadam`` :class:`oxcomm.torch.ZeroOneAdam` (exact variance steps at a doubling
interval until ``--freeze-step``, default half the steps, then local steps synchronized by 1-bit
all-reduces); ``--backend oxcomm|gloo`` (the same script on gloo, for comparison).

The task: regress a fixed random "teacher" MLP's outputs (plus noise) with a student MLP; each
rank trains on its own shard, and rank 0 prints the loss on a held-out set shared by all ranks.
The student uses GELU where the teacher uses ReLU: a ReLU unit that seldom fires leaves
elements with tiny Adam variances, which 1-bit noise divided by their square root throws far
(DeepSpeed's 1-bit optimizers diverge there too). The helpers (``make_model``, ``make_data``,
``batch``, ``evaluate``, ``LR``, ``LAMB_LR``) are imported by the tests.
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
#: LAMB scales each step by ||p|| / ||update|| (0.02 to 0.2 here): this is where exact LAMB does
#: best on this task (of 0.009, 0.02 and 0.03, in 400 steps).
LAMB_LR = 9e-3
DEFAULT_STEPS = 200
NOISE = 0.1


def _mlp(seed, activation):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN),
        activation(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        activation(),
        torch.nn.Linear(HIDDEN, OUT),
    )


def make_model(seed=0):
    """The student: an MLP with GELU."""
    return _mlp(seed, torch.nn.GELU)


@torch.no_grad()
def _teacher_labels(x):
    teacher = _mlp(12345, torch.nn.ReLU)
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


def make_optimizer(name, params, steps, freeze_step=None):
    """The optimizer ``--optimizer name`` picks, with its phases scaled to ``steps``."""
    import oxcomm.torch

    if name == "adam":
        return torch.optim.Adam(params, lr=LR)
    if name == "zoadam":
        return oxcomm.torch.ZeroOneAdam(
            params,
            lr=LR,
            var_freeze_step=freeze_step if freeze_step is not None else steps // 2,
            local_step_scaler=max(1, steps // 10),
            local_step_clipper=4,
        )
    freeze = freeze_step if freeze_step is not None else max(2, steps // 5)
    if name == "lamb":
        return oxcomm.torch.OnebitLamb(params, lr=LAMB_LR, freeze_step=freeze)
    return oxcomm.torch.OnebitAdam(params, lr=LR, freeze_step=freeze)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    p.add_argument("--optimizer", choices=("adam", "onebit", "lamb", "zoadam"), default="adam")
    p.add_argument(
        "--freeze-step",
        type=int,
        default=None,
        help="onebit, lamb: exact warm-up steps (default steps / 5); zoadam: var_freeze_step (default steps / 2)",
    )
    p.add_argument("--backend", choices=("oxcomm", "gloo"), default="oxcomm")
    args = p.parse_args()

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    import deepspeed

    import oxcomm.torch  # noqa: F401  (registers the "oxcomm" backend)

    deepspeed.init_distributed(dist_backend=args.backend, verbose=False)
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()

    model = make_model(seed=0)
    optimizer = make_optimizer(args.optimizer, model.parameters(), args.steps, args.freeze_step)
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "train_batch_size": MICRO_BATCH * world,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 0},
    }
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    if args.optimizer != "adam":
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
