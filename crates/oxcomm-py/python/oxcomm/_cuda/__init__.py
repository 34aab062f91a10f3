"""Device (CUDA) tensors on oxcomm's host collectives.

An op on torch CUDA tensors is *staged*: its inputs are copied to pinned host buffers, the host
collective runs on them, and its outputs are copied back, with NCCL's stream semantics (the op
runs after the work already queued on the tensors' current stream; work queued after it on that
stream sees the result; no device-wide synchronize). Large elementwise ops are cut into chunks so
that the copies overlap the host collective.

Modules, one question each: :mod:`.device` (what the device offers: streams, events, copies,
pinned memory; CUDA through ``torch.cuda``), :mod:`.pool` (reused pinned buffers),
:mod:`.staging` (the copy-out / host op / copy-back pipeline), :mod:`.work` (issue order: the lane
thread and the Work an async op returns), :mod:`.ops` (which tensors each op reads and writes).
Nothing here imports torch until an op on a device tensor runs.
"""
