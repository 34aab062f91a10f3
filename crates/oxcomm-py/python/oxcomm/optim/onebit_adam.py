"""DeepSpeed's 1-bit Adam as a ``torch.optim.Optimizer`` on oxcomm's 1-bit all-reduce.

This module owns the optimizer's math and state; the compressed all-reduce is
:mod:`oxcomm.onebit`'s and the group lookup :mod:`oxcomm.torch`'s.
"""

from __future__ import annotations

import torch

import oxcomm
import oxcomm.torch as oxtorch


class OnebitAdam(torch.optim.Optimizer):
    """DeepSpeed's 1-bit Adam (``deepspeed/runtime/fp16/onebit/adam.py``) on oxcomm's 1-bit
    all-reduce, for a plain torch loop, a DDP loop or as DeepSpeed's client optimizer.

    Step ``k`` (counting from 1), per parameter, as DeepSpeed does:

    * ``k = 1`` (the initialization step): nothing but the step count changes (DeepSpeed
      only allocates its error buffers).
    * warm-up (not frozen): the gradient is averaged exactly over the group (unless someone
      else already did: see ``grads_averaged``), ``m ← β1·m + (1−β1)·g``,
      ``v ← β2·v + (1−β2)·g²``, ``p ← p − lr·(m/(√v + eps) + wd·p)``. When the step count
      reaches ``freeze_step`` the optimizer freezes.
    * frozen: ``m ← β1·m + (1−β1)·g_local`` with this rank's own gradient, then ``m ←``
      oxcomm's 1-bit error-compensated all-reduce of ``m`` (one per parameter, with
      DeepSpeed's padding and per-rank error buffers), ``v`` frozen, same update.

    As in DeepSpeed there is no bias correction, and a parameter group may carry an
    ``exp_avg_mask`` (a tensor broadcastable to its parameters) that multiplies the momentum
    after each compressed step: 1-bit compression cannot represent an exact zero, so elements
    whose gradient is always zero (unused embedding rows, units that never fire) would otherwise
    get an update of ``scale / eps`` and diverge. Who averages the warm-up gradients:

    * a plain loop: this optimizer (``grads_averaged=False``, the default);
    * DDP: register :meth:`ddp_comm_hook` (``model.register_comm_hook(None, opt.ddp_comm_hook)``):
      it averages buckets while warming up and sends nothing once frozen;
    * DeepSpeed: call :meth:`bind_engine` with the engine ``deepspeed.initialize`` returned;
      the engine averages while warming up and its backward all-reduce is switched off at
      freeze time, as DeepSpeed's own OnebitAdam does.

    ``group`` is an oxcomm torch process group (default: the default group) or an
    :class:`oxcomm.Communicator`.
    """

    def __init__(
        self,
        params,
        lr=1e-3,
        freeze_step=100000,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        group=None,
        grads_averaged=False,
        bias_correction=True,
        amsgrad=False,
    ):
        if amsgrad:
            raise RuntimeError("1-bit Adam does not support the AMSGrad variant")
        if not 0.0 <= lr:
            raise ValueError(f"invalid learning rate {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction)
        super().__init__(params, defaults)
        self.freeze_step = int(freeze_step)
        self.comm = group if isinstance(group, oxcomm.Communicator) else oxtorch.communicator(group)
        self.grads_averaged = grads_averaged
        self.frozen = False
        self.steps = 0
        self._engine = None

    @property
    def size(self):
        return self.comm.size

    def bind_engine(self, engine):
        """Use DeepSpeed's protocol: ``engine`` averages gradients while warming up, and its
        backward all-reduce is switched off at freeze time."""
        self._engine = engine
        self.grads_averaged = True
        if self.frozen:
            self._set_engine_allreduce(False)

    def _set_engine_allreduce(self, on):
        if self._engine is None:
            return
        if hasattr(self._engine, "pipeline_enable_backward_allreduce"):
            self._engine.pipeline_enable_backward_allreduce = on
        else:
            self._engine.enable_backward_allreduce = on

    def ddp_comm_hook(self, state, bucket):
        """A DDP communication hook: the exact average while warming up, nothing once frozen
        (each rank keeps its local gradient; the momentum is compressed in :meth:`step`)."""
        t = bucket.buffer()
        fut = torch.futures.Future()
        if self.frozen:
            fut.set_result(t)
            return fut
        self.comm.all_reduce(t, oxcomm.ReduceOp.AVG)
        fut.set_result(t)
        return fut

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.steps += 1
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        for p in params:
            if p.grad.is_sparse:
                raise RuntimeError("1-bit Adam does not support sparse gradients")
            if p.device.type != "cpu" or p.dtype != torch.float32:
                raise TypeError(f"OnebitAdam: parameters must be float32 CPU tensors, got {p.dtype} on {p.device}")
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
        if self.steps == 1:
            return loss
        if not self.frozen and not self.grads_averaged and self.comm.size > 1 and params:
            grads = [p.grad for p in params]
            if all(g.is_contiguous() for g in grads):
                self.comm.all_reduce_coalesced(grads, oxcomm.ReduceOp.AVG)
            else:
                for g in grads:
                    g.copy_(self._averaged(g))
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                grad = p.grad
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                if not self.frozen:
                    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                else:
                    if self.comm.size > 1:
                        self._compressed(state, exp_avg)
                    mask = group.get("exp_avg_mask")
                    if mask is not None:
                        exp_avg.mul_(mask)
                update = exp_avg / (exp_avg_sq.sqrt() + group["eps"])
                if group["weight_decay"] > 0.0:
                    update += group["weight_decay"] * p
                p.add_(update, alpha=-group["lr"])
        if not self.frozen and self.steps >= self.freeze_step:
            self.frozen = True
            self._set_engine_allreduce(False)
        return loss

    def _averaged(self, g):
        c = g.contiguous()
        self.comm.all_reduce(c, oxcomm.ReduceOp.AVG)
        return c

    def _compressed(self, state, exp_avg):
        """``exp_avg ← compressed_allreduce(exp_avg)`` with this parameter's error state."""
        from oxcomm import onebit

        n = exp_avg.numel()
        if "onebit" not in state:
            state["onebit"] = onebit.State(n, self.comm)
            state["onebit_buf"] = torch.zeros(state["onebit"].padded_len, dtype=torch.float32)
        st, buf = state["onebit"], state["onebit_buf"]
        buf[:n].copy_(exp_avg.view(-1))
        buf[n:].zero_()
        onebit.all_reduce(self.comm, buf, st)
        exp_avg.view(-1).copy_(buf[:n])

    def load_state_dict(self, state_dict):
        """As DeepSpeed: the error buffers are dropped (they are per rank) and the freeze state
        follows the loaded step count."""
        super().load_state_dict(state_dict)
        steps = 0
        for st in self.state.values():
            st.pop("onebit", None)
            st.pop("onebit_buf", None)
            steps = max(steps, int(st.get("step", 0)))
        self.steps = steps
        self.frozen = steps >= self.freeze_step and steps > 1
        self._set_engine_allreduce(not self.frozen)

    def state_dict(self):
        sd = super().state_dict()
        for st in sd["state"].values():
            st.pop("onebit", None)
            st.pop("onebit_buf", None)
        return sd
