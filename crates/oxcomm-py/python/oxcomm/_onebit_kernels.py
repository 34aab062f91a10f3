"""The arithmetic of the 1-bit compressed all-reduce on the tensors' device: torch ops that
run on CUDA and CPU alike (the tests run them on CPU), and Triton kernels for CUDA.

This module owns the device side of one call: packing signs into bytes, unpacking bytes to
``±scale``, the sums of squares and scales, and the worker and server steps that update the
caller's error tensors in place. It does not move bytes between ranks (that is
:mod:`oxcomm.onebit_torch`'s transports) and allocates no state of its own: every function
takes its inputs and output buffers.

Wire format and numerics are those of the Rust crate (``crates/oxcomm/src/compression/
onebit.rs`` and ``pack.rs``), so that a CUDA rank and a CPU rank produce the same bytes:

* ``sgn(v) = −1`` if ``v < 0``, else ``+1``: ``+0``, ``−0`` and NaN give bit 1 (DeepSpeed's
  ``sign(x) + 1 != 0``). Element ``8m + j`` is bit ``7 − j`` of byte ``m`` (numpy's and
  cupy's ``packbits`` default, the reference NCCL/cupy wire format).
* A *row* is ``C/8`` sign bytes followed by its scale, an f32 in little-endian bytes
  (:data:`SCALE_BYTES`); ``n`` rows make the worker's all-to-all, one row the server's
  all-gather.
* A scale is ``f32(sqrt(Σv²)) / f32(sqrt(len))``: the sum of squares in float64, rounded to
  f32 once after the square root, then divided in f32 as DeepSpeed divides its norm.
* The sum of squares follows the Rust kernels' order so that the scales are the same bits
  (``pack::SQUARE_LANES``): per chunk of the worker's buffer (per ``C`` elements), each whole
  block of 64 elements is summed per lane of 16 in f32 (four fused multiply-adds per lane:
  Triton's ``fma``; in the torch ops, emulated in float64 and rounded to f32 after each),
  those partials and the exact
  squares of the elements after the last whole block are added in float64, and a chunk
  whose total is infinite or below 2⁻⁶⁰ is recomputed with every square in float64. The
  float64 additions are done in another order than the Rust loop's, which changes the total
  by at most a few float64 ulps; the scale, rounded to f32 afterwards, differs only where
  that total sits within those ulps of an f32 rounding boundary (about one call in 10⁸), by
  one f32 ulp. The same holds for the double rounding (float64, then f32) of the emulated
  fused multiply-add (about one in 10⁸ again). Everything else is f32 in the Rust (and DeepSpeed) order of
  operations: ``u = x + e``, ``e ← u − α·sgn(u)``, ``m = Σᵢ (αᵢ · f32(1/n)) · sgnᵢ`` added
  in rank order from ``0``, ``m ← m + s``, ``s ← m − β·sgn(m)``, ``y = β_j · sgn_j``.

Each function is a handful of torch ops (a few passes over memory each). On CUDA the passes
that touch every element run as Triton kernels (:mod:`oxcomm._onebit_triton`) where Triton
imports and compiles, else as the torch ops, with the same bits (:data:`KERNELS_ENV`
chooses): the worker's and the server's pass (``u ← e + x``, its signs and the f32 partials
of its squares, in one read and one write of ``u``), the error update, and the unpacking of
rows. On CPU the torch ops always run.
"""

from __future__ import annotations

import math
import os
import warnings

import torch

__all__ = [
    "SCALE_BYTES",
    "pack_signs",
    "unpack_scaled",
    "minus_signed",
    "sum_squares",
    "scale_of",
    "inverse_size",
    "add_pack_squares",
    "KERNELS_ENV",
    "worker_step",
    "server_step",
    "unpack_rows",
    "report",
]

#: Bytes of the f32 scale (little-endian) that ends each row on the wire.
SCALE_BYTES = 4

