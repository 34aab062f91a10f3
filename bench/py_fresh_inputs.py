"""The data-moving collectives in a loop that rewrites what each rank sends before every op, as
a training step does (new gradients, new parameters), through oxcomm's Python Communicator.

    cargo build --release -p oxcomm-cli
    for sc in 1 0; do OXCOMM_SHM_SINGLE_COPY=$sc target/release/oxcomm launch -n 2 python3 bench/py_fresh_inputs.py; done

nccl-tests-style benchmarks (`oxcomm bench`, bench/vs_openmpi.sh) send the same unchanged
buffer every time, so a reader may find the sender's lines still in its own cache; that
flatters single-copy reads (`process_vm_readv`) below a few MiB. This loop is how the limits
of oxcomm's single copy were chosen (docs/benchmarks.md), and why it is now off by default
(docs/perf_large_fresh.md): run it with single copy on (`OXCOMM_SHM_SINGLE_COPY=1`) and off
(the default), alternating. Each row: µs per iteration (the rewrite and the op,
maximum over ranks) and the rewrite alone on rank 0. Sizes are the whole buffer (all_gather's
output, all_to_all's send buffer, the root's buffer of gather and scatter). A benchmark, not a
test.
"""

import os
import time

import numpy as np
import oxcomm

SIZES = [8 << 10, 32 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]


def ops_for(comm, total):
    """Each op at `total` bytes: (rewrite what this rank sends, run the op)."""
    n, me = comm.size, comm.rank
    count = total // 4
    whole = np.ones(count, np.float32)
    other = np.zeros(count, np.float32)
    mine = np.ones(count // n, np.float32)
    out = np.zeros(count // n, np.float32)
    root_whole = whole if me == 0 else None
    return {
        "broadcast": (lambda: whole.fill(me + 1.0), lambda: comm.broadcast(whole, 0)),
        "all_gather": (
            lambda: mine.fill(me + 1.0),
            lambda: comm.all_gather(mine, whole),
        ),
        "all_to_all": (
            lambda: whole.fill(me + 1.0),
            lambda: comm.all_to_all(whole, other),
        ),
        "gather": (
            lambda: mine.fill(me + 1.0),
            lambda: comm.gather(mine, root_whole, 0),
        ),
        "scatter": (
            lambda: whole.fill(me + 1.0),
            lambda: comm.scatter(root_whole, out, 0),
        ),
    }


def main():
    comm = oxcomm.init()
    rows = []
    for total in SIZES:
        for name, (rewrite, op) in ops_for(comm, total).items():
            iters = max(20, min(2000, (64 << 20) // total))
            for _ in range(10):
                rewrite()
                op()
            comm.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                rewrite()
                op()
            took = np.array([(time.perf_counter() - start) / iters * 1e6])
            comm.all_reduce(took, oxcomm.ReduceOp.MAX)
            start = time.perf_counter()
            for _ in range(iters):
                rewrite()
            alone = (time.perf_counter() - start) / iters * 1e6
            rows.append((name, total, took[0], alone))
    if comm.rank == 0:
        on = "on" if os.environ.get("OXCOMM_SHM_SINGLE_COPY", "").strip() == "1" else "off"
        print(f"# {comm.size} ranks, single copy {on}")
        print(f"# {'op':>10} {'size(B)':>9} {'us/iter':>9} {'rewrite':>8}")
        for name, total, took, alone in rows:
            print(f"{name:>12} {total:>9} {took:9.2f} {alone:8.2f}")


if __name__ == "__main__":
    main()
