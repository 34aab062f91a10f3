"""Triton kernels for the 1-bit all-reduce's sign bytes: one pass each for packing and for
unpacking, where the torch ops of :mod:`oxcomm._onebit_kernels` take several.

This module owns two kernels and their launch: :func:`pack_signs` (float32 rows → sign bytes,
into an output whose rows may be strided, as the rows of a send buffer are) and
:func:`unpack_scaled` (sign bytes → ``±scale`` per row). They write the same bits as the torch
ops (``tests/test_onebit_torch.py`` checks it under ``TRITON_INTERPRET=1``, which runs them on
CPU tensors). Which kernels a call uses is :mod:`oxcomm._onebit_kernels`' choice; importing
this module imports Triton (it raises ImportError where Triton is missing).

Each program handles ``BLOCK`` bytes, i.e. ``8 · BLOCK`` elements as a ``[BLOCK, 8]`` tile:
element ``j`` of byte ``b`` is bit ``7 − j`` (big-endian bit order), bit 1 unless the element
is ``< 0`` (so ±0 and NaN give 1). Offsets are int64, so tensors past 2³¹ elements work.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Bytes (of 8 elements each) per program.
BLOCK = 512


@triton.jit
def _pack_kernel(v_ptr, out_ptr, n_bytes, row_bytes, out_stride, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    j = tl.arange(0, 8)
    inside = b < n_bytes
    v = tl.load(v_ptr + b[:, None] * 8 + j[None, :], mask=inside[:, None], other=0.0)
    weights = (1 << (7 - j)).to(tl.int32)
    byte = tl.sum(tl.where(v < 0, 0, weights[None, :]), axis=1).to(tl.uint8)
    row = b // row_bytes
    tl.store(out_ptr + row * out_stride + (b - row * row_bytes), byte, mask=inside)


@triton.jit
def _unpack_kernel(signs_ptr, signs_stride, scales_ptr, out_ptr, n_bytes, row_bytes, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    j = tl.arange(0, 8)
    inside = b < n_bytes
    row = b // row_bytes
    byte = tl.load(signs_ptr + row * signs_stride + (b - row * row_bytes), mask=inside, other=0).to(tl.int32)
    scale = tl.load(scales_ptr + row, mask=inside, other=0.0)
    bit = (byte[:, None] >> (7 - j)[None, :]) & 1
    value = tl.where(bit != 0, scale[:, None], -scale[:, None])
    tl.store(out_ptr + b[:, None] * 8 + j[None, :], value, mask=inside[:, None])


def pack_signs(v, out):
    """Sign bytes of ``v`` ((rows, L) float32, contiguous, ``L % 8 == 0``) into ``out``
    ((rows, L/8) uint8; its last dimension contiguous, any row stride)."""
    rows, length = v.shape
    row_bytes = length // 8
    n_bytes = rows * row_bytes
    if n_bytes:
        _pack_kernel[(triton.cdiv(n_bytes, BLOCK),)](v, out, n_bytes, row_bytes, out.stride(0), BLOCK=BLOCK)
    return out


def unpack_scaled(signs, scales, out):
    """``out`` ((rows, 8B) float32, contiguous) ← ``±scales[row]`` from ``signs`` ((rows, B)
    uint8; last dimension contiguous, any row stride) and ``scales`` (rows float32,
    contiguous)."""
    rows, row_bytes = signs.shape
    n_bytes = rows * row_bytes
    if n_bytes:
        _unpack_kernel[(triton.cdiv(n_bytes, BLOCK),)](
            signs, signs.stride(0), scales, out, n_bytes, row_bytes, BLOCK=BLOCK
        )
    return out
