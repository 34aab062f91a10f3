"""What the three 1-bit optimizers share: the group they talk to, who averages the gradients of
their exact steps, the checks on parameters, and the state DeepSpeed's versions dropped.

* :class:`Group`: the exact mean of a list of tensors and the 1-bit compressed all-reduce, over
  an :class:`oxcomm.Communicator` or any torch process group (an oxcomm group, gloo, NCCL), on
  CPU or CUDA tensors. The exact mean is a sum over the group divided by its size, through
  ``torch.distributed.all_reduce`` on a torch group (so a CUDA tensor follows the backend's
  stream semantics) or ``Communicator.all_reduce`` on a communicator (a CUDA tensor is then
  copied to host memory and back, synchronously: a communicator holds host memory only).
* :class:`OnebitOptimizer`: the protocol the three follow, as DeepSpeed's did. Step 1 only
  allocates (DeepSpeed's initialization step). Each later step either needs the group's mean
  gradient (an *exact* step: warm-up, 1-bit LAMB's exact phase, 0/1 Adam's variance steps) or
  this rank's own (the optimizer communicates compressed). The subclass says which with
  :meth:`OnebitOptimizer.exact_next`; who averages an exact step's gradients:

  - a plain loop: the optimizer, in :meth:`~OnebitOptimizer.step`;
  - DDP: :meth:`~OnebitOptimizer.ddp_comm_hook`, which averages the buckets before an exact step
    and sends nothing before the others;
  - DeepSpeed: the engine, whose backward all-reduce :meth:`~OnebitOptimizer.bind_engine`
    switches on before exact steps and off before the others (``enable_backward_allreduce``, or
    ``pipeline_enable_backward_allreduce`` for a pipeline engine), as DeepSpeed's optimizers did.

  ``state_dict()`` holds everything a resumed run needs to continue bit for bit like one that
  was never interrupted: the per-parameter error buffers (each rank's own: save one file per
  rank), the step count and phase, and the subclass's counters (:meth:`_extra_state`), under the
  key ``"oxcomm"``. A dict saved by another rank or group size has its error buffers dropped on
  load (zeroed, DeepSpeed's behaviour on every load), with a warning.

Empty parameters are skipped (they have no state and send nothing), and parameters are checked
to be dense float32 tensors (the 1-bit all-reduce's type), with errors naming the rank, the
optimizer and the parameter. This module owns none of the optimizers' math
(:mod:`.onebit_adam`, :mod:`.onebit_lamb`, :mod:`.zero_one_adam`) and not the compressed
all-reduce itself (:mod:`oxcomm.onebit_torch`).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

import oxcomm
from oxcomm.onebit_torch import CompressedAllreduce, padded_len

__all__ = ["Group", "OnebitOptimizer"]

#: The keys of a parameter's state that belong to this rank only.
ERROR_KEYS = ("worker_error", "server_error")


class Group:
    """An optimizer's group: ``None`` (torch's default group), a torch process group, or an
    :class:`oxcomm.Communicator`. ``rank`` and ``size`` are this rank's and the group's."""

    def __init__(self, group=None):
        self.group = group
        if isinstance(group, oxcomm.Communicator):
            self.comm = group
            self.rank, self.size = group.rank, group.size
        else:
            if not dist.is_initialized():
                raise RuntimeError(
                    "oxcomm.optim: torch.distributed is not initialized; call "
                    "torch.distributed.init_process_group first or pass group=<oxcomm.Communicator>"
                )
            self.comm = None
            self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self._compressed = None

    def mean_(self, tensors):
        """Replaces each tensor by its mean over the group, in place (one all-reduce per device
        and dtype, over the tensors flattened into one buffer)."""
        if self.size == 1:
            return
        by_kind = {}
        for t in tensors:
            if t.numel():
                by_kind.setdefault((t.device, t.dtype), []).append(t)
        for same in by_kind.values():
            if len(same) == 1 and same[0].is_contiguous():
                flat = same[0].view(-1)
                self._sum_(flat)
                flat.div_(self.size)
                continue
            flat = _flatten_dense_tensors(same)
            self._sum_(flat)
            flat.div_(self.size)
            for t, mean in zip(same, _unflatten_dense_tensors(flat, same)):
                t.copy_(mean)

    def _sum_(self, flat):
        if self.comm is None:
            dist.all_reduce(flat, group=self.group)
        elif flat.device.type == "cpu":
            self.comm.all_reduce(flat, oxcomm.ReduceOp.SUM)
        else:
            host = flat.cpu()
            self.comm.all_reduce(host, oxcomm.ReduceOp.SUM)
            flat.copy_(host)

    def compressed_(self, buf, worker_error, server_error):
        """DeepSpeed's ``compressed_allreduce`` of ``buf`` into ``buf`` itself (any shape), with
        the caller's error buffers (``padded_len(buf.numel(), size)`` and that ``/ size``)."""
        if self._compressed is None:
            self._compressed = CompressedAllreduce(self.group)
        out = self._compressed(buf, worker_error, server_error)
        if out is not buf:
            buf.copy_(out)
        return buf

    def forget_errors(self):
        """Drops what the compressed all-reduce cached about error buffers (after a load)."""
        self._compressed = None


