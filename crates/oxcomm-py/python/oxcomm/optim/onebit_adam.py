"""DeepSpeed's 1-bit Adam as a ``torch.optim.Optimizer`` on oxcomm's 1-bit all-reduce.

This module owns the optimizer's math and state; the protocol it shares with the other 1-bit
optimizers (who averages, the group, saving) is :mod:`._common`'s, the compressed all-reduce
:mod:`oxcomm.onebit_torch`'s.

Cost per step after the warm-up (``P`` parameters, ``n`` ranks): one 1-bit all-reduce per
parameter tensor, each rank sending about ``2·(n−1)/n · P/8`` bytes of signs plus two float32
scales per tensor and peer, where exact Adam sends ``2·(n−1)/n · 4·P`` (32× fewer).
"""

from __future__ import annotations

from ._common import OnebitOptimizer, check_adam_args


class OnebitAdam(OnebitOptimizer):
    """DeepSpeed's 1-bit Adam (``deepspeed/runtime/fp16/onebit/adam.py``, removed in 0.19.8) on
    oxcomm's 1-bit all-reduce, for a plain torch loop, a DDP loop or as DeepSpeed's client
    optimizer, on CPU or CUDA float32 parameters.

    Step ``k`` (counting from 1), per parameter, as DeepSpeed does:

    * ``k = 1`` (the initialization step): nothing but the step count changes.
    * warm-up (not frozen): the gradient ``g`` is the group's mean,
      ``m ← β1·m + (1−β1)·g``, ``v ← β2·v + (1−β2)·g²``, ``p ← p − lr·(m/(√v + eps) + wd·p)``.
      When the step count reaches ``freeze_step`` the optimizer freezes.
    * frozen: ``m ← β1·m + (1−β1)·g_local`` with this rank's own gradient, then ``m ←`` the 1-bit
      error-compensated all-reduce of ``m`` (one per parameter, with DeepSpeed's padding and this
      rank's error buffers, kept in the parameter's state on its device), ``v`` frozen, same
      update. A parameter group with ``non_freeze=True`` keeps exact Adam (averaged gradient,
      both moments updated) in this phase, as in DeepSpeed.

    As in DeepSpeed there is no bias correction (``bias_correction`` is accepted and ignored),
    and a parameter group may carry an ``exp_avg_mask`` (a tensor broadcastable to its
    parameters) that multiplies the momentum after each compressed step: 1-bit compression
    cannot represent an exact zero, so elements whose gradient is always zero (unused embedding
    rows, units that never fire) would otherwise get an update of ``scale / eps`` and diverge.
    ``mask_zero_variance=True`` masks those elements without a user mask: every element whose
    frozen variance is exactly 0 gets a zero momentum. It is off by default here, as in
    DeepSpeed (and on by default in 1-bit LAMB and 0/1 Adam).

    Who averages the warm-up gradients: this optimizer in a plain loop; :meth:`ddp_comm_hook`
    under DDP (``model.register_comm_hook(None, opt.ddp_comm_hook)``); the engine under DeepSpeed
    (:meth:`bind_engine`, or ``deepspeed=engine``). ``group``: torch's default group (``None``),
    any torch process group, or an :class:`oxcomm.Communicator`. ``grads_averaged=True``: the
    caller averages the warm-up gradients itself.
    """

    NAME = "OnebitAdam"

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
        deepspeed=None,
        mask_zero_variance=False,
    ):
        check_adam_args("1-bit Adam", lr, betas, amsgrad)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction)
        self.freeze_step = int(freeze_step)
        self.frozen = False
        super().__init__(
            params,
            defaults,
            group=group,
            grads_averaged=grads_averaged,
            deepspeed=deepspeed,
            mask_zero_variance=mask_zero_variance,
        )

    def exact_next(self):
        return not self.frozen

    def _step(self, params):
        if self.frozen and self.size > 1:
            # DeepSpeed's non_freeze groups stay exact: their gradients are averaged here.
            exact = [p.grad for group, p in params if group.get("non_freeze")]
            if exact:
                self.comms.mean_(exact)
        for group, p in params:
            state = self.state[p]
            beta1, beta2 = group["betas"]
            exp_avg, exp_avg_sq, grad = state["exp_avg"], state["exp_avg_sq"], p.grad
            exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
            if not self.frozen or group.get("non_freeze"):
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            else:
                if self.size > 1:
                    self.comms.compressed_(exp_avg, *self._errors(p, state))
                self._mask_(group, exp_avg, exp_avg_sq)
            update = exp_avg / (exp_avg_sq.sqrt() + group["eps"])
            if group["weight_decay"] > 0.0:
                update.add_(p, alpha=group["weight_decay"])
            p.add_(update, alpha=-group["lr"])
        if not self.frozen and self.steps >= self.freeze_step:
            self.frozen = True

    def _extra_state(self):
        return {"frozen": self.frozen}

    def _load_extra_state(self, extra, own_errors):
        self.frozen = bool(extra["frozen"]) if "frozen" in extra else self.steps >= max(2, self.freeze_step)
