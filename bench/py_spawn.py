"""Starting the ranks of a Python benchmark in `bench/` (py_allreduce.py, py_ddp.py).

`spawn(script, argv, world, deadline, env)` runs `python3 script --rank-worker argv...` as
`world` processes with the environment torchrun gives its workers. The job's TCPStore is bound
to port 0 by this parent and the ranks join it as clients (TORCHELASTIC_USE_AGENT_STORE), so no
port is guessed. Ranks still running at the deadline are killed and the run fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta


def spawn(script, argv, world, deadline, env=None):
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world, True, timedelta(seconds=60), wait_for_workers=False)
    base = dict(
        os.environ,
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store.port),
        TORCHELASTIC_USE_AGENT_STORE="True",
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
    )
    base.update(env or {})
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(script), "--rank-worker", *argv],
            env=dict(base, RANK=str(r), LOCAL_RANK=str(r)),
        )
        for r in range(world)
    ]
    end = time.monotonic() + deadline
    try:
        for p in procs:
            p.wait(timeout=max(1.0, end - time.monotonic()))
    except subprocess.TimeoutExpired:
        sys.exit(f"{os.path.basename(script)}: ranks still running after {deadline} s; killed")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        del store
    if any(p.returncode for p in procs):
        sys.exit(f"{os.path.basename(script)}: a rank failed (exit codes {[p.returncode for p in procs]})")
