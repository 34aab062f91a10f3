"""DeepSpeed's communication-compressing optimizers, maintained in oxcomm.

DeepSpeed removed 1-bit Adam, 1-bit LAMB and 0/1 Adam (and their compressed backends) in
0.19.8; these are oxcomm's versions, as ``torch.optim.Optimizer``s over a model's parameters,
on CPU and CUDA tensors. Each file holds one optimizer's math and state; the compressed
all-reduce they call is :mod:`oxcomm.onebit`'s.
"""

from .onebit_adam import OnebitAdam

__all__ = ["OnebitAdam"]
