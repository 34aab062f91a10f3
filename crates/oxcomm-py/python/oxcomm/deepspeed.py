"""DeepSpeed on oxcomm: the 1-bit ``CompressedBackend``, ZeRO++'s quantized reduce-scatter and
``reduce_scatter_coalesced`` with DeepSpeed's argument conventions, and ``init_distributed``.

Importing this module registers the torch backend ``"oxcomm"`` (see :mod:`oxcomm.torch`), so
on a CPU machine::

    import oxcomm.deepspeed  # noqa: F401
    deepspeed.init_distributed(dist_backend="oxcomm")   # DS_ACCELERATOR=cpu

gives a ``deepspeed.comm`` whose functions run on oxcomm (DeepSpeed's comms logger works on
top, as it wraps ``deepspeed.comm``). This module owns the translation between DeepSpeed's
calling conventions (torch tensors, error tensors owned by the optimizer, process groups) and
oxcomm's Python API; the algorithms are oxcomm's (:mod:`oxcomm.onebit`,
:mod:`oxcomm.coalesced`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import oxcomm
import oxcomm.torch as oxtorch

__all__ = ["CompressedBackend", "reduce_scatter_coalesced", "all_to_all_quant_reduce", "init_distributed"]


def init_distributed(**kwargs):
    """``deepspeed.init_distributed(dist_backend="oxcomm", **kwargs)``."""
    import deepspeed

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


def _f32_cpu(name, t, flat=False):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"compressed_allreduce: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"compressed_allreduce: {name} is on {t.device}; oxcomm runs on CPU tensors")
    if t.dtype != torch.float32:
        raise TypeError(f"compressed_allreduce: {name} is {t.dtype}; the 1-bit all-reduce takes float32")
    if flat and (t.dim() != 1 or not t.is_contiguous()):
        raise ValueError(f"compressed_allreduce: {name} must be a contiguous 1-D tensor, got shape {tuple(t.shape)}")


class CompressedBackend:
    """DeepSpeed's 1-bit compressed all-reduce backend (``NcclBackend``/``CompressedBackend`` of
    ``deepspeed/runtime/comm/`` up to 0.19.4), running oxcomm's 1-bit all-reduce.

    ``CompressedBackend(mpu=None)``: the group is ``mpu.get_data_parallel_group()`` when an
    ``mpu`` is given, else the default group (a new oxcomm group over it when the default
    group is not oxcomm; that constructor is then collective, as DeepSpeed's). ``group=``
    names a group directly. ``rank`` and ``size`` are this rank's and the group's.
    """

    def __init__(self, mpu=None, group=None):
        if mpu is not None:
            group = mpu.get_data_parallel_group()
        self.world_group, self.comm = _oxcomm_group(group)
        self.rank = self.comm.rank
        self.size = self.comm.size
        # per (worker_error, server_error) pair: the oxcomm state and the tensors' versions
        # after we last wrote them, so a state is rebuilt only when the caller changed them.
        self._states = {}

    def compressed_allreduce(self, buffer_m, worker_error, server_error, local_rank=0):
        """DeepSpeed's ``compressed_allreduce``: the 1-bit error-compensated mean of
        ``buffer_m`` over the group, with this rank's ``worker_error`` (1-D float32 of length
        ``N``, ``N % (8·size) == 0``, ``N >= buffer_m.numel()``) and ``server_error`` (``N /
        size``) updated in place. Returns the result with ``buffer_m``'s shape; as in DeepSpeed,
        ``buffer_m`` itself holds it when it is contiguous with exactly ``N`` elements, and is
        left untouched otherwise. ``local_rank`` (a device index) is accepted and unused.
        An empty ``buffer_m`` zeroes both errors and is returned unchanged, with no
        communication (DeepSpeed's ``check_and_handle_empty_buffer``)."""
        _f32_cpu("buffer_m", buffer_m)
        _f32_cpu("worker_error", worker_error, flat=True)
        _f32_cpu("server_error", server_error, flat=True)
        shape = buffer_m.shape
        length = buffer_m.numel()
        n_padded = worker_error.numel()
        if length == 0:
            worker_error.zero_()
            server_error.zero_()
            return buffer_m
        n = self.size
        if n_padded % (8 * n) != 0:
            raise ValueError(
                f"compressed_allreduce: worker_error has {n_padded} elements, not a multiple of 8 × {n} ranks"
            )
        if server_error.numel() != n_padded // n:
            raise ValueError(
                f"compressed_allreduce: server_error has {server_error.numel()} elements, expected {n_padded} / {n}"
            )
        if length > n_padded:
            raise ValueError(
                f"compressed_allreduce: buffer_m has {length} elements, more than worker_error's {n_padded}"
            )
        state = self._state(worker_error, server_error)
        in_place = length == n_padded and buffer_m.is_contiguous()
        buf = buffer_m.view(-1) if in_place else buffer_m.reshape(-1).clone()
        oxcomm.onebit.all_reduce(self.comm, buf, state)
        _errors_into(state, worker_error, server_error)
        self._states[_key(worker_error, server_error)] = (state, worker_error._version, server_error._version)
        return buffer_m if in_place else buf.view(shape)

    def _state(self, worker_error, server_error):
        key = _key(worker_error, server_error)
        cached = self._states.get(key)
        if cached is not None and cached[1] == worker_error._version and cached[2] == server_error._version:
            return cached[0]
        return oxcomm.onebit.State.from_errors(worker_error, server_error, self.comm)


def _key(worker_error, server_error):
    return (worker_error.data_ptr(), worker_error.numel(), server_error.data_ptr(), server_error.numel())


def _errors_into(state, worker_error, server_error):
    """Copy the state's errors into the caller's tensors."""
    if hasattr(state, "errors_into"):
        state.errors_into(worker_error, server_error)
        return
    worker_error.copy_(torch.as_tensor(state.worker_error()))
    server_error.copy_(torch.as_tensor(state.server_error()))


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
