"""DeepSpeed's 1-bit LAMB as a ``torch.optim.Optimizer`` on oxcomm's 1-bit all-reduce.

This module owns the optimizer's math and state; the protocol it shares with the other 1-bit
optimizers (who averages, the group, saving) is :mod:`._common`'s, the compressed all-reduce
:mod:`oxcomm.onebit_torch`'s.

Vocabulary (the paper's, arXiv:2104.06069): the *LAMB coefficient* of a parameter tensor is
``‖p‖ / ‖update‖`` clipped to ``[min_coeff, max_coeff]``; during the exact phase its running
average (``coeff_beta``) is kept as the tensor's *frozen coefficient*. After ``freeze_step`` the
momenta of all tensors are compressed together, as one *fused* buffer, so each is first
multiplied by its *scaling coefficient* (the mean over tensors of ``‖m‖/√numel`` divided by its
own, fixed at freeze time) to give every tensor's elements a similar magnitude under one scale.
The frozen coefficient is then corrected each step by a *factor*: the largest ratio of the
frozen variance's denominator to a *fresh* variance rebuilt from the compressed momenta,
clipped to ``[factor_min, factor_max]`` and to ``±factor_threshold`` of the previous factor.

Cost per compressed step (``P`` parameters, ``n`` ranks): one 1-bit all-reduce of the fused
buffer, each rank sending about ``2·(n−1)/n · P/8`` bytes, where exact LAMB sends
``2·(n−1)/n · 4·P``.
"""

from __future__ import annotations

import math

import torch

from oxcomm.onebit_torch import padded_len

from ._common import OnebitOptimizer, check_adam_args, error_buffers


