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

__all__ = [
    "ProcessGroupOxcomm",
    "OnebitAdam",
    "OnebitLamb",
    "ZeroOneAdam",
    "communicator",
    "shrink_group",
    "BACKEND",
]

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


def shrink_group(ranks_to_exclude=None, group=None, shrink_flags=None, pg_options=None):
    """Goes on without the ranks that failed: ``torch.distributed.shrink_group``'s signature,
    with ``ranks_to_exclude`` optional. Every surviving rank of ``group`` (the default group
    when None; an oxcomm group) calls it after an op failed; they agree on who failed
    (:meth:`oxcomm.Communicator.shrink`, on the links the job already has) and get a new
    group of themselves, ranks renumbered in the old order. ``ranks_to_exclude`` None: the
    agreed failed ranks; given, it must equal them (``RuntimeError`` otherwise, after the
    agreement: the old group is revoked either way). As with torch's, the old group is
    destroyed, and shrinking the default group makes the new one the default and destroys
    every other group (make them again from the new world). ``shrink_flags`` and
    ``pg_options`` are accepted and unused.

    Returns the new group: c10d cannot change a group's rank and size in place, so what holds
    the old group (DDP, FSDP2's device mesh, a group made from it) must be built again on the
    new one. Where no rank failed (the group was only revoked), the group keeps its ranks and
    takes the new communicator in place, and the same group is returned.

    torch's own ``torch.distributed.shrink_group`` refuses an oxcomm group: it would wrap
    oxcomm in a group that torch takes for gloo (and DDP's logger then reads it as gloo)."""
    c10d = dist.distributed_c10d
    if group is None:
        group = c10d._get_default_group()
    backend = _oxcomm_backend(group)
    if backend is None:
        raise ValueError(f"oxcomm.torch.shrink_group: not an oxcomm group (backend {dist.get_backend(group)!r})")
    old = backend.comm
    new = old.shrink()
    failed = old.failed_ranks()
    if ranks_to_exclude is not None and sorted(int(r) for r in ranks_to_exclude) != failed:
        raise RuntimeError(
            f"oxcomm.torch.shrink_group: ranks_to_exclude {sorted(ranks_to_exclude)}, but the survivors "
            f"agreed that ranks {failed} failed"
        )
    global _world_comm
    was_world = _world_comm is old
    if not failed:
        backend._setup(new)
        if was_world:
            _world_comm = new
        return group
    is_default = group == c10d._get_default_group()
    if is_default:
        c10d._destroy_all_other_groups(exclude_group=group)
    meta = c10d._extract_group_metadata(group)
    remaining = [g for r, g in enumerate(c10d.get_process_group_ranks(group)) if r not in failed]
    c10d._cleanup_original_group(group, is_default)
    pg = ProcessGroupOxcomm(new, new.rank, new.size)
    pg.setGroupName(meta["new_group_name"])
    pg.setGroupDesc("default:shrunken" if is_default else f"{meta['original_group_name']}:shrunk")
    if is_default:
        c10d._update_default_pg(pg)
    c10d._register_pg_in_world(
        pg=pg,
        backend_name=BACKEND,
        store=meta["store"],
        group_name=meta["new_group_name"],
        backend_config=meta["backend_config"],
        rank_mapping={g: r for r, g in enumerate(remaining)},
    )
    if was_world:
        _world_comm = new
    return pg


def _oxcomm_backend(group):
    """The oxcomm object (group or c10d backend) that serves ``group``'s CPU calls, or None."""
    if isinstance(group, ProcessGroupOxcomm):
        return group
    try:
        backend = group._get_backend(torch.device("cpu"))
    except RuntimeError:
        return None
    return backend if isinstance(backend, (ProcessGroupOxcomm, BackendOxcomm)) else None


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
