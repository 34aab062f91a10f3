"""numpy arrays and torch CPU tensors as oxcomm buffers, by address (zero-copy).

``buffer(x, name, write)`` checks what oxcomm cannot see from Rust (device, dtype,
contiguity, writability) and returns ``(address, element count, dtype name, x)``; the native
module reads and writes that memory in place and holds ``x`` while an async op may use it.
``check_device(x, name)`` makes the same checks of a device tensor before it is staged
(``oxcomm._cuda``), so both name a bad tensor alike.
"""

from . import _native

_TORCH_DTYPES = {
    "torch.float32": "f32",
    "torch.float64": "f64",
    "torch.float16": "f16",
    "torch.bfloat16": "bf16",
    "torch.int8": "i8",
    "torch.uint8": "u8",
    "torch.int32": "i32",
    "torch.int64": "i64",
    "torch.bool": "bool",
    "torch.int16": "i16",
    "torch.uint16": "u16",
    "torch.uint32": "u32",
    "torch.uint64": "u64",
    "torch.complex64": "c64",
    "torch.complex128": "c128",
    # float8: moved by every op that only moves data; reducing ops refuse them (Unsupported).
    "torch.float8_e4m3fn": "f8e4m3fn",
    "torch.float8_e5m2": "f8e5m2",
    "torch.float8_e4m3fnuz": "f8e4m3fnuz",
    "torch.float8_e5m2fnuz": "f8e5m2fnuz",
    "torch.float8_e8m0fnu": "f8e8m0fnu",
}
_NUMPY_DTYPES = {
    "float32": "f32",
    "float64": "f64",
    "float16": "f16",
    "int8": "i8",
    "uint8": "u8",
    "int32": "i32",
    "int64": "i64",
    "bool": "bool",
    "int16": "i16",
    "uint16": "u16",
    "uint32": "u32",
    "uint64": "u64",
    "complex64": "c64",
    "complex128": "c128",
}
SUPPORTED = (
    "float32, float64, float16, bfloat16 (torch), int8, uint8, int16, uint16, int32, uint32, int64, uint64, "
    "bool, complex64, complex128, and the float8 types (torch; moved, not reduced)"
)


def _is_torch(x):
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr")


def _is_numpy(x):
    return type(x).__module__ == "numpy" and hasattr(x, "__array_interface__")


# The hot path (every op of a training step passes here): torch tensor classes and torch dtype
# objects seen before, so a contiguous CPU tensor is checked with a few attribute reads instead of
# string conversions. Filled by the full checks below; never holds anything they would refuse.
# DTYPE_CODES: the same dtype objects -> their index in ``_native.DTYPES``, for the calls that
# name a dtype by number (``Communicator.all_reduce_at``: the torch backend's small-op path,
# which makes the same checks inline with these tables).
_TORCH_CLASSES = set()
_TORCH_DTYPE_OBJS = {}
_STRIDED = []
TORCH_CLASSES = _TORCH_CLASSES
DTYPE_CODES = {}


