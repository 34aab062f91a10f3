"""The coalesced and quantized reduce-scatters of DeepSpeed and ZeRO++, on lists of arrays or
tensors. Both return, for each input, this rank's partition of the **mean** over the group
(DeepSpeed's quantized path returns sum / hosts; oxcomm returns the mean on every path).
Partition ``r`` of a tensor of ``L`` elements is ``ceil(L / size)`` elements from
``r · ceil(L / size)`` (the last ones shorter or empty), as in DeepSpeed.

On CUDA tensors both are blocking ops, as on the host: the inputs are copied to the host on
their current stream (so after the work queued there), behind the ops queued on the
communicator, and the results are new tensors on the inputs' device. A list that mixes device
and host tensors is a ``ValueError`` naming the op.
"""

from . import _native
from ._buffers import _is_torch
from ._buffers import buffer as _buf
from ._cuda import device as _dev


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


def _on_host(comm, tensors, what):
    """``(host tensors, device or None)``: device tensors copied to the host (see the module
    docs); host ones as they are."""
    owned = [_dev.owns(t) for t in tensors]
    if not any(owned):
        return tensors, None
    if not all(owned):
        raise ValueError(f"oxcomm: {what}: device and host tensors in one list; pass all of them on one device")
    comm._drain(what)
    host = []
    for t in tensors:
        h = _dev.device().host_empty(t.shape, t.dtype)
        h.copy_(t)  # blocking, on the tensor's current stream
        host.append(h)
    return host, tensors[0].device


def _back(outs, device):
    return outs if device is None else [o.to(device) for o in outs]


def reduce_scatter_coalesced(comm, tensors):
    """DeepSpeed's ``reduce_scatter_coalesced``: this rank's partition of each tensor's mean."""
    host, device = _on_host(comm, list(tensors), "reduce_scatter_coalesced")
    bufs = [_buf(t, f"tensors[{i}]", write=False) for i, t in enumerate(host)]
    return _back(_wrap(_native.reduce_scatter_coalesced(comm._c, bufs), host), device)


def all_to_all_quant_reduce(comm, tensors, ranks_per_host=None):
    """ZeRO++'s qgZ: int4 on the wire in two all-to-alls (inside each host, then across)."""
    host, device = _on_host(comm, list(tensors), "all_to_all_quant_reduce")
    bufs = [_buf(t, f"tensors[{i}]", write=False) for i, t in enumerate(host)]
    shapes = [[int(d) for d in t.shape] for t in host]
    return _back(_wrap(_native.all_to_all_quant_reduce(comm._c, bufs, shapes, ranks_per_host), host), device)
