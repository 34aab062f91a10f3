"""DeepSpeed on oxcomm: the 1-bit ``CompressedBackend``, ZeRO++'s quantized reduce-scatter and
``reduce_scatter_coalesced`` with DeepSpeed's argument conventions, ``init_distributed``, and
DeepSpeed's CPU hot path (``inference_all_reduce``) taken off its own shared-memory op.

Importing this module registers the torch backend ``"oxcomm"`` (see :mod:`oxcomm.torch`), so
on a CPU machine::

    import oxcomm.deepspeed  # noqa: F401
    deepspeed.init_distributed(dist_backend="oxcomm")   # DS_ACCELERATOR=cpu

gives a ``deepspeed.comm`` whose functions run on oxcomm (DeepSpeed's comms logger works on
top, as it wraps ``deepspeed.comm``). This module owns the translation between DeepSpeed's
calling conventions (torch tensors, error tensors owned by the optimizer, process groups) and
oxcomm's Python API; the algorithms are oxcomm's (:mod:`oxcomm.onebit`,
:mod:`oxcomm.coalesced`).

DeepSpeed's ``TorchBackend`` builds and initializes its own shared-memory all-reduce op on a
CPU machine, whatever ``dist_backend`` says, and sends ``inference_all_reduce`` (tensor-parallel
inference's all-reduce) there, leaving a ``/dev/shm/deepspeed_allreduce_buffer_*`` segment per
job behind. Importing this module (or :mod:`oxcomm.torch` after ``deepspeed``) wraps that class
once, without touching DeepSpeed's files (:func:`patch_deepspeed`, from
:mod:`oxcomm.torch.deepspeed_patch`): a ``TorchBackend`` whose
CPU backend is oxcomm builds no shm op, and its ``inference_all_reduce`` is an all-reduce on
the group's backend (oxcomm). Any other backend (gloo, nccl, ccl) is left exactly as it was.
"""

from __future__ import annotations


import torch
import torch.distributed as dist

import oxcomm
import oxcomm.torch as oxtorch
from oxcomm.torch.deepspeed_patch import patch_deepspeed
from oxcomm.onebit_torch import CompressedAllreduce

__all__ = [
    "CompressedBackend",
    "reduce_scatter_coalesced",
    "all_to_all_quant_reduce",
    "init_distributed",
    "patch_deepspeed",
]


def init_distributed(**kwargs):
    """``deepspeed.init_distributed(dist_backend="oxcomm", **kwargs)``."""
    import deepspeed

    patch_deepspeed()
    kwargs.setdefault("dist_backend", oxtorch.BACKEND)
    return deepspeed.init_distributed(**kwargs)


def _oxcomm_group(group):
    """(torch group, communicator): ``group`` if it is an oxcomm group; the default group if
    ``group`` is None and the default group is oxcomm; else a new oxcomm group over the same
    ranks (collective over the world, as DeepSpeed's ``new_group`` in these constructors)."""
    try:
        return group, oxtorch.communicator(group)
    except ValueError:
        pass
    ranks = None if group is None else dist.get_process_group_ranks(group)
    side = dist.new_group(ranks=ranks, backend=oxtorch.BACKEND)
    return side, oxtorch.communicator(side)


