"""DeepSpeed's 0/1 Adam as a ``torch.optim.Optimizer`` on oxcomm's 1-bit all-reduce.

This module owns the optimizer's math, its two schedules and its state; the protocol it shares
with the other 1-bit optimizers (who averages, the group, saving) is :mod:`._common`'s, the
compressed all-reduce :mod:`oxcomm.onebit_torch`'s.

Vocabulary (the paper's, arXiv:2202.06009). *Variance phase*: steps up to
``var_freeze_step + 1``; the variance is updated only on *variance steps* (every
``var_interval``-th step, with the group's exact mean gradient); the other steps send the
gradient through the 1-bit all-reduce. ``var_interval`` starts at 1 and doubles after every
``var_update_scaler`` variance steps. *Local phase*: after that, the variance is frozen and no
gradient is sent; each rank takes *local steps* with its own gradient, and every
``local_step_interval``-th step is a *sync step* that sends the rank's displacement since the
last sync (scaled by the variance's denominator) through the 1-bit all-reduce and rebuilds
momentum and parameters from the group's mean. ``local_step_interval`` starts at 1 and doubles,
up to ``local_step_clipper``, after every ``local_step_scaler`` local steps.

Cost (``P`` parameters, ``n`` ranks): a variance step sends ``2·(n−1)/n · 4·P`` bytes (exact),
a 1-bit step about ``2·(n−1)/n · P/8``, a local step that is not a sync step nothing.
"""

from __future__ import annotations

import torch

from ._common import ERROR_KEYS, OnebitOptimizer, check_adam_args


