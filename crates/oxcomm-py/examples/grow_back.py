"""Grow back, from Python: a training loop that survives a rank's death and returns to its
size with a replacement the launcher starts (the Python twin of the Rust example
``crates/oxcomm/examples/ft_grow.rs``).

    FT_DIE_RANK=2 oxcomm launch -n 3 --on-failure restart -- python3 crates/oxcomm-py/examples/grow_back.py

Each step all-reduces ``[1.0] * 4`` and checks every element equals the communicator's size.
Rank ``FT_DIE_RANK`` (none by default) exits with status 17 at step ``FT_DIE_AT`` (30). On an
error the others shrink; when the launcher restarts failed ranks (``OXCOMM_ON_FAILURE=restart``)
they also grow back to the job's size, and the replacement (started with ``OXCOMM_JOIN=1``)
joins them with ``oxcomm.join()``. Rank 0 then broadcasts the step to go on from: the
application's state is the application's to send. Each rank prints
``DONE rank=<r> size=<n> steps=<s>`` at the end; ``FT_STEPS`` (100) steps in all.
"""

import os
import sys

import numpy as np

import oxcomm

STEPS = int(os.environ.get("FT_STEPS", "100"))
DIE_AT = int(os.environ.get("FT_DIE_AT", "30"))
DIE_RANK = int(os.environ.get("FT_DIE_RANK", "-1"))


def main():
    joining = oxcomm.joining()  # OXCOMM_JOIN: this process replaces a rank that failed
    if joining:
        comm = oxcomm.join()  # waits for the members' grow; takes a rank after theirs
        at = np.zeros(1, dtype=np.int64)
        comm.broadcast(at, 0)  # the state, from the members
        step = int(at[0])
        print(f"joined as rank {comm.rank} of {comm.size} at step {step}", file=sys.stderr, flush=True)
    else:
        comm, step = oxcomm.init(), 0
    full, first = comm.size, comm.rank
    restart = os.environ.get("OXCOMM_ON_FAILURE") == "restart"
    while step < STEPS:
        if not joining and first == DIE_RANK and step == DIE_AT:
            print(f"rank {first}: dying at step {step}", file=sys.stderr, flush=True)
            os._exit(17)
        v = np.ones(4, dtype=np.float32)
        try:
            comm.all_reduce(v)
        except oxcomm.OxcommError as e:
            print(f"step {step}: {e}", file=sys.stderr, flush=True)
            small = comm.shrink()  # the survivors
            comm = small.grow(full) if restart else small  # back to full size with the replacement
            at = np.array([step], dtype=np.int64)
            comm.broadcast(at, 0)  # every rank, newcomers too, goes on from rank 0's step
            step = int(at[0])
            continue
        assert (v == comm.size).all(), (comm.rank, step, v)
        step += 1
    comm.barrier()
    print(f"DONE rank={comm.rank} size={comm.size} steps={step}", flush=True)


if __name__ == "__main__":
    main()