def buffer(x, name, write=True):
    """``(address, count, dtype, owner)`` of ``x``, or TypeError/ValueError naming ``name``."""
    if x.__class__ in _TORCH_CLASSES:
        dtype = _TORCH_DTYPE_OBJS.get(x.dtype)
        if dtype is not None and x.is_cpu and x.layout is _STRIDED[0] and x.is_contiguous():
            return (x.data_ptr(), x.numel(), dtype, x)
    if _is_torch(x):
        if x.device.type != "cpu":
            raise ValueError(
                f"{name}: a tensor on {x.device} among host buffers; oxcomm takes CPU memory, and CUDA "
                "tensors when every tensor of the op is on the device"
            )
        if x.layout.__repr__() != "torch.strided":
            raise ValueError(f"{name}: a {x.layout} tensor; oxcomm works on dense (strided) tensors")
        dtype = _TORCH_DTYPES.get(str(x.dtype))
        if dtype is None:
            raise TypeError(f"{name}: dtype {x.dtype} is not one oxcomm reduces ({SUPPORTED})")
        if not x.is_contiguous():
            raise ValueError(
                f"{name}: the tensor is not contiguous (strides {tuple(x.stride())}); oxcomm reads and "
                "writes the memory in place, pass tensor.contiguous() and copy the result back"
            )
        if not _STRIDED:
            _STRIDED.append(x.layout)
        _TORCH_DTYPE_OBJS[x.dtype] = dtype
        if dtype in _CODES:
            DTYPE_CODES[x.dtype] = _CODES[dtype]
        _TORCH_CLASSES.add(x.__class__)
        return (x.data_ptr(), x.numel(), dtype, x)
    if _is_numpy(x):
        dtype = _NUMPY_DTYPES.get(x.dtype.name)
        if dtype is None:
            raise TypeError(f"{name}: dtype {x.dtype} is not one oxcomm reduces ({SUPPORTED})")
        if write and not x.flags.writeable:
            raise ValueError(f"{name}: the array is read-only and this op writes it")
        if not x.flags.c_contiguous:
            raise ValueError(
                f"{name}: the array is not C-contiguous; pass numpy.ascontiguousarray(x) and copy the result back"
            )
        if x.dtype.byteorder == ">":
            raise TypeError(f"{name}: big-endian arrays are not supported")
        return (x.__array_interface__["data"][0], x.size, dtype, x)
    raise TypeError(f"{name}: expected a numpy array or a torch CPU tensor, got {type(x).__name__}")


def check_device(x, name):
    """``TypeError``/``ValueError`` naming ``name`` if the device tensor ``x`` cannot be staged:
    the dtypes and layouts of :func:`buffer` (a CUDA op takes what the host op takes)."""
    if x.layout.__repr__() != "torch.strided":
        raise ValueError(f"{name}: a {x.layout} tensor; oxcomm works on dense (strided) tensors")
    if _TORCH_DTYPES.get(str(x.dtype)) is None:
        raise TypeError(f"{name}: dtype {x.dtype} on {x.device} is not one oxcomm reduces ({SUPPORTED})")
    if not x.is_contiguous():
        raise ValueError(
            f"{name}: the tensor on {x.device} is not contiguous (strides {tuple(x.stride())}); pass "
            "tensor.contiguous() and copy the result back"
        )


def overlap(a, b):
    """Whether two buffers from :func:`buffer` share memory (the second one's owner may be copied)."""
    if a[1] == 0 or b[1] == 0:
        return False
    size = _SIZES[a[2]]
    return a[0] < b[0] + b[1] * _SIZES[b[2]] and b[0] < a[0] + a[1] * size


def block_of(inner, outer, index, parts):
    """Whether buffer ``inner`` is exactly block ``index`` of ``outer`` cut into ``parts`` equal
    blocks (same dtype): the layout of an in-place all_gather, gather or scatter."""
    return (
        inner[2] == outer[2]
        and inner[1] > 0
        and inner[1] * parts == outer[1]
        and inner[0] == outer[0] + index * inner[1] * _SIZES[inner[2]]
    )


def same(a, b):
    """Whether two buffers are the same memory with the same dtype and length."""
    return a[0] == b[0] and a[1] == b[1] and a[2] == b[2]


_SIZES = {
    "f32": 4,
    "f64": 8,
    "f16": 2,
    "bf16": 2,
    "i8": 1,
    "u8": 1,
    "i32": 4,
    "i64": 8,
    "bool": 1,
    "i16": 2,
    "u16": 2,
    "u32": 4,
    "u64": 8,
    "c64": 8,
    "c128": 16,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "f8e4m3fnuz": 1,
    "f8e5m2fnuz": 1,
    "f8e8m0fnu": 1,
}


# dtype name -> its index in the native module's DTYPES (the library's order)
_CODES = {name: i for i, name in enumerate(_native.DTYPES)}


def copy_of(x):
    """A copy of an array or tensor (for an input that overlaps the output)."""
    return x.clone() if _is_torch(x) else x.copy()
