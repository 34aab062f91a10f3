"""DeepSpeed's ``TorchBackend`` on oxcomm: no shared-memory op of its own, and its CPU hot path
(``inference_all_reduce``) on the group.

DeepSpeed's ``TorchBackend`` builds and initializes its own shared-memory all-reduce op on a
CPU machine, whatever ``dist_backend`` says, and sends ``inference_all_reduce`` (tensor-parallel
inference's all-reduce) there, leaving a ``/dev/shm/deepspeed_allreduce_buffer_*`` segment per
job behind. :func:`patch_deepspeed` wraps that class once, without touching DeepSpeed's files:
a ``TorchBackend`` whose CPU backend is oxcomm builds no shm op, and its
``inference_all_reduce`` is an all-reduce on the group's backend (oxcomm). Any other backend
(gloo, nccl, ccl) is left exactly as it was.

This module owns only that patch. It lives in the torch backend's package (not in
:mod:`oxcomm.deepspeed`, which builds on this package) because importing :mod:`oxcomm.torch`
after ``deepspeed`` applies it, and imports point down: :mod:`oxcomm.deepspeed` re-exports it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util

import torch.distributed as dist

from .process_group import BACKEND


def _cpu_backend_is_oxcomm(spec):
    """Whether a backend spec (``"oxcomm"``, ``"cpu:oxcomm,cuda:nccl"``, ...) serves CPU
    tensors with oxcomm."""
    if spec is None:
        return False
    spec = str(spec).lower()
    if ":" not in spec:
        return spec == BACKEND
    return f"cpu:{BACKEND}" in [part.strip() for part in spec.split(",")]


def _runs_on_oxcomm(backend):
    """Whether a ``TorchBackend(backend, ...)`` will run CPU collectives on oxcomm: the default
    group's backend once torch.distributed is initialized (DeepSpeed then ignores ``backend``),
    else the one it is about to initialize with."""
    if dist.is_available() and dist.is_initialized():
        return _cpu_backend_is_oxcomm(dist.get_backend())
    return _cpu_backend_is_oxcomm(backend)


def _no_shm_op():
    return None


def patch_deepspeed():
    """Wrap DeepSpeed's ``TorchBackend`` (``deepspeed.comm.torch``) once so that on oxcomm it
    neither builds nor initializes DeepSpeed's shared-memory op and its
    ``inference_all_reduce`` runs on the process group (oxcomm). Idempotent; does nothing
    when DeepSpeed is not installed. Returns whether the wrapper is in place."""
    if importlib.util.find_spec("deepspeed") is None:
        return False
    # (not `import deepspeed.comm.torch as ...`: that reads the attribute `torch` of
    # deepspeed.comm, which is the torch package)
    ds_torch = importlib.import_module("deepspeed.comm.torch")
    cls = ds_torch.TorchBackend
    if getattr(cls, "_oxcomm_patched", False):
        return True
    original_init = cls.__init__
    original_inference = cls.inference_all_reduce

    @functools.wraps(original_init)
    def __init__(self, backend, *args, **kwargs):
        if not _runs_on_oxcomm(backend):
            self._oxcomm = False
            return original_init(self, backend, *args, **kwargs)
        # build_shm_op() is the first thing __init__ does, before the process group exists,
        # and its result gates both the shm op's initialize() (which creates the /dev/shm
        # segment) and inference_all_reduce's use of it.
        build = ds_torch.build_shm_op
        ds_torch.build_shm_op = _no_shm_op
        try:
            original_init(self, backend, *args, **kwargs)
        finally:
            ds_torch.build_shm_op = build
        self._oxcomm = _runs_on_oxcomm(backend)

    @functools.wraps(original_inference)
    def inference_all_reduce(self, tensor, op, group=None):
        if not getattr(self, "_oxcomm", False):
            return original_inference(self, tensor, op, group)
        if dist.get_world_size(group=group) <= 1:
            return tensor
        return dist.all_reduce(tensor, op=self._reduce_op(op), group=group, async_op=False)

    cls.__init__ = __init__
    cls.inference_all_reduce = inference_all_reduce
    cls._oxcomm_patched = True
    return True
