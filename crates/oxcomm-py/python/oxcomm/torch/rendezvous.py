"""How the ranks of a torch script meet: the store oxcomm's set-up talks through, and
``init_method="env://"`` under ``oxcomm launch``.

This module owns two things: :class:`QuietStore`, the view of torch's store that oxcomm's
set-up polls without c10d logging a warning per poll, and wrapping torch's ``env`` rendezvous
handler so that a script started by ``oxcomm launch`` (whose store torch's TCPStore cannot
speak) still rendezvouses on a FileStore. It knows nothing about process groups.
"""

from __future__ import annotations

import importlib
import os
import tempfile
import time
from datetime import timedelta

import torch.distributed as dist

#: A ``wait`` shorter than this is served by polling ``check`` (see :class:`QuietStore`).
QUIET_WAIT_MAX = timedelta(seconds=1)
#: The longest sleep between two ``check`` polls of a short wait.
POLL_MAX_S = 0.01


class QuietStore:
    """A torch store whose short ``wait`` polls ``check`` instead of blocking in c10d.

    oxcomm's set-up waits for its peers' keys in slices of about 50 ms so that it also sees a
    peer's published failure (the Rust ``wait_watching``). On a ``TCPStore`` each slice that
    runs out logs two ``[c10d] waitForInput ... timed out after 49ms`` warnings on stderr: a
    slow peer (DeepSpeed's start-up) filled the user's log with them. Here a wait shorter than
    :data:`QUIET_WAIT_MAX` asks ``check(keys)`` every 1 to 10 ms until its timeout and then
    raises ``DistStoreError("wait timeout ...")`` (what c10d raises, without the log lines);
    a longer wait, and every other method, is the store's own. Keys, values and errors are
    unchanged, so the Rust side cannot tell the difference.
    """

    def __init__(self, store):
        self._store = store

    def __getattr__(self, name):
        return getattr(self._store, name)

    def wait(self, keys, timeout=None):
        if timeout is None or timeout >= QUIET_WAIT_MAX:
            return self._store.wait(keys) if timeout is None else self._store.wait(keys, timeout)
        deadline = time.monotonic() + timeout.total_seconds()
        pause = 0.001
        while not self._store.check(keys):
            left = deadline - time.monotonic()
            if left <= 0:
                ms = int(timeout.total_seconds() * 1000)
                raise dist.DistStoreError(f"wait timeout after {ms}ms, keys: {list(keys)}")
            time.sleep(min(pause, left))
            pause = min(pause * 2, POLL_MAX_S)
        return None


def wrap_env_rendezvous():
    """Make ``init_method="env://"`` (torch's default) work under ``oxcomm launch``.

    That launcher serves oxcomm's own rendezvous store at ``MASTER_ADDR:MASTER_PORT`` (it
    sets ``OXCOMM_STORE=launcher``), which torch's TCPStore cannot speak. On one node the
    ranks then meet on a torch ``FileStore`` named after the job (``OXCOMM_JOB_ID``); a
    multi-node ``oxcomm launch`` of a torch script is refused with a clear error (use
    torchrun). Anywhere else torch's own env:// handler runs unchanged.
    """
    # the module (torch.distributed.rendezvous is also the name of a function)
    rdzv = importlib.import_module("torch.distributed.rendezvous")

    handlers = getattr(rdzv, "_rendezvous_handlers", None)
    original = None if handlers is None else handlers.get("env")
    if original is None or getattr(original, "_oxcomm", False):
        return

    def env_handler(url, timeout=timedelta(minutes=30), **kwargs):
        if os.environ.get("OXCOMM_STORE") != "launcher":
            yield from original(url, timeout=timeout, **kwargs)
            return
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if local != world:
            raise RuntimeError(
                "oxcomm: torch.distributed under a multi-node `oxcomm launch` is not supported "
                "(its store is oxcomm's, not torch's); launch torch scripts across nodes with torchrun"
            )
        job = os.environ.get("OXCOMM_JOB_ID") or os.environ.get("MASTER_PORT", "0")
        path = os.path.join(tempfile.gettempdir(), f"oxcomm-torch-{job}.store")
        store = dist.FileStore(path, world)
        store.set_timeout(timeout)
        yield (store, rank, world)
        raise RuntimeError("oxcomm: unable to perform re-rendezvous under oxcomm launch")

    env_handler._oxcomm = True
    handlers["env"] = env_handler
