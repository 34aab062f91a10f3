"""Spawning torch ranks for the torch and DeepSpeed tests.

``run(world, "module:function", ...)`` starts ``world`` Python processes with the environment
torchrun gives its workers (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``) and calls ``module.function()`` in each (``module`` is imported from this
directory). The parent owns the job's TCPStore, bound to port 0, and the workers join it as
clients (``TORCHELASTIC_USE_AGENT_STORE``, as under torchrun), so no port is guessed. Every
run has a deadline: on expiry, or when one rank fails, the others are killed and the test
fails with each rank's output. A worker returns a JSON-serialisable value, which ``run``
returns per rank.

This module owns process handling only; what the ranks do is the test's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
RESULT = "@@oxcomm-result@@ "


class RanksFailed(AssertionError):
    pass


def premul_sum_exposed():
    """Whether this torch shows a PREMUL_SUM op's factor to a Python backend (torch 2.15 does;
    2.11 does not, and oxcomm then refuses the op with ``NotImplementedError`` naming it)."""
    import torch.distributed as dist

    return hasattr(dist._make_nccl_premul_sum(2.0), "factor")


def refuses_premul_sum(call):
    """On a torch that hides the factor: ``call()`` raises oxcomm's NotImplementedError."""
    try:
        call()
    except NotImplementedError as e:
        assert "PREMUL_SUM" in str(e), e
        return True
    raise AssertionError("PREMUL_SUM whose factor torch hides was not refused")


def _store(world):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, world, True, timedelta(seconds=60), wait_for_workers=False)


def run(world, target, *, timeout=120.0, env=None, args=(), may_die=()):
    """Run ``target`` ("module:function") on ``world`` ranks; a list of their return values
    (``None`` for a rank in ``may_die`` that was killed, as the test meant it to be)."""
    store = _store(world)
    procs = []
    base = dict(os.environ)
    base.update(
        {
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "OXCOMM_TEST_TARGET": target,
            "OMP_NUM_THREADS": base.get("OMP_NUM_THREADS", "1"),
            "DS_ACCELERATOR": "cpu",
            "PYTHONPATH": os.pathsep.join([HERE, base.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        }
    )
    if env:
        base.update(env)
    try:
        for r in range(world):
            e = dict(base, RANK=str(r), LOCAL_RANK=str(r), GROUP_RANK="0")
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", "import _torch_ranks; _torch_ranks._child()", *args],
                    env=e,
                    cwd=HERE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        outputs = _wait_all(procs, timeout, may_die)
    finally:
        for p in procs:
            _kill(p)
        del store
    failed = [r for r, p in enumerate(procs) if p.returncode != 0 and not (r in may_die and p.returncode < 0)]
    if failed:
        msg = "\n".join(f"--- rank {r} (exit {procs[r].returncode}) ---\n{outputs[r][-6000:]}" for r in range(world))
        raise RanksFailed(f"{target} on {world} ranks: rank(s) {failed} failed\n{msg}")
    results = []
    for r, out in enumerate(outputs):
        if r in may_die and procs[r].returncode < 0:
            results.append(None)
            continue
        line = [ln for ln in out.splitlines() if ln.startswith(RESULT)]
        if not line:
            raise RanksFailed(f"{target}: rank {r} printed no result\n{out[-6000:]}")
        results.append(json.loads(line[-1][len(RESULT) :]))
    return results


def _wait_all(procs, timeout, may_die=()):
    """Read every rank's output until all exit, one fails, or the deadline passes."""
    import selectors

    deadline = time.monotonic() + timeout
    outputs = [b"" for _ in procs]
    sel = selectors.DefaultSelector()
    for i, p in enumerate(procs):
        os.set_blocking(p.stdout.fileno(), False)
        sel.register(p.stdout, selectors.EVENT_READ, i)
    open_streams = len(procs)
    failed_at = None
    while open_streams:
        now = time.monotonic()
        if now > deadline:
            for p in procs:
                _kill(p)
            outputs = [o + b"\n[killed: deadline of %.0f s passed]" % timeout for o in outputs]
            break
        if failed_at is not None and now > failed_at + 5.0:
            for p in procs:
                _kill(p)
        for key, _ in sel.select(timeout=0.2):
            i = key.data
            chunk = key.fileobj.read()
            if chunk:
                outputs[i] += chunk
            elif chunk is not None and chunk == b"":
                sel.unregister(key.fileobj)
                open_streams -= 1
        if failed_at is None and any(
            p.poll() not in (None, 0) and not (r in may_die and p.returncode < 0) for r, p in enumerate(procs)
        ):
            failed_at = time.monotonic()
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill(p)
            p.wait(timeout=5)
    return [o.decode(errors="replace") for o in outputs]


def _kill(p):
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            p.kill()
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def _child():
    import importlib

    # A launcher that runs the suite in the background without job control (`cmd &` in a
    # script, nohup) leaves SIGINT ignored, and Python then installs no KeyboardInterrupt
    # handler: the Ctrl-C tests are about a process where Ctrl-C works, so give it one.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    module, function = os.environ["OXCOMM_TEST_TARGET"].split(":")
    result = getattr(importlib.import_module(module), function)()
    sys.stdout.flush()
    print(RESULT + json.dumps(result), flush=True)
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - teardown only
        pass
    sys.stdout.flush()
    os._exit(0)
