"""The coalesced and quantized reduce-scatters of DeepSpeed and ZeRO++, on lists of arrays or
tensors. Both return, for each input, this rank's partition of the **mean** over the group
(DeepSpeed's quantized path returns sum / hosts; oxcomm returns the mean on every path).
Partition ``r`` of a tensor of ``L`` elements is ``ceil(L / size)`` elements from
``r · ceil(L / size)`` (the last ones shorter or empty), as in DeepSpeed.
"""

from . import _native
from ._buffers import _is_torch
from ._buffers import buffer as _buf




def _wrap(parts, like):
    out = []
    for data, x in zip(parts, like):
        if _is_torch(x):
            import torch

            t = torch.frombuffer(bytearray(data), dtype=x.dtype) if data else torch.empty(0, dtype=x.dtype)
            out.append(t)
        else:
            import numpy

            out.append(numpy.frombuffer(bytearray(data), dtype=x.dtype))
    return out


def reduce_scatter_coalesced(comm, tensors):
    """DeepSpeed's ``reduce_scatter_coalesced``: this rank's partition of each tensor's mean."""
    bufs = [_buf(t, f"tensors[{i}]", write=False) for i, t in enumerate(tensors)]
    return _wrap(_native.reduce_scatter_coalesced(comm._c, bufs), tensors)


def all_to_all_quant_reduce(comm, tensors, ranks_per_host=None):
    """ZeRO++'s qgZ: int4 on the wire in two all-to-alls (inside each host, then across)."""
    bufs = [_buf(t, f"tensors[{i}]", write=False) for i, t in enumerate(tensors)]
    shapes = [[int(d) for d in t.shape] for t in tensors]
    return _wrap(_native.all_to_all_quant_reduce(comm._c, bufs, shapes, ranks_per_host), tensors)