class ZeroOneAdam(OnebitOptimizer):
    """DeepSpeed's 0/1 Adam (``deepspeed/runtime/fp16/onebit/zoadam.py``, removed in 0.19.8) on
    oxcomm's 1-bit all-reduce, on CPU or CUDA float32 parameters.

    Step ``k`` (counting from 1), per parameter (see the module docs for the vocabulary):

    * ``k = 1``: nothing but the step count changes (DeepSpeed's initialization step).
    * variance phase: on a variance step (``k % var_interval == 0``), with the group's mean
      gradient ``g``: ``v ← β2·v + (1−β2)·g²``, ``m ← β1·m + (1−β1)·g``; on the others
      ``m ← β1·m + (1−β1)·ĝ`` with ``ĝ`` the 1-bit all-reduce of this rank's gradient (times the
      group's ``exp_avg_mask``, if any); then ``p ← p − lr·(m/(√v + eps) + wd·p)``. After step
      ``var_freeze_step + 1`` the local phase starts and the error buffers are zeroed (they
      held gradients' errors; they will hold displacements').
    * local phase, with this rank's own gradient: ``m ← β1·m + (1−β1)·g``, the same update
      ``δ = −lr·(m/(√v + eps) + wd·p)`` added to ``p`` and to the running sum ``u``, ``Σlr``
      accumulated. On a sync step (``k % local_step_interval == 0``): ``p ← p − u``,
      ``d ← `` the 1-bit all-reduce of ``u·(√v + eps)``, ``m ← −d/Σlr``,
      ``p ← p + d/(√v + eps)``, ``u ← 0``, ``Σlr ← 0`` (DeepSpeed's arithmetic, step for step).

    Options that depart from DeepSpeed, each off by default: ``identical_sync`` keeps the
    parameters of the last sync ``a`` instead of the running sum (``d`` is the all-reduce of
    ``(p − a)·(√v + eps)`` and ``p ← a + d/(√v + eps)``, ``a ← p``): DeepSpeed's ``p − u`` leaves
    each rank's parameters off by its own rounding after every sync, ``a`` gives every rank the
    same parameters, bit for bit. ``mask_zero_variance`` zeroes the decompressed gradient or
    displacement of elements whose variance is exactly 0 (DeepSpeed had only the user's
    ``exp_avg_mask``): they never had a gradient, and 1-bit noise divided by ``eps`` throws
    them far. With ``Σlr = 0`` (a learning rate of 0) the momentum becomes 0 (DeepSpeed divided
    by it: NaN; nothing else changes where DeepSpeed's result is finite).

    Who averages the variance steps' gradients (and ``group``): as
    :class:`~oxcomm.optim.OnebitAdam`; the DDP hook and the DeepSpeed engine send nothing on the
    other steps. No bias correction, as in DeepSpeed.
    """

    NAME = "ZeroOneAdam"

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        var_freeze_step=100000,
        var_update_scaler=16,
        local_step_scaler=32678,
        local_step_clipper=16,
        group=None,
        grads_averaged=False,
        bias_correction=True,
        amsgrad=False,
        deepspeed=None,
        mask_zero_variance=False,
        identical_sync=False,
    ):
        check_adam_args("0/1 Adam", lr, betas, amsgrad)
        self.identical_sync = bool(identical_sync)
        for name, v in (
            ("var_update_scaler", var_update_scaler),
            ("local_step_scaler", local_step_scaler),
            ("local_step_clipper", local_step_clipper),
        ):
            if int(v) < 1:
                raise ValueError(f"invalid {name} {v}: must be at least 1")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction)
        self.var_freeze_step = int(var_freeze_step)
        self.var_update_scaler = int(var_update_scaler)
        self.local_step_scaler = int(local_step_scaler)
        self.local_step_clipper = int(local_step_clipper)
        self.frozen = False
        self.var_interval = 1
        self.var_counter = 0
        self.local_step_interval = 1
        self.local_step_counter = 0
        super().__init__(
            params,
            defaults,
            group=group,
            grads_averaged=grads_averaged,
            deepspeed=deepspeed,
            mask_zero_variance=mask_zero_variance,
        )

    def exact_next(self):
        return not self.frozen and (self.steps + 1) % self.var_interval == 0

    def _init_state(self, p, state):
        super()._init_state(p, state)
        state["lrs"] = 0.0

    def _step(self, params):
        if self.frozen:
            self._local_step(params)
        else:
            self._variance_phase_step(params)
            if self.steps > self.var_freeze_step:
                self.frozen = True
                for st in self.state.values():
                    for k in ERROR_KEYS:
                        if k in st:
                            st[k].zero_()

    def _variance_phase_step(self, params):
        exact = self.steps % self.var_interval == 0
        for group, p in params:
            state = self.state[p]
            beta1, beta2 = group["betas"]
            exp_avg, exp_avg_sq, grad = state["exp_avg"], state["exp_avg_sq"], p.grad
            if exact:
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            elif self.size > 1:
                grad = self.comms.compressed_(grad.clone(), *self._errors(p, state))
                self._mask_(group, grad, exp_avg_sq)
            exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
            self._adam_update(group, p, exp_avg, exp_avg_sq)
        if exact:
            self.var_counter += 1
            if self.var_counter == self.var_update_scaler:
                self.var_counter = 0
                self.var_interval *= 2

    def _local_step(self, params):
        sync = self.steps % self.local_step_interval == 0
        for group, p in params:
            state = self.state[p]
            beta1 = group["betas"][0]
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            if self.identical_sync and "anchor" not in state:
                state["anchor"] = p.detach().clone()
            if not self.identical_sync and "momentum_accumulator" not in state:
                state["momentum_accumulator"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            exp_avg.mul_(beta1).add_(p.grad, alpha=1 - beta1)
            state["lrs"] += group["lr"]
            if self.identical_sync:
                self._adam_update(group, p, exp_avg, exp_avg_sq)
                if sync:
                    self._sync_to_anchor(group, p, state)
            else:
                update = exp_avg / (exp_avg_sq.sqrt() + group["eps"])
                if group["weight_decay"] > 0.0:
                    update += group["weight_decay"] * p
                delta = -group["lr"] * update
                p.add_(delta)
                state["momentum_accumulator"].add_(delta)
                if sync:
                    self._sync(group, p, state)
        self.local_step_counter += 1
        if self.local_step_counter == self.local_step_scaler:
            self.local_step_counter = 0
            self.local_step_interval = min(self.local_step_clipper, self.local_step_interval * 2)

    def _sync(self, group, p, state):
        """DeepSpeed's sync: back by the running sum ``u``, forward by the group's mean of it."""
        exp_avg, exp_avg_sq, u = state["exp_avg"], state["exp_avg_sq"], state["momentum_accumulator"]
        p.add_(-1 * u)
        u.mul_(exp_avg_sq.sqrt() + group["eps"])
        if self.size > 1:
            self.comms.compressed_(u, *self._errors(p, state))
            self._mask_(group, u, exp_avg_sq)
        if state["lrs"] > 0:
            exp_avg.zero_().add_(u / state["lrs"], alpha=-1)
        else:
            # DeepSpeed divides by the summed learning rates unguarded: NaN with lr = 0.
            exp_avg.zero_()
        p.add_(u / (exp_avg_sq.sqrt() + group["eps"]))
        u.zero_()
        state["lrs"] = 0.0

    def _sync_to_anchor(self, group, p, state):
        """``identical_sync``: from the parameters of the last sync, the same on every rank."""
        exp_avg, anchor = state["exp_avg"], state["anchor"]
        denom = state["exp_avg_sq"].sqrt().add_(group["eps"])
        moved = (p - anchor).mul_(denom)
        if self.size > 1:
            self.comms.compressed_(moved, *self._errors(p, state))
            self._mask_(group, moved, state["exp_avg_sq"])
        if state["lrs"] > 0:
            torch.div(moved, -state["lrs"], out=exp_avg)
        else:
            # DeepSpeed divides by the summed learning rates unguarded: NaN with lr = 0.
            exp_avg.zero_()
        anchor.add_(moved.div_(denom))
        p.copy_(anchor)
        state["lrs"] = 0.0

    @staticmethod
    def _adam_update(group, p, exp_avg, exp_avg_sq):
        update = exp_avg / (exp_avg_sq.sqrt() + group["eps"])
        if group["weight_decay"] > 0.0:
            update.add_(p, alpha=group["weight_decay"])
        p.add_(update, alpha=-group["lr"])

    _COUNTERS = ("frozen", "var_interval", "var_counter", "local_step_interval", "local_step_counter")

    def _extra_state(self):
        return {k: getattr(self, k) for k in self._COUNTERS}

    def _load_extra_state(self, extra, own_errors):
        if all(k in extra for k in self._COUNTERS):
            for k in self._COUNTERS:
                setattr(self, k, type(getattr(self, k))(extra[k]))
            return
        # A DeepSpeed-saved dict: its counters are per parameter (all equal); its displacement
        # since the last sync was not saved, so the next sync starts from the loaded parameters.
        first = next((st for st in self.state.values() if "var_interval" in st), {})
        self.var_interval = int(first.get("var_interval", 1))
        self.var_counter = int(first.get("var_counter", 0))
        self.local_step_interval = int(first.get("local_step_interval", 1))
        self.local_step_counter = int(first.get("local_step_counter", 0))
        self.frozen = self.steps > max(1, self.var_freeze_step)
        for st in self.state.values():
            st["lrs"] = 0.0
            st.pop("momentum_accumulator", None)