class OnebitLamb(OnebitOptimizer):
    """DeepSpeed's 1-bit LAMB (``deepspeed/runtime/fp16/onebit/lamb.py``, removed in 0.19.8) on
    oxcomm's 1-bit all-reduce, on CPU or CUDA float32 parameters (all on one device: their
    momenta are compressed as one buffer).

    Step ``k`` (counting from 1):

    * ``k = 1``: nothing but the step count changes (DeepSpeed's initialization step).
    * exact phase (``k ≤ freeze_step``), per tensor, with the group's mean gradient ``g``:
      ``m ← β1·m + (1−β1)·g``, ``v ← β2·v + (1−β2)·g²``, ``u = m/(√v + eps) + wd·p``, the LAMB
      coefficient ``c`` (1 when ``‖p‖`` or ``‖u‖`` is 0); if ``c ≠ 1`` the frozen coefficient
      ``C ← coeff_beta·C + (1−coeff_beta)·c``; ``p ← p − lr·c·u``. At ``k = freeze_step`` the
      fresh variance starts as a copy of ``v`` and the optimizer freezes.
    * compressed phase, with this rank's own gradient: ``m ← (β1·m + (1−β1)·g)·s`` (``s`` the
      scaling coefficient), the 1-bit all-reduce of all ``m`` fused, ``m ← m/s`` (times the
      group's ``exp_avg_mask``, if any), the gradient rebuilt as ``ĝ = (m − β1·m_prev)/(1−β1)``,
      fresh variance ``w ← β2·w + (1−β2)·ĝ²``, ``u`` as above with the frozen ``v``, the factor
      ``f`` (see the module docs; with weight decay it is moved towards 1 by the share of ``u``
      that is not decay), ``p ← p − lr·C·f·u``.

    The momenta are fused into one buffer padded to a multiple of ``8·size``; the padding keeps
    what the last compressed all-reduce left there, as DeepSpeed's buffer does (it enters the
    next compression's scale).

    ``mask_zero_variance`` (off by default, as DeepSpeed has only the user's ``exp_avg_mask``)
    zeroes the decompressed momentum of elements whose frozen variance is exactly 0: they never
    had a gradient, and 1-bit noise divided by ``eps`` throws them far. A momentum of norm 0 gets
    the scaling coefficient 1 (DeepSpeed divided by that norm: NaN in every parameter; nothing
    else changes where DeepSpeed's result is finite).

    :meth:`get_lamb_coeffs` returns the coefficients of the last step, as DeepSpeed's. No bias
    correction, as in DeepSpeed (``bias_correction`` is accepted and ignored). Who averages the
    exact phase's gradients and ``group``: as :class:`~oxcomm.optim.OnebitAdam`.
    """

    NAME = "OnebitLamb"

    def __init__(
        self,
        params,
        lr=1e-3,
        freeze_step=100000,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        max_coeff=10.0,
        min_coeff=0.01,
        coeff_beta=0.9,
        factor_max=4.0,
        factor_min=0.5,
        factor_threshold=0.1,
        group=None,
        grads_averaged=False,
        bias_correction=True,
        amsgrad=False,
        deepspeed=None,
        mask_zero_variance=False,
    ):
        check_adam_args("1-bit LAMB", lr, betas, amsgrad)
        if not 0.0 < min_coeff <= max_coeff:
            raise ValueError(f"invalid LAMB coefficient bounds min_coeff={min_coeff}, max_coeff={max_coeff}")
        if not 0.0 < factor_min <= factor_max or not 0.0 <= factor_threshold < 1.0:
            raise ValueError(
                f"invalid factor bounds factor_min={factor_min}, factor_max={factor_max}, "
                f"factor_threshold={factor_threshold}"
            )
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
            bias_correction=bias_correction,
        )
        self.freeze_step = int(freeze_step)
        self.coeff_beta = float(coeff_beta)
        self.factor_max = float(factor_max)
        self.factor_min = float(factor_min)
        self.factor_threshold = float(factor_threshold)
        self.frozen = False
        self.lamb_coeffs = []
        # The fused buffer of the compressed phase and this rank's errors for it.
        self._flat = None
        self._worker_error = None
        self._server_error = None
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

    def get_lamb_coeffs(self):
        """The LAMB coefficient applied to each parameter tensor in the last step."""
        return list(self.lamb_coeffs)

    def _init_state(self, p, state):
        super()._init_state(p, state)
        state["exp_avg_sq_fresh"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["lamb_coeff_freeze"] = 0.0
        state["last_factor"] = 1.0

    def _step(self, params):
        self.lamb_coeffs = []
        if self.frozen:
            self._compressed_step(params)
        else:
            for group, p in params:
                self._exact_update(group, p, self.state[p])
            if self.steps >= self.freeze_step:
                for _, p in params:
                    st = self.state[p]
                    st["exp_avg_sq_fresh"] = st["exp_avg_sq"].clone()
                self.frozen = True

    def _exact_update(self, group, p, state):
        beta1, beta2 = group["betas"]
        exp_avg, exp_avg_sq, grad = state["exp_avg"], state["exp_avg_sq"], p.grad
        exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        update = exp_avg / (exp_avg_sq.sqrt() + group["eps"])
        if group["weight_decay"] > 0.0:
            update.add_(p, alpha=group["weight_decay"])
        weight_norm = torch.linalg.vector_norm(p).item()
        update_norm = torch.linalg.vector_norm(update).item()
        coeff = 1.0
        if weight_norm != 0 and update_norm != 0:
            coeff = min(max(weight_norm / update_norm, group["min_coeff"]), group["max_coeff"])
        if coeff != 1.0:
            state["lamb_coeff_freeze"] = self.coeff_beta * state["lamb_coeff_freeze"] + (1 - self.coeff_beta) * coeff
        self.lamb_coeffs.append(coeff)
        p.add_(update, alpha=-group["lr"] * coeff)

    def _compressed_step(self, params):
        if not params:
            return
        devices = {p.device for _, p in params}
        if len(devices) > 1:
            raise ValueError(
                f"rank {self.comms.rank}: {self.NAME}: parameters on {sorted(map(str, devices))}; 1-bit LAMB "
                "compresses all momenta as one buffer, on one device"
            )
        states = [self.state[p] for _, p in params]
        if any("scaling_coeff" not in st for st in states):
            self._scaling_coefficients(states)
        last = [st["exp_avg"].clone() for st in states]
        for (group, p), st in zip(params, states):
            beta1 = group["betas"][0]
            st["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1).mul_(st["scaling_coeff"])
        if self.size > 1:
            self._fused_all_reduce([st["exp_avg"] for st in states], params[0][1].device)
        for (group, p), st, prev in zip(params, states, last):
            self._frozen_update(group, p, st, prev)

    def _scaling_coefficients(self, states):
        """DeepSpeed's scaling coefficients, fixed at the first compressed step, except that a
        momentum of norm 0 (an empty tensor or an always-zero gradient) gets 1, not infinity."""
        scales = [(torch.linalg.vector_norm(st["exp_avg"]) / math.sqrt(st["exp_avg"].numel())).item() for st in states]
        united = sum(scales) / len(scales)
        for st, s in zip(states, scales):
            st["scaling_coeff"] = united / s if s > 0 and united > 0 else 1.0

    def _fused_all_reduce(self, momenta, device):
        numel = sum(m.numel() for m in momenta)
        n = padded_len(numel, self.size)
        if self._worker_error is None or self._worker_error.numel() != n or self._worker_error.device != device:
            # first compressed step, or the set of parameters with gradients changed size
            self._worker_error, self._server_error = error_buffers(numel, self.size, device)
            self.comms.forget_errors()  # see OnebitOptimizer._errors
        if self._flat is None or self._flat.numel() != n or self._flat.device != device:
            self._flat = torch.zeros(n, dtype=torch.float32, device=device)
        at = 0
        for m in momenta:
            self._flat[at : at + m.numel()].copy_(m.view(-1))
            at += m.numel()
        # The padding past the momenta keeps what the previous compressed all-reduce left there
        # (zeros before the first), as DeepSpeed's fused buffer does: it enters the scale of
        # the next compression.
        self.comms.compressed_(self._flat, self._worker_error, self._server_error)
        at = 0
        for m in momenta:
            m.view(-1).copy_(self._flat[at : at + m.numel()])
            at += m.numel()

    def _frozen_update(self, group, p, state, prev):
        beta1, beta2 = group["betas"]
        exp_avg, exp_avg_sq, fresh = state["exp_avg"], state["exp_avg_sq"], state["exp_avg_sq_fresh"]
        exp_avg.div_(state["scaling_coeff"])
        self._mask_(group, exp_avg, exp_avg_sq)
        grad = (exp_avg - prev * beta1) / (1 - beta1)
        fresh.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = exp_avg_sq.sqrt() + group["eps"]
        update_prelim = exp_avg / denom
        update = update_prelim + group["weight_decay"] * p if group["weight_decay"] > 0.0 else update_prelim
        factor = (denom / (fresh.sqrt() + group["eps"])).max().item()
        if group["weight_decay"] > 0.0:
            update_norm = torch.linalg.vector_norm(update).item()
            # DeepSpeed divides by update_norm unguarded: 0/0 (a zero parameter with a zero
            # momentum) made the factor NaN.
            ratio = min(1.0, torch.linalg.vector_norm(update_prelim).item() / update_norm) if update_norm > 0 else 1.0
            factor = factor * ratio + (1.0 - ratio)
        factor = min(max(factor, self.factor_min), self.factor_max)
        last = state["last_factor"]
        factor = min(max(factor, last * (1.0 - self.factor_threshold)), last * (1.0 + self.factor_threshold))
        state["last_factor"] = factor
        coeff = state["lamb_coeff_freeze"] * factor
        self.lamb_coeffs.append(coeff)
        p.add_(update, alpha=-group["lr"] * coeff)

    def _extra_state(self):
        # the fused buffer too: its padding carries into the next compressed step
        return {
            "frozen": self.frozen,
            "worker_error": self._worker_error,
            "server_error": self._server_error,
            "fused": self._flat,
        }

    def _load_extra_state(self, extra, own_errors):
        if "frozen" in extra:
            self.frozen = bool(extra["frozen"])
        else:
            self.frozen = self.steps >= max(2, self.freeze_step)
        self._flat = None
        self._worker_error = self._server_error = None
        device = next((p.device for g in self.param_groups for p in g["params"]), None)
        if extra.get("fused") is not None:
            self._flat = extra["fused"].to(device=device, dtype=torch.float32, copy=True)
        we, se = extra.get("worker_error"), extra.get("server_error")
        if own_errors and we is not None:
            device = next((p.device for g in self.param_groups for p in g["params"]), we.device)
            self._worker_error = we.to(device=device, dtype=torch.float32, copy=True)
            self._server_error = se.to(device=device, dtype=torch.float32, copy=True)
