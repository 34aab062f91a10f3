"""Shrink and go on, from Python: 4 ranks all-reduce step after step, rank 2 is SIGKILLed
at step 20, the other three shrink to a world of 3 and finish every step with the right sum.

    python3 crates/oxcomm-py/examples/shrink_and_go_on.py           # oxcomm.Communicator
    python3 crates/oxcomm-py/examples/shrink_and_go_on.py --torch   # torch.distributed

It starts its own ranks (processes around a torch TCPStore on a free port) because
``oxcomm launch`` and torchrun stop every rank when one dies.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
from datetime import timedelta

import numpy as np

STEPS, KILL_AT, VICTIM = 50, 20, 2


def with_communicator(rank, world, port):
    import torch.distributed as dist

    import oxcomm

    store = dist.TCPStore("127.0.0.1", port, world, False, timedelta(seconds=60))
    comm = oxcomm.Communicator.from_store(store, rank, world, timeout=60)
    step = 0
    while step < STEPS:
        if rank == VICTIM and step == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        x = np.full(1024, step, dtype=np.float32)
        try:
            comm.all_reduce(x)
        except oxcomm.OxcommError as e:
            old, comm = comm, comm.shrink()  # the survivors agree on who failed
            print(f"rank {rank}: step {step}: {type(e).__name__}; without ranks {old.failed_ranks()}", flush=True)
            # A step may have completed on some survivors only: go on from the earliest.
            s = np.array([step], dtype=np.int64)
            comm.all_reduce(s, oxcomm.ReduceOp.MIN)
            step = int(s[0])
            continue
        assert x[0] == step * comm.size
        step += 1
    print(f"rank {rank}: done as rank {comm.rank} of {comm.size}", flush=True)


def with_torch(rank, world, port):
    import torch
    import torch.distributed as dist

    import oxcomm
    import oxcomm.torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # the parent serves the store
    dist.init_process_group("oxcomm", timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    while step < STEPS:
        if rank == VICTIM and step == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        try:
            # Gradients averaged by hand: a DDP whose own all-reduce fails cannot go on
            # (see the README); DDP built on the shrunk group afterwards works.
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        except oxcomm.OxcommError as e:
            print(f"rank {rank}: step {step}: {type(e).__name__}; shrinking", flush=True)
            oxcomm.torch.shrink_group()  # a new default group of the survivors
            continue  # (a real job also agrees on the step and reloads state, as torchft does)
        opt.step()
        step += 1
    print(f"rank {rank}: done as rank {dist.get_rank()} of {dist.get_world_size()}", flush=True)


def main():
    import torch.distributed as dist

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--torch", action="store_true", help="torch.distributed instead of oxcomm.Communicator")
    args = p.parse_args()
    world = 4
    store = dist.TCPStore("127.0.0.1", 0, world, True, timedelta(seconds=60), wait_for_workers=False)
    ctx = mp.get_context("spawn")
    target = with_torch if args.torch else with_communicator
    procs = [ctx.Process(target=target, args=(r, world, store.port)) for r in range(world)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
        if proc.is_alive():
            proc.kill()
    codes = [proc.exitcode for proc in procs]
    print("exit codes:", codes)
    ok = all(c == 0 for r, c in enumerate(codes) if r != VICTIM) and codes[VICTIM] == -signal.SIGKILL
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