class CompressedBackend:
    """DeepSpeed's 1-bit compressed all-reduce backend (``NcclBackend``/``CompressedBackend`` of
    ``deepspeed/runtime/comm/`` up to 0.19.4), running oxcomm's 1-bit all-reduce
    (:class:`oxcomm.onebit_torch.CompressedAllreduce`) on CPU and CUDA tensors.

    ``CompressedBackend(mpu=None)``: the group is ``mpu.get_data_parallel_group()`` when an
    ``mpu`` is given; ``group=`` names one directly. Any torch group serves, used as it is:
    an oxcomm group moves the packed bytes on oxcomm, a gloo or nccl group on
    ``torch.distributed`` (the seeds' design: a GPU cluster keeps NCCL as its transport and
    gets the 1-bit algorithm from oxcomm). With neither, the group is the default group when
    that is an oxcomm group (nothing is communicated); otherwise, as DeepSpeed's
    constructor does, a new group over every rank with the default group's backends
    (``dist.new_group(ranks=range(world_size))``: collective, every rank must construct the
    backend). ``rank`` and ``size`` are this rank's and the group's; ``comm`` is the oxcomm
    communicator serving CPU tensors, or None when the group's CPU backend is not oxcomm.
    """

    def __init__(self, mpu=None, group=None):
        if mpu is not None:
            group = mpu.get_data_parallel_group()
        if group is None:
            try:
                oxtorch.communicator(None)
                group = dist.distributed_c10d._get_default_group()
            except ValueError:
                group = dist.new_group(ranks=list(range(dist.get_world_size())))
        self.world_group = group
        self._allreduce = CompressedAllreduce(group)
        self.comm = self._allreduce.comm
        self.rank = self._allreduce.rank
        self.size = self._allreduce.size

    def compressed_allreduce(self, buffer_m, worker_error, server_error, local_rank=0):
        """DeepSpeed's ``compressed_allreduce`` (see
        :meth:`oxcomm.onebit_torch.CompressedAllreduce.__call__`) on CPU or CUDA tensors;
        ``local_rank`` (a device index) is accepted and unused: the tensors' device is used."""
        return self._allreduce(buffer_m, worker_error, server_error)


def _as_tensors(results, like):
    out = []
    for r, t in zip(results, like):
        r = r if isinstance(r, torch.Tensor) else torch.from_numpy(r)
        out.append(r.to(t.dtype) if r.dtype != t.dtype else r)
    return out


@torch.no_grad()
def reduce_scatter_coalesced(tensors, group=None):
    """DeepSpeed's ``reduce_scatter_coalesced(tensors, group)`` on oxcomm: this rank's
    partition of each tensor's **mean** over the group, one 1-D tensor per input.

    Tensor ``t`` of ``L`` elements is cut into ``size`` partitions of ``ceil(L / size)``
    elements (the last ones shorter or empty) and rank ``r`` gets partition ``r``, as in
    DeepSpeed. Floats are divided by ``size`` before the sum, as DeepSpeed does. Inputs are
    not modified (DeepSpeed's divides a lone, evenly split input in place)."""
    _, comm = _oxcomm_group(group)
    for i, t in enumerate(tensors):
        if t.device.type != "cpu":
            raise ValueError(f"reduce_scatter_coalesced: tensors[{i}] is on {t.device}; oxcomm runs on CPU tensors")
    flat = [t.detach().reshape(-1).contiguous() for t in tensors]
    return _as_tensors(oxcomm.coalesced.reduce_scatter_coalesced(comm, flat), tensors)


@torch.no_grad()
def all_to_all_quant_reduce(tensors, groups=None, group=None):
    """ZeRO++'s quantized gradient reduce-scatter (qgZ, DeepSpeed's
    ``all_to_all_quant_reduce(tensors, groups)``) on oxcomm: this rank's partition of each
    tensor's **mean** over the group, int4-quantized on the wire in two all-to-alls (inside
    each host, then across hosts).

    Where DeepSpeed's quantized path returns ``sum / hosts`` (the mean times the ranks per
    host) and its fallback the mean, oxcomm returns the mean on every path. ``groups`` is
    DeepSpeed's dict of ``local_{i}``/``global_{j}`` groups; oxcomm finds the hosts itself
    and uses it only for the number of ranks per host (the size of ``local_0``). 1-D
    tensors and tensors whose size is not a multiple of ``2 × size`` take the exact
    reduce-scatter, as in DeepSpeed."""
    _, comm = _oxcomm_group(group)
    flat = []
    for i, t in enumerate(tensors):
        if t.device.type != "cpu":
            raise ValueError(f"all_to_all_quant_reduce: tensors[{i}] is on {t.device}; oxcomm runs on CPU tensors")
        flat.append(t.detach().contiguous())
    kwargs = {}
    if groups and "local_0" in groups:
        kwargs["ranks_per_host"] = dist.get_world_size(groups["local_0"])
    return _as_tensors(oxcomm.coalesced.all_to_all_quant_reduce(comm, flat, **kwargs), tensors)


patch_deepspeed()
