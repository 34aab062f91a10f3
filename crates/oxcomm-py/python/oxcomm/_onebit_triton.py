"""Triton kernels for the 1-bit all-reduce's sign bytes: one pass each for packing and for
unpacking, where the torch ops of :mod:`oxcomm._onebit_kernels` take several.

This module owns four kernels and their launch: :func:`pack_signs` (float32 rows → sign
bytes, into an output whose rows may be strided, as the rows of a send buffer are),
:func:`unpack_scaled` (sign bytes → ``±scale`` per row), :func:`add_pack_squares` (the
worker's and the server's pass: ``u ← e + x``, its signs and its sums of squares) and
:func:`minus_signed` (the error update ``e ← u − scale·sgn(u)``). They write the same bits as
the torch ops of :mod:`oxcomm._onebit_kernels` (``tests/test_onebit_torch.py`` checks it under
``TRITON_INTERPRET=1``, which runs them on CPU tensors). Which kernels a call uses is
:mod:`oxcomm._onebit_kernels`' choice; importing this module imports Triton (it raises
ImportError where Triton is missing).

Element ``j`` of byte ``b`` is bit ``7 − j`` (big-endian bit order), bit 1 unless the element
is ``< 0`` (so ±0 and NaN give 1). The pack and unpack kernels see ``BLOCK`` bytes per program
as a ``[BLOCK, 8]`` tile; :func:`add_pack_squares` sees ``SQUARE_BLOCKS`` blocks of 64
elements of one row per program, as four ``[SQUARE_BLOCKS, 16]`` tiles (step ``s`` of lane
``l`` is element ``16s + l`` of its block), which is the Rust kernels' order for the f32
partial sums of squares: ``fma(v, v, p)`` per lane, step after step. Offsets are int64, so
tensors past 2³¹ elements work.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Bytes (of 8 elements each) per program of the pack and unpack kernels.
BLOCK = 512
#: Blocks of 64 elements per program of :func:`add_pack_squares`.
SQUARE_BLOCKS = 32
#: Elements per program of :func:`minus_signed`.
ELEMENTS = 2048


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
    scale = tl.load(scales_ptr + row, mask=inside, other=0.0).to(tl.uint32, bitcast=True)
    bit = (byte[:, None] >> (7 - j)[None, :]) & 1
    # bit 0: the scale with its sign bit flipped, by integer ops: the Tritons before
    # triton-lang/triton#10270 (May 2026) compile a float negation to 0 − x, +0.0 for a zero
    # scale where the torch ops and the Rust path write −0.0
    flip = (1 - bit).to(tl.uint32) << 31
    value = (scale[:, None] ^ flip).to(tl.float32, bitcast=True)
    tl.store(out_ptr + b[:, None] * 8 + j[None, :], value, mask=inside[:, None])


@triton.jit
def _step(u_ptr, x_ptr, signs_ptr, row, row_len, signs_stride, n_x, blk, step, lane):
    """Step ``step`` of every block in ``blk`` of row ``row``: ``u ← e + x`` (``x`` only below
    ``n_x``, flat), stored; its sign bytes stored; ``u`` returned (0 outside the row)."""
    offs = blk[:, None] * 64 + step * 16 + lane[None, :]
    inside = offs < row_len
    flat = row * row_len + offs
    e = tl.load(u_ptr + flat, mask=inside, other=0.0)
    has_x = inside & (flat < n_x)
    x = tl.load(x_ptr + flat, mask=has_x, other=0.0)
    u = tl.where(has_x, e + x, e)  # no + 0.0 past x: a −0 error stays −0, as in Rust
    tl.store(u_ptr + flat, u, mask=inside)
    weights = (1 << (7 - lane % 8)).to(tl.int32)
    bits = tl.where(u < 0, 0, weights[None, :])
    half = lane // 8
    for h in tl.static_range(2):
        byte = tl.sum(tl.where(half[None, :] == h, bits, 0), axis=1).to(tl.uint8)
        index = blk * 8 + step * 2 + h
        tl.store(signs_ptr + row * signs_stride + index, byte, mask=index * 8 < row_len)
    return u


@triton.jit
def _add_pack_squares_kernel(
    u_ptr, x_ptr, signs_ptr, partial_ptr, exact_ptr, row_len, signs_stride, n_x, n_blocks, BLOCKS: tl.constexpr
):
    row = tl.program_id(1).to(tl.int64)
    program = tl.program_id(0)
    blk = program.to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    lane = tl.arange(0, 16)
    v0 = _step(u_ptr, x_ptr, signs_ptr, row, row_len, signs_stride, n_x, blk, 0, lane)
    v1 = _step(u_ptr, x_ptr, signs_ptr, row, row_len, signs_stride, n_x, blk, 1, lane)
    v2 = _step(u_ptr, x_ptr, signs_ptr, row, row_len, signs_stride, n_x, blk, 2, lane)
    v3 = _step(u_ptr, x_ptr, signs_ptr, row, row_len, signs_stride, n_x, blk, 3, lane)
    partial = v0 * v0
    partial = tl.fma(v1, v1, partial)
    partial = tl.fma(v2, v2, partial)
    partial = tl.fma(v3, v3, partial)
    tl.store(
        partial_ptr + (row * n_blocks + blk[:, None]) * 16 + lane[None, :], partial, mask=(blk < n_blocks)[:, None]
    )
    d0, d1, d2, d3 = v0.to(tl.float64), v1.to(tl.float64), v2.to(tl.float64), v3.to(tl.float64)
    exact = tl.sum(tl.sum(d0 * d0 + d1 * d1 + d2 * d2 + d3 * d3, axis=1), axis=0)
    tl.store(exact_ptr + row * tl.num_programs(0) + program, exact)


@triton.jit
def _minus_signed_kernel(v_ptr, scale_ptr, out_ptr, n, ELEMENTS: tl.constexpr):
    k = tl.program_id(0).to(tl.int64) * ELEMENTS + tl.arange(0, ELEMENTS)
    inside = k < n
    v = tl.load(v_ptr + k, mask=inside, other=0.0)
    scale = tl.load(scale_ptr)
    tl.store(out_ptr + k, tl.where(v < 0, v + scale, v - scale), mask=inside)


def add_pack_squares(x, u, signs, partial, exact):
    """The fused pass over ``u`` ((rows, C) float32, contiguous, ``C % 8 == 0``): ``u ← e +
    x`` where the flat ``x`` reaches (``x`` contiguous, at most ``rows · C`` elements), the
    sign bytes of ``u`` into ``signs`` ((rows, C/8); last dimension contiguous, any row
    stride), each 64-element block's 16 f32 lane partials into ``partial`` ((rows,
    ceil(C/64), 16) float32; a last, partial block's are garbage) and the float64 sum of every
    square into ``exact`` ((rows, programs) float64, see :func:`programs`)."""
    rows, row_len = u.shape
    n_blocks = triton.cdiv(row_len, 64)
    # Programs on the grid's first axis (up to 2^31 - 1); CUDA caps the second at 65535, which one
    # row of more than 65535 · 64 · SQUARE_BLOCKS elements (128 Mi) would pass.
    grid = (programs(row_len), rows)
    _add_pack_squares_kernel[grid](
        u, x, signs, partial, exact, row_len, signs.stride(0), x.numel(), n_blocks, BLOCKS=SQUARE_BLOCKS
    )


def programs(row_len):
    """Programs per row of :func:`add_pack_squares` (the width of its ``exact``)."""
    return triton.cdiv(triton.cdiv(row_len, 64), SQUARE_BLOCKS)


def minus_signed(v, scale, out):
    """``out ← v − scale·sgn(v)`` (flat, contiguous float32; ``scale`` a 1-element float32
    tensor on the device)."""
    n = v.numel()
    if n:
        _minus_signed_kernel[(triton.cdiv(n, ELEMENTS),)](v, scale, out, n, ELEMENTS=ELEMENTS)
    return out


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
