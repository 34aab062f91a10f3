"""``init_method="env://"`` under ``oxcomm launch``: the ranks of a torch script meet on a FileStore.

This module owns one thing: wrapping torch's ``env`` rendezvous handler so that a script
started by ``oxcomm launch`` (whose store torch's TCPStore cannot speak) still rendezvouses.
It knows nothing about process groups.
"""

from __future__ import annotations

import importlib
import os
import tempfile
from datetime import timedelta

import torch.distributed as dist

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
