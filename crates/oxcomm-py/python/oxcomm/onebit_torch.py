"""DeepSpeed's 1-bit compressed all-reduce on torch tensors, over any group.

:class:`CompressedAllreduce` is the calling convention of DeepSpeed's ``compressed_allreduce``
(``buffer_m`` plus the caller's ``worker_error`` and ``server_error`` tensors, updated in
place) over a group that is an :class:`oxcomm.Communicator`, an oxcomm torch process group, or
any other torch process group. It is what :class:`oxcomm.deepspeed.CompressedBackend` and the
optimizers of :mod:`oxcomm.optim` call.

This module owns the argument checks and the choice of path; the algorithm on host memory is
:mod:`oxcomm.onebit`'s (the Rust crate's). It does not own the error tensors: the caller does,
as in DeepSpeed.

    ar = oxcomm.onebit_torch.CompressedAllreduce(group)       # group: as above, or None
    n = oxcomm.onebit_torch.padded_len(x.numel(), ar.size)
    we, se = torch.zeros(n), torch.zeros(n // ar.size)
    y = ar(x, we, se)                                          # ≈ the mean of x over the group
"""

from __future__ import annotations

import math

import torch

import oxcomm

__all__ = ["CompressedAllreduce", "padded_len"]


def padded_len(numel, size):
    """DeepSpeed's padded length for ``numel`` elements on ``size`` ranks: ``numel`` rounded
    up to a multiple of ``size · lcm(size, 8)`` (16 for 2 ranks, 72 for 3, 32 for 4)."""
    if size < 1:
        raise ValueError(f"padded_len: the group size must be at least 1, got {size}")
    multiple = size * (size // math.gcd(size, 8) * 8)
    return -(-int(numel) // multiple) * multiple


def _communicator(group):
    """The oxcomm communicator behind ``group``, or None when it is not an oxcomm group."""
    if isinstance(group, oxcomm.Communicator):
        return group
    import oxcomm.torch as oxtorch

    try:
        return oxtorch.communicator(group)
    except ValueError:
        return None


def _check(name, t, flat=False):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"compressed_allreduce: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise TypeError(f"compressed_allreduce: {name} is {t.dtype}; the 1-bit all-reduce takes float32")
    if flat and (t.dim() != 1 or not t.is_contiguous()):
        raise ValueError(f"compressed_allreduce: {name} must be a contiguous 1-D tensor, got shape {tuple(t.shape)}")


class CompressedAllreduce:
    """The 1-bit error-compensated mean over ``group`` (see the module docs).

    ``group``: an :class:`oxcomm.Communicator`, a torch process group, or None for torch's
    default group. ``rank`` and ``size`` are this rank's and the group's.
    """

    def __init__(self, group=None):
        self.comm = _communicator(group)
        if self.comm is None:
            raise NotImplementedError(
                "compressed_allreduce: a torch process group that is not an oxcomm group is not supported yet"
            )
        self.group = group
        self.rank = self.comm.rank
        self.size = self.comm.size
        # per (worker_error, server_error) pair: the oxcomm state and the tensors' versions
        # after we last wrote them, so a state is rebuilt only when the caller changed them.
        self._states = {}

    def __call__(self, buffer_m, worker_error, server_error):
        """DeepSpeed's ``compressed_allreduce``: the 1-bit error-compensated mean of
        ``buffer_m`` over the group, with this rank's ``worker_error`` (1-D float32 of length
        ``N``, ``N % (8·size) == 0``, ``N >= buffer_m.numel()``) and ``server_error`` (``N /
        size``) updated in place. Returns the result with ``buffer_m``'s shape; as in DeepSpeed,
        ``buffer_m`` itself holds it when it is contiguous with exactly ``N`` elements, and is
        left untouched otherwise. An empty ``buffer_m`` zeroes both errors and is returned
        unchanged, with no communication (DeepSpeed's ``check_and_handle_empty_buffer``)."""
        _check("buffer_m", buffer_m)
        _check("worker_error", worker_error, flat=True)
        _check("server_error", server_error, flat=True)
        for name, t in (("buffer_m", buffer_m), ("worker_error", worker_error), ("server_error", server_error)):
            if t.device.type != "cpu":
                raise ValueError(f"compressed_allreduce: {name} is on {t.device}; this path runs on CPU tensors")
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
        state.errors_into(worker_error, server_error)
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