#: Elements per block whose squares are first summed in f32 (Rust's ``pack::SQUARE_BLOCK``).
SQUARE_BLOCK = 64
#: Lanes of those f32 partial sums (Rust's ``pack::SQUARE_LANES``).
SQUARE_LANES = 16
#: Totals below this (2⁻⁶⁰) are recomputed with every square in float64
#: (Rust's ``pack::SQUARE_EXACT_BELOW``).
SQUARE_EXACT_BELOW = 2.0**-60
#: Elements whose squares :func:`sum_squares` holds in float64 at once (32 MiB of scratch).
SQUARES_SLICE = 1 << 22

# Packing multiplies each group of 8 sign bytes, read as one little-endian int64 (element j's
# 0/1 at bit 8j), by this constant (2^(63 - 9j) summed over j, wrapping mod 2^64): element j
# lands on bit 63 - j, and no other product term reaches the top byte or collides with another
# (8j + 63 - 9i is distinct for every (i, j), so nothing carries). The top byte is the packed
# byte in the big bit order.
_GATHER = 0x8040201008040201 - (1 << 64)  # as a (wrapping) int64
_SHIFTS = {}


def _shifts(device):
    s = _SHIFTS.get(device)
    if s is None:
        s = _SHIFTS[device] = torch.tensor([7 - j for j in range(8)], dtype=torch.uint8, device=device)
    return s


#: The environment variable choosing the kernels for CUDA tensors: ``auto`` (the default:
#: Triton's where Triton imports and compiles, with a warning and torch ops from then on where
#: it does not), ``torch`` (never Triton), or ``triton`` (an error rather than a fallback).
#: CPU tensors take the torch ops whatever it says. A call that names ``method="triton"`` gets
#: Triton's kernel or an error, whatever it says; :func:`report` tells which kernels ran.
KERNELS_ENV = "OXCOMM_ONEBIT_KERNELS"
_CHOICES = ("auto", "torch", "triton")
#: ``module``: the Triton kernels once imported; ``failed``: why Triton is off (None: not off);
#: ``ran``: each Triton kernel's name -> what its last call on CUDA ran (see :func:`report`).
_triton = {"module": None, "failed": None, "ran": {}}


def report():
    """What each of the Triton kernels ran on its last call: ``"triton"``, or ``"torch ops
    (<why>)"`` where it fell back (``auto`` only). Kernels not called yet are absent."""
    return dict(_triton.setdefault("ran", {}))


def _kernels_choice():
    choice = os.environ.get(KERNELS_ENV, "auto").strip().lower() or "auto"
    if choice not in _CHOICES:
        raise ValueError(f"{KERNELS_ENV}={choice!r}: expected one of {', '.join(_CHOICES)}")
    return choice


def _triton_module(required):
    """:mod:`oxcomm._onebit_triton`, or None where Triton is off or failed (ImportError if
    ``required``)."""
    if _triton["module"] is not None:
        return _triton["module"]
    if _triton["failed"] is not None and not required:
        return None
    try:
        import oxcomm._onebit_triton as module
    except ImportError as e:
        _triton["failed"] = f"Triton does not import ({e})"
        if required:
            raise ImportError(f"oxcomm 1-bit kernels: {_triton['failed']}") from e
        return None
    _triton["module"] = module
    return module


def _pick(method, device, torch_default):
    """The method for a call: ``method`` if given, else Triton on CUDA (as
    :data:`KERNELS_ENV` allows), else ``torch_default``."""
    if method is not None:
        return method
    if device.type != "cuda":
        return torch_default
    choice = _kernels_choice()
    if choice == "torch" or (choice == "auto" and _triton["failed"] is not None):
        return "select" if torch_default == "flip" else torch_default
    return "triton"