def check_adam_args(name, lr, betas, amsgrad):
    """The argument checks the three optimizers share (DeepSpeed's messages)."""
    if amsgrad:
        raise RuntimeError(f"{name} does not support the AMSGrad variant")
    if not 0.0 <= lr:
        raise ValueError(f"invalid learning rate {lr}")
    if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
        raise ValueError(f"invalid betas {betas}")


def error_buffers(numel, size, device):
    """DeepSpeed's zeroed ``(worker_error, server_error)`` for ``numel`` elements."""
    n = padded_len(numel, size)
    worker = torch.zeros(n, dtype=torch.float32, device=device)
    return worker, torch.zeros(n // size, dtype=torch.float32, device=device)


class OnebitOptimizer(torch.optim.Optimizer):
    """The base of :class:`~oxcomm.optim.OnebitAdam`, :class:`~oxcomm.optim.OnebitLamb` and
    :class:`~oxcomm.optim.ZeroOneAdam` (see the module docs). Subclasses implement
    :meth:`exact_next`, :meth:`_step` and, for state of their own, :meth:`_extra_state` and
    :meth:`_load_extra_state`."""

    #: The optimizer's name in errors.
    NAME = "OnebitOptimizer"

    def __init__(self, params, defaults, *, group=None, grads_averaged=False, deepspeed=None, mask_zero_variance=True):
        super().__init__(params, defaults)
        self.comms = Group(group)
        self.mask_zero_variance = bool(mask_zero_variance)
        self.grads_averaged = bool(grads_averaged)
        self.steps = 0
        self._engine = None
        self._hook_averaged = False
        if deepspeed is not None:
            self.bind_engine(deepspeed)

    @property
    def size(self):
        return self.comms.size

    # ----------------------------------------------------------------------- the protocol

    def exact_next(self):
        """Whether the next step needs the group's mean gradient (else this rank's own)."""
        raise NotImplementedError

    def _step(self, params):
        """One step after the first: ``params`` is a list of ``(param_group, p)`` with a dense
        float32 gradient and state already initialized (:meth:`_init_state`)."""
        raise NotImplementedError

    def _init_state(self, p, state):
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _extra_state(self):
        return {}

    def _load_extra_state(self, extra, own_errors):
        pass

    def bind_engine(self, engine):
        """DeepSpeed's protocol: ``engine`` (from ``deepspeed.initialize``) averages the gradients
        of exact steps, and its backward all-reduce is switched off before the others."""
        self._engine = engine
        self.grads_averaged = True
        self._sync_engine()

    def _sync_engine(self):
        if self._engine is None:
            return
        on = self.exact_next()
        if hasattr(self._engine, "pipeline_enable_backward_allreduce"):
            self._engine.pipeline_enable_backward_allreduce = on
        else:
            self._engine.enable_backward_allreduce = on

    def ddp_comm_hook(self, state, bucket):
        """A DDP communication hook (``model.register_comm_hook(None, opt.ddp_comm_hook)``): the
        group's mean before an exact step; nothing is sent before the others, each rank keeping
        its own gradient for the optimizer to compress."""
        t = bucket.buffer()
        if self.exact_next():
            self.comms.mean_([t])
            self._hook_averaged = True
        fut = torch.futures.Future()
        fut.set_result(t)
        return fut

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        exact = self.exact_next()
        self.steps += 1
        params = self._params_with_grads()
        if self.steps > 1:
            if exact and self.size > 1 and not self.grads_averaged and not self._hook_averaged:
                self.comms.mean_([p.grad for _, p in params])
            self._step(params)
        self._hook_averaged = False
        self._sync_engine()
        return loss

    def _params_with_grads(self):
        out = []
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if p.grad is None or p.numel() == 0:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(self._where(gi, pi, "has a sparse gradient; 1-bit optimizers need dense ones"))
                if p.dtype != torch.float32 or p.grad.dtype != torch.float32:
                    what = f"is {p.dtype} with a {p.grad.dtype} gradient; 1-bit optimizers take float32"
                    raise TypeError(self._where(gi, pi, what))
                state = self.state[p]
                if not state:
                    self._init_state(p, state)
                state["step"] += 1
                out.append((group, p))
        return out

    def _where(self, gi, pi, what):
        return f"rank {self.comms.rank}: {self.NAME}: parameter {pi} of group {gi} {what}"

    def _errors(self, p, state):
        """This parameter's ``(worker_error, server_error)``, allocated zeroed on its device."""
        if "worker_error" not in state:
            state["worker_error"], state["server_error"] = error_buffers(p.numel(), self.size, p.device)
            # The compressed all-reduce caches error states by the tensors' addresses and
            # versions: a new zeroed tensor where a freed one lived could pass for it.
            self.comms.forget_errors()
        return state["worker_error"], state["server_error"]

    def _mask_(self, group, t, exp_avg_sq):
        """What 1-bit compression cannot represent, an exact zero, put back into ``t`` (a
        decompressed momentum, gradient or displacement): DeepSpeed's ``exp_avg_mask`` of the
        group, if it has one, and with ``mask_zero_variance`` the elements whose variance is
        exactly 0 (they never had a non-zero gradient: a ReLU unit that never fired, an unused
        embedding row; their update would be the 1-bit noise divided by ``eps``)."""
        mask = group.get("exp_avg_mask")
        if mask is not None:
            if mask.device != t.device:
                group["exp_avg_mask"] = mask = mask.to(t.device)
            t.mul_(mask)
        if self.mask_zero_variance:
            t.masked_fill_(exp_avg_sq == 0, 0.0)

    # ----------------------------------------------------------------------- saving

    def state_dict(self):
        sd = super().state_dict()
        sd["oxcomm"] = dict(self._extra_state(), rank=self.comms.rank, size=self.size, steps=self.steps)
        return sd

    def load_state_dict(self, state_dict):
        """Loads a :meth:`state_dict`. As in DeepSpeed, each group's ``exp_avg_mask`` stays the one
        given to this optimizer, not the saved one. The error buffers are kept when the dict was
        saved by this rank of a group of this size, else dropped with a warning; a dict saved by
        DeepSpeed's optimizers (no ``"oxcomm"`` entry) resumes from its step count."""
        state_dict = dict(state_dict)
        extra = state_dict.pop("oxcomm", None)
        groups = []
        for mine, saved in zip(self.param_groups, state_dict["param_groups"]):
            saved = dict(saved)
            saved.pop("exp_avg_mask", None)
            if "exp_avg_mask" in mine:
                saved["exp_avg_mask"] = mine["exp_avg_mask"]
            groups.append(saved)
        state_dict["param_groups"] = groups
        super().load_state_dict(state_dict)
        own = extra is not None and extra.get("rank") == self.comms.rank and extra.get("size") == self.size
        if not own:
            dropped = False
            for st in self.state.values():
                for k in ERROR_KEYS:
                    dropped |= st.pop(k, None) is not None
            if dropped or extra is not None:
                saver = "an unknown rank" if extra is None else f"rank {extra.get('rank')} of {extra.get('size')}"
                warnings.warn(
                    f"rank {self.comms.rank}: {self.NAME}: the state dict was saved by {saver}, this is rank "
                    f"{self.comms.rank} of {self.size}: its 1-bit error buffers start from zero",
                    stacklevel=2,
                )
        if extra is not None:
            self.steps = int(extra["steps"])
        else:
            self.steps = max((int(st.get("step", 0)) for st in self.state.values()), default=0)
        self.comms.forget_errors()
        self._load_extra_state(extra or {}, own)
        self._hook_averaged = False
        self._sync_engine()
