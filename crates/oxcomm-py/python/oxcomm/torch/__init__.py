"""The ``torch.distributed`` backend ``"oxcomm"``, and the 1-bit optimizers.

Importing this package registers the backend name ``"oxcomm"`` with
``torch.distributed.Backend.register_backend``, so that a training script runs on oxcomm by
changing one word::

    import oxcomm.torch  # noqa: F401  (registers "oxcomm")
    torch.distributed.init_process_group("oxcomm")   # under torchrun or `oxcomm launch`

With the package installed the import is not needed on torch 2.15: its entry point (in torch's
``torch.distributed.backends`` group, :mod:`oxcomm._entry_points`) imports this package the
first time torch is asked for the backend.

The backend is registered for ``cpu`` and ``cuda``: ``init_process_group("oxcomm")`` serves CPU
and CUDA tensors (CUDA ones staged through pinned host memory with NCCL's stream semantics, see
:mod:`oxcomm._cuda`), and a spec that mixes backends (``"cpu:gloo,cuda:oxcomm"``,
``"cpu:oxcomm,cuda:nccl"``) routes each device to its own, where torch can host a Python backend
beside another one (:func:`~.process_group.python_backends_supported`; where it cannot, such a
spec is refused with an error that says so).

Rendezvous goes through the store torch hands the backend (the group's ``PrefixStore``), so
no second port or token is needed. The default group builds its communicator with
:meth:`oxcomm.Communicator.from_store`; a group from ``new_group`` is carved out of the
default group's links with ``comm.group(global_ranks)``, which only the members call, as
torch requires. When the default group is not oxcomm (``init_process_group("gloo")`` then
``new_group(backend="oxcomm")``) the members rendezvous on the new group's own store.

The package is split by question: :mod:`.process_group` holds the group classes torch builds
(its docstring lists the modules its calls are split into), :mod:`.work` completes async ops, :mod:`.rendezvous` serves ``env://`` under
``oxcomm launch``; this file builds groups and registers the backend. The optimizers
(:class:`OnebitAdam`, :class:`OnebitLamb`, :class:`ZeroOneAdam`) live in :mod:`oxcomm.optim`
and are re-exported here.
"""

from __future__ import annotations

import sys
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

import oxcomm

from .process_group import BACKEND, BackendOxcomm, ProcessGroupOxcomm, python_backends_supported
from .rendezvous import QuietStore, wrap_env_rendezvous
from .work import _DONE  # noqa: F401  (bench/py_allreduce.py times the bare path with it)

__all__ = ["ProcessGroupOxcomm", "OnebitAdam", "OnebitLamb", "ZeroOneAdam", "communicator", "BACKEND"]

# The communicator of the default group when it is an oxcomm group (global rank == its rank).
_world_comm = None

# Optimizers are imported on first use: oxcomm.optim imports this package for `communicator`.
_OPTIMIZERS = ("OnebitAdam", "OnebitLamb", "ZeroOneAdam")


def __getattr__(name):
    if name in _OPTIMIZERS:
        import oxcomm.optim

        return getattr(oxcomm.optim, name)
    raise AttributeError(f"module 'oxcomm.torch' has no attribute {name!r}")


def communicator(group=None):
    """The :class:`oxcomm.Communicator` behind a torch process group built with backend
    ``"oxcomm"`` (the default group when ``group`` is None); ``None`` on a rank outside the
    group. ``ValueError`` if the group is not an oxcomm group."""
    if group is None:
        group = dist.distributed_c10d._get_default_group()
    if group == dist.GroupMember.NON_GROUP_MEMBER:
        return None
    if isinstance(group, ProcessGroupOxcomm):
        return group.comm
    for device in ("cpu", "cuda"):
        try:
            backend = group._get_backend(torch.device(device))
        except RuntimeError:
            continue
        if isinstance(backend, (ProcessGroupOxcomm, BackendOxcomm)):
            return backend.comm
    raise ValueError(f"oxcomm: no device of the group has backend 'oxcomm' (it is {dist.get_backend(group)!r})")


def _create(dist_opts, backend_options):
    """The creator torch calls on every member of a new oxcomm group (extended API)."""
    global _world_comm
    rank, size = dist_opts.group_rank, dist_opts.group_size
    timeout = dist_opts.timeout
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    global_ranks = list(dist_opts.global_ranks_in_group)
    store = QuietStore(dist_opts.store)  # set-up's short polls log nothing (see QuietStore)
    comm = None
    if not global_ranks:
        comm = oxcomm.Communicator.from_store(store, rank, size, timeout=seconds)
        _world_comm = comm
        _finalizer_for(comm)
    elif _world_comm is not None and hasattr(_world_comm, "group") and _world_default_is_oxcomm():
        comm = _world_comm.group(global_ranks)
        if comm is not None:
            comm.timeout = seconds  # new_group(timeout=...): this group's, not the world's
    if comm is None:
        comm = oxcomm.Communicator.from_store(store, rank, size, timeout=seconds)
    if comm.rank != rank or comm.size != size:
        raise RuntimeError(
            f"oxcomm: group of global ranks {global_ranks}: torch says rank {rank} of {size}, "
            f"the communicator says {comm.rank} of {comm.size}"
        )
    if _mixed_spec():
        if not python_backends_supported():
            raise RuntimeError(
                f"oxcomm: torch {torch.__version__} cannot run a Python backend beside another one in a "
                "'device:backend' spec (its c10d bindings call the C++ Backend base class); use "
                "init_process_group('oxcomm'), which serves both cpu and cuda"
            )
        return BackendOxcomm(comm, rank, size)
    return ProcessGroupOxcomm(comm, rank, size)


def _mixed_spec():
    """Whether the group being built gives some device a backend other than oxcomm. torch does
    not tell the creator; its group builder (the caller, a frame or two up) holds the parsed
    spec in ``backend_config``. Not found: treated as the plain ``"oxcomm"`` spec."""
    frame = sys._getframe(1)
    for _ in range(4):
        frame = frame.f_back
        if frame is None:
            break
        config = frame.f_locals.get("backend_config")
        if config is not None and hasattr(config, "get_device_backend_map"):
            return len(set(config.get_device_backend_map().values())) > 1
    return False


def _world_default_is_oxcomm():
    try:
        return dist.get_backend() == BACKEND
    except (RuntimeError, ValueError):
        return False


def _finalizer_for(comm):
    def forget(_):
        global _world_comm
        _world_comm = None

    try:
        weakref.finalize(comm, forget, None)
    except TypeError:
        pass


def _register():
    if BACKEND.upper() in getattr(dist.Backend, "_plugins", {}):
        return
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
    wrap_env_rendezvous()


_register()

if "deepspeed.comm" in sys.modules and "oxcomm.deepspeed" not in sys.modules:
    # DeepSpeed came first (``import deepspeed; import oxcomm.torch``): take its CPU hot path
    # off its own shm op now, before init_distributed builds that op (see oxcomm.deepspeed,
    # which does it itself when it is the one importing this package).
    from .deepspeed_patch import patch_deepspeed

    patch_deepspeed()