def _run_triton(name, *args, named=False):
    """Runs a Triton kernel; True if it ran. ``named``: the caller asked for Triton by name
    (``method="triton"``), so a failure is raised. Otherwise, under ``auto``, a failure (no
    compiler for this machine, an unsupported GPU) turns Triton off for the process, with a
    warning, and the caller runs the torch ops instead (the same bits); :func:`report` says so."""
    required = named or _kernels_choice() == "triton"
    ran = _triton.setdefault("ran", {})
    module = _triton_module(required)
    if module is None:
        ran[name] = f"torch ops ({_triton['failed']})"
        return False
    try:
        getattr(module, name)(*args)
    except Exception as e:  # noqa: BLE001 - any failure to compile or launch: torch ops instead
        if required:
            raise
        _triton["module"] = None
        _triton["failed"] = f"{type(e).__name__}: {e}"
        ran[name] = f"torch ops ({_triton['failed']})"
        warnings.warn(
            f"oxcomm 1-bit kernels: Triton's {name} failed ({_triton['failed']}); using torch ops "
            f"from now on (set {KERNELS_ENV}=torch to skip Triton)",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    ran[name] = "triton"
    return True


def _layout_fallback(name):
    """A layout the Triton kernel does not take: the torch ops run (recorded for :func:`report`)."""
    _triton.setdefault("ran", {})[name] = "torch ops (a layout the Triton kernel does not take)"


def pack_signs(v, out=None, method=None):
    """The sign bytes of ``v`` (float32, last dimension a multiple of 8): a uint8 tensor with
    the last dimension divided by 8, bit 1 unless the element is ``< 0``, element ``8m + j``
    at bit ``7 − j`` of byte ``m``. Written into ``out`` when given (any strides).
    ``method``: ``"torch"`` or ``"triton"`` (one kernel; on CPU tensors only under
    ``TRITON_INTERPRET=1``); by default Triton on CUDA as :data:`KERNELS_ENV` says."""
    if v.shape[-1] % 8 != 0:
        raise ValueError(f"pack_signs: the last dimension ({v.shape[-1]}) is not a multiple of 8")
    named = method == "triton"
    method = _pick(method, v.device, "torch")
    if method == "triton":
        rows = v.reshape(-1, v.shape[-1]).contiguous()
        target = out
        if target is None:
            target = torch.empty(*v.shape[:-1], v.shape[-1] // 8, dtype=torch.uint8, device=v.device)
        try:
            flat = target.view(rows.shape[0], -1)  # (rows, L/8), any row stride
        except RuntimeError:
            flat = None
        if flat is None or flat.stride(-1) != 1:
            _layout_fallback("pack_signs")
        elif _run_triton("pack_signs", rows, flat, named=named):
            return target
    elif method != "torch":
        raise ValueError(f"pack_signs: unknown method {method!r} (torch or triton)")
    negative = torch.lt(v, 0)  # NaN < 0 is false: bit 1
    groups = negative.reshape(*v.shape[:-1], v.shape[-1] // 8, 8).view(torch.int64).squeeze(-1)
    packed = groups.mul(_GATHER).bitwise_right_shift_(56).to(torch.uint8).bitwise_not_()
    if out is None:
        return packed
    out.copy_(packed)
    return out


def unpack_bits(signs):
    """The bits of ``signs`` ((rows, B) uint8) as (rows, 8B) uint8 zeros and ones, element
    ``8m + j`` from bit ``7 − j`` of byte ``m``."""
    rows = signs.reshape(-1, signs.shape[-1])
    bits = rows.unsqueeze(-1).bitwise_right_shift(_shifts(signs.device)).bitwise_and_(1)
    return bits.reshape(rows.shape[0], rows.shape[1] * 8)


def unpack_scaled(signs, scales, out=None, method=None):
    """``±scale`` from sign bytes: ``signs`` is (rows, B) uint8 and ``scales`` a float32 tensor
    of ``rows`` scales (or a 0-d one for every row); the result, (rows, 8B) float32, holds
    ``+scale`` for bit 1 and ``−scale`` for bit 0 (``scale`` with its sign bit flipped: exactly
    ``scale · (−1)``). ``method``: ``"triton"`` (one kernel: the default on CUDA, as
    :data:`KERNELS_ENV` says), ``"select"`` (one torch select pass: CUDA's torch-ops path) or
    ``"flip"`` (integer ops on the scale's bits, CPU's: torch's CPU select of broadcast
    scalars is several times slower). All give the same bits."""
    named = method == "triton"
    method = _pick(method, signs.device, "flip")
    if method == "triton":
        rows = signs.reshape(-1, signs.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        per_row = scales.reshape(-1).expand(rows.shape[0]).contiguous()
        target = out if out is not None and out.is_contiguous() else None
        if target is None:
            target = torch.empty(rows.shape[0], rows.shape[1] * 8, dtype=torch.float32, device=signs.device)
        if _run_triton("unpack_scaled", rows, per_row, target.view(rows.shape[0], -1), named=named):
            if out is not None and target is not out:
                out.copy_(target.view(out.shape))
                return out
            return target
        method = None
    bits = unpack_bits(signs)
    s = scales.reshape(-1, 1) if scales.dim() > 0 else scales
    if _method(method, signs.device) == "select":
        if out is None:
            return torch.where(bits.view(torch.bool), s, -s)  # 0 or 1: valid bools
        return torch.where(bits.view(torch.bool), s, -s, out=out)
    values = _flip_where(bits.bitwise_xor_(1), s)  # bit 0 → the sign bit flipped
    if out is None:
        return values
    out.copy_(values)
    return out


def _method(method, device):
    """The torch ops for ``method`` (``None`` or ``"torch"``: the device's)."""
    if method in (None, "torch"):
        return "select" if device.type == "cuda" else "flip"
    if method not in ("select", "flip"):
        raise ValueError(f"unknown method {method!r} (select or flip; unpack_scaled also triton)")
    return method


def _flip_where(condition, s):
    """``s`` (float32, broadcast) with its sign bit flipped where ``condition`` (uint8 0/1 or
    bool) is set: ``−s`` there exactly, as float32 (integer ops on the bits)."""
    flips = condition.to(torch.int32).bitwise_left_shift_(31)
    return flips.bitwise_xor_(s.view(torch.int32)).view(torch.float32)


def minus_signed(v, scale, out, method=None):
    """``out = v − scale · sgn(v)`` (the error update; ``sgn(±0) = sgn(NaN) = +1``), with
    ``scale`` a 0-d float32 tensor. ``out`` may be ``v``. ``method`` as in
    :func:`unpack_scaled` (the same bits either way)."""
    named = method == "triton"
    method = _pick(method, v.device, "flip")
    if method == "triton":
        if not (v.is_contiguous() and out.is_contiguous()):
            _layout_fallback("minus_signed")
        elif _run_triton("minus_signed", v.view(-1), scale.reshape(1), out.view(-1), named=named):
            return out
        method = None
    if _method(method, v.device) == "select":
        return torch.where(torch.lt(v, 0), v + scale, v - scale, out=out)
    signed = _flip_where(torch.lt(v, 0), scale)  # scale · sgn(v)
    return torch.sub(v, signed, out=out)


def add_pack_squares(x, u, signs, method=None):
    """The pass that the worker and the server share (Rust's ``pack::add_pack_squares``):
    ``u ← e + x`` in place in ``u`` ((rows, C) float32, contiguous: the error), with the flat
    ``x`` added only where it reaches (at most ``rows · C`` elements; past it ``u`` keeps
    ``e``), the sign bytes of ``u`` into ``signs`` ((rows, C/8), any row stride), and each
    row's sum of squares returned as :func:`sum_squares` computes it. ``method``: ``"torch"``
    or ``"triton"`` (one fused kernel, and torch ops for the few elements after each row's
    last whole block); by default Triton on CUDA as :data:`KERNELS_ENV` says."""
    rows, row_len = u.shape
    x = x.reshape(-1)
    named = method == "triton"
    method = _pick(method, u.device, "torch")
    if method == "triton" and not (u.is_contiguous() and signs.stride(-1) == 1):
        _layout_fallback("add_pack_squares")
    elif method == "triton":
        module = _triton_module(named or _kernels_choice() == "triton")
        if module is None:
            _triton.setdefault("ran", {})["add_pack_squares"] = f"torch ops ({_triton['failed']})"
        else:
            blocks = -(-row_len // SQUARE_BLOCK)
            partial = torch.empty(rows, blocks, SQUARE_LANES, dtype=torch.float32, device=u.device)
            exact = torch.empty(rows, module.programs(row_len), dtype=torch.float64, device=u.device)
            if _run_triton("add_pack_squares", x.contiguous(), u, signs, partial, exact, named=named):
                whole = row_len // SQUARE_BLOCK
                total = partial[:, :whole].sum(dim=(1, 2), dtype=torch.float64)
                if whole * SQUARE_BLOCK < row_len:
                    tail = u[:, whole * SQUARE_BLOCK :].double()
                    total += tail.mul_(tail).sum(dim=1)
                redo = torch.isinf(total) | (total < SQUARE_EXACT_BELOW)
                return torch.where(redo, exact.sum(dim=1), total)
    elif method not in ("torch", "triton"):
        raise ValueError(f"add_pack_squares: unknown method {method!r} (torch or triton)")
    u.view(-1)[: x.numel()].add_(x)  # e + x in f32: the same bits as x + e
    pack_signs(u, out=signs, method="torch")
    return sum_squares(u)


def sum_squares(v):
    """The sum of squares of each row of ``v`` ((rows, L) float32, ``L`` a multiple of 8) as a
    float64 tensor of ``rows`` totals, in the Rust kernels' order (see the module docs)."""
    rows, length = v.shape
    blocks = length // SQUARE_BLOCK
    blocked = blocks * SQUARE_BLOCK
    total = torch.zeros(rows, dtype=torch.float64, device=v.device)
    exact = torch.zeros(rows, dtype=torch.float64, device=v.device)  # every square in float64
    if blocks:
        # Element k of a block is step k // 16 of lane k % 16: four f32 fused multiply-adds
        # per lane from 0, each computed exactly in float64 (v² is exact there) and rounded.
        # A slice of blocks at a time bounds the float64 scratch.
        whole = v[:, :blocked].reshape(rows, blocks, SQUARE_BLOCK)
        per_slice = max(1, SQUARES_SLICE // (rows * SQUARE_BLOCK))
        for first in range(0, blocks, per_slice):
            squares = whole[:, first : first + per_slice].double()
            squares.mul_(squares)
            exact += squares.sum(dim=(1, 2))
            steps = squares.view(rows, -1, 4, SQUARE_LANES)
            partial = steps[:, :, 0, :].float()
            for step in range(1, 4):
                partial = steps[:, :, step, :].add(partial).float()
            total += partial.sum(dim=(1, 2), dtype=torch.float64)
    if blocked < length:
        tail = v[:, blocked:].double()
        tail = tail.mul_(tail).sum(dim=1)
        total += tail
        exact += tail
    # A total that overflowed in the f32 partials, or too small for them to be exact, is the
    # exact one instead (NaN stays NaN: both tests are false).
    redo = torch.isinf(total) | (total < SQUARE_EXACT_BELOW)
    return torch.where(redo, exact, total)


def scale_of(total, length):
    """``f32(sqrt(total)) / f32(sqrt(length))``: the scale of ``length`` elements whose sum of
    squares is ``total`` (a float64 tensor), as a float32 tensor of the same shape."""
    # A device tensor, not a Python float: CUDA divides by a host scalar as a multiplication
    # by its reciprocal, which rounds differently. torch.full fills it without a host copy.
    root = torch.full((), math.sqrt(length), dtype=torch.float32, device=total.device)
    return total.sqrt().float().div_(root)


def inverse_size(n, device):
    """``f32(1) / f32(n)`` as a 0-d float32 tensor (the factor of the server's mean)."""
    return torch.ones((), dtype=torch.float32, device=device).div_(torch.full((), float(n), device=device))


def _put_scale(row_bytes, scale):
    """Writes the f32 ``scale`` (0-d) as little-endian bytes into the last ``SCALE_BYTES`` of
    every row of ``row_bytes`` ((rows, B + 4) uint8)."""
    as_bytes = scale.reshape(1).view(torch.uint8)
    if as_bytes.numel() != SCALE_BYTES:
        raise AssertionError("a float32 is 4 bytes")
    row_bytes[:, -SCALE_BYTES:].copy_(as_bytes.expand(row_bytes.shape[0], SCALE_BYTES))


def scales_in(rows):
    """The f32 scales ending each row of ``rows`` ((rows, B + 4) uint8), as a float32 tensor."""
    return rows[:, -SCALE_BYTES:].reshape(-1).clone().view(torch.float32)  # a fresh, aligned copy


def worker_step(x, worker_error, send, method=None):
    """The worker's half: ``u = pad(x) + e`` into ``worker_error`` (``x`` flat float32 of
    ``L ≤ N`` elements, the rest of ``u`` is ``e`` itself), the signs of chunk ``j`` of ``u``
    into row ``j`` of ``send`` ((n, C/8 + 4) uint8) and ``α = ‖u‖/√N`` after each row, then
    ``e ← u − α·sgn(u)`` in place. Returns ``α`` (0-d float32). ``method``: ``None`` (the
    default kernels for the device), ``"torch"`` or ``"triton"``."""
    n = send.shape[0]
    u = worker_error
    totals = add_pack_squares(x, u.view(n, -1), send[:, :-SCALE_BYTES], method=method)
    alpha = scale_of(totals.sum(), u.numel())
    _put_scale(send, alpha)
    minus_signed(u, alpha, out=u, method=method)
    return alpha


def server_step(received, inv_n, server_error, send_row, method=None):
    """The server's half: ``m = Σᵢ (αᵢ · inv_n) · sgnᵢ`` over the rows of ``received`` ((n,
    C/8 + 4) uint8, rank order) added from ``0`` in rank order, ``m ← m + s`` into
    ``server_error`` (``C`` float32), its signs and ``β = ‖m‖/√C`` into ``send_row`` ((1,
    C/8 + 4) uint8), then ``s ← m − β·sgn(m)`` in place. Returns ``β`` (0-d float32).
    ``method`` as in :func:`worker_step`."""
    scales = scales_in(received) * inv_n
    terms = unpack_scaled(received[:, :-SCALE_BYTES], scales, method=method)
    m = torch.zeros_like(server_error)
    for i in range(terms.shape[0]):
        m.add_(terms[i])
    totals = add_pack_squares(m, server_error.view(1, -1), send_row[:, :-SCALE_BYTES], method=method)
    beta = scale_of(totals[0], server_error.numel())
    _put_scale(send_row, beta)
    minus_signed(server_error, beta, out=server_error, method=method)
    return beta


def unpack_rows(gathered, out):
    """The result: ``y[j·C + k] = β_j · sgn_j[k]`` from every server's row of ``gathered``
    ((n, C/8 + 4) uint8), written into ``out`` (flat float32 of ``L ≤ N`` elements)."""
    length = out.numel()
    signs = gathered[:, :-SCALE_BYTES]
    n, per_row = signs.shape
    if length == n * per_row * 8:
        unpack_scaled(signs, scales_in(gathered), out=out.view(n, -1))
        return out
    out.copy_(unpack_scaled(signs, scales_in(gathered)).view(-1)[:length])
    return out
