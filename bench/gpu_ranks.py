"""Starting the ranks of a GPU benchmark (``gpu_allreduce.py``, ``gpu_runahead.py``): the script
re-run ``world`` times with ``--child`` and torchrun's environment (the job's TCPStore bound to port
0 by this parent, the ranks its clients), a deadline after which every rank is killed, and the
one line of results a rank prints after ``marker``. This module owns process handling only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta


def start(script, args, child, world, marker):
    """A benchmark's ``main`` after parsing: ``--child`` runs ``child(args)`` (a rank) and gives
    0; else, on ``--device cuda`` without CUDA, 2 with a line saying so; else the ranks' results
    (:func:`run`, with ``args.timeout``), or 1 where a rank failed."""
    name = os.path.basename(script).removesuffix(".py")
    if args.child:
        child(args)
        return 0
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print(f"{name}: CUDA is not available (see --device for a run without it)", file=sys.stderr)
            return 2
    rows = run(script, sys.argv[1:], world, args.timeout, marker)
    if rows is None:
        print(f"{name}: a rank failed", file=sys.stderr)
        return 1
    return rows


def run(script, argv, world, timeout, marker):
    """The JSON value printed after ``marker`` by one of the ranks of ``script``, or None after
    printing every rank's output to stderr (a rank failed or the deadline passed)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world, True, timedelta(seconds=60), wait_for_workers=False)
    env = dict(os.environ)
    env.update(
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store.port),
        TORCHELASTIC_USE_AGENT_STORE="True",
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
    )
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(script), "--child", *argv],
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
            cwd=here,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    outputs = []
    deadline = time.monotonic() + timeout
    for pr in procs:
        try:
            out, _ = pr.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = pr.communicate()
            out += f"\n[killed after {timeout:.0f} s]"
        outputs.append(out)
    found = None
    for out in outputs:
        for line in out.splitlines():
            if line.startswith(marker):
                found = json.loads(line[len(marker) :])
    if found is None or any(pr.returncode != 0 for pr in procs):
        for r, out in enumerate(outputs):
            print(f"--- rank {r} (exit {procs[r].returncode}) ---\n{out[-4000:]}", file=sys.stderr)
        return None
    return found
