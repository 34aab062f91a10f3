"""DeepSpeed's communication-compressing optimizers, maintained in oxcomm.

DeepSpeed removed 1-bit Adam, 1-bit LAMB and 0/1 Adam (and their compressed backends) in
0.19.8; these are oxcomm's versions, as ``torch.optim.Optimizer``s over a model's parameters,
on CPU and CUDA tensors, over any torch process group or an :class:`oxcomm.Communicator`. Each
file holds one optimizer's math and state; what they share (the group, who averages the exact
steps' gradients under a plain loop, DDP or DeepSpeed, saving) is :mod:`._common`'s, and the
compressed all-reduce they call is :mod:`oxcomm.onebit_torch`'s.
"""

from .onebit_adam import OnebitAdam
from .onebit_lamb import OnebitLamb
from .zero_one_adam import ZeroOneAdam

__all__ = ["OnebitAdam", "OnebitLamb", "ZeroOneAdam"]
