"""Every call form torch's process group accepts, turned into one normal form with its checks.

This module owns what a c10d call's arguments mean: torch's ``ReduceOp`` (and ``PREMUL_SUM``'s
factor) as oxcomm's op, an options object's timeout, the one-tensor-per-rank lists, whether a
call's tensors are on a device, and the checks on all of them, each naming the call. It does
not lay tensors out for an op (:mod:`.layout`), issue ops (:mod:`.issue`) or run them
(:mod:`.ops`).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

import oxcomm
from oxcomm import _native
from oxcomm._cuda import device as _dev

# torch's ReduceOp.RedOpType name -> oxcomm's ReduceOp name.
_OPS = {
    "SUM": "SUM",
    "AVG": "AVG",
    "PRODUCT": "PROD",
    "MIN": "MIN",
    "MAX": "MAX",
    "BAND": "BAND",
    "BOR": "BOR",
    "BXOR": "BXOR",
}

_PREMUL_SUM = dist.ReduceOp.RedOpType.PREMUL_SUM
_STRIDED = torch.strided


def _fast_ops():
    """{hash of a torch ReduceOp: index of oxcomm's op in ``_native.REDUCE_OPS``} for the plain
    ops: torch hashes a ReduceOp by its kind (one int per RedOpType), so the blocking
    all_reduce reads the op with one getter and one hash instead of comparisons through
    pybind. Built from torch's own objects; empty (every op takes the general path) if this
    torch hashes two kinds alike or PREMUL_SUM like a plain one."""
    try:
        kinds = {name: hash(dist.ReduceOp(getattr(dist.ReduceOp.RedOpType, name))) for name in _OPS}
        premul = hash(dist._make_nccl_premul_sum(1.0))
    except Exception:  # noqa: BLE001 - a torch without these: no fast ops
        return {}
    if len(set(kinds.values())) != len(kinds) or premul in kinds.values():
        return {}
    return {h: _native.REDUCE_OPS.index(_OPS[name].lower()) for name, h in kinds.items()}


_FAST_OPS = _fast_ops()


_op_cache = {}


def _reduce_op(op, call):
    """oxcomm's ReduceOp for a torch ReduceOp (or RedOpType), or NotImplementedError."""
    kind = getattr(op, "op", op)
    hit = _op_cache.get(kind)
    if hit is not None:
        return hit
    name = getattr(kind, "name", str(kind).rsplit(".", 1)[-1])
    if name not in _OPS:
        raise NotImplementedError(
            f"oxcomm: {call} with ReduceOp.{name} is not supported (oxcomm reduces with {', '.join(_OPS)})"
        )
    _op_cache[kind] = found = getattr(oxcomm.ReduceOp, _OPS[name])
    return found


def _premul_factor(op):
    """The factor of a ``PREMUL_SUM`` op (``dist._make_nccl_premul_sum(factor)``: a number or a
    one-element tensor), or None for any other op.

    NCCL's premul-sum is ``sum_i(factor_i * x_i)``: the calls that take it scale their input by
    the factor (in place where the input is overwritten by the result anyway, else a scaled
    copy) and sum."""
    if getattr(op, "op", op) != _PREMUL_SUM:
        return None
    factor = getattr(op, "factor", None)
    if factor is None:
        raise NotImplementedError("oxcomm: ReduceOp.PREMUL_SUM whose factor this torch does not expose")
    if isinstance(factor, torch.Tensor):
        if factor.numel() != 1:
            raise ValueError(f"oxcomm: PREMUL_SUM takes a one-element factor tensor, got {factor.numel()} elements")
        return factor.reshape(())
    return factor


def _scaled(t, factor, in_place):
    """``t`` times a premul factor: ``t`` itself scaled when ``in_place``, else a new tensor."""
    if isinstance(factor, torch.Tensor):
        factor = factor.to(t.device)
    return t.mul_(factor) if in_place else t * factor


def _timeout(opts):
    """The op's timeout in seconds, or None when torch left it unset (negative)."""
    t = getattr(opts, "timeout", None)
    if isinstance(t, timedelta) and t.total_seconds() > 0:
        return t.total_seconds()
    return None


def _single(tensors, call):
    if len(tensors) != 1:
        raise NotImplementedError(
            f"oxcomm: {call} takes one tensor per rank, got {len(tensors)} (multi-device lists are not supported)"
        )
    return tensors[0]


def _on_device(call, *tensors):
    """Whether the call's tensors are device (CUDA) tensors; ``ValueError`` naming the call when
    some are and some are not."""
    owned = [_dev.owns(t) for t in tensors if t is not None]
    if not any(owned):
        return False
    if not all(owned):
        where = sorted({str(t.device) for t in tensors if t is not None})
        raise ValueError(f"oxcomm: {call}: tensors on {', '.join(where)} in one call; pass all of them on one device")
    return True



def _same_shape(tensors, call):
    shape = tensors[0].shape
    if any(t.shape != shape or t.dtype != tensors[0].dtype for t in tensors):
        raise NotImplementedError(f"oxcomm: {call} with tensors of different shapes or dtypes is not supported")

