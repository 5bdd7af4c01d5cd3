"""Adam on the host: our csrc kernel, DeepSpeed's ``cpu_adam`` op (AVX, OpenMP), or torch's fused CPU kernel.

All update flat fp32 views in place, so the optimizer state stays inside the chunks. Which
backend runs is logged once. DeepSpeed measured 4.3 G params/s on 16 cores against 1.0 G/s for
torch's foreach AdamW (see DESIGN.md), which is why it is preferred over torch where it builds.
Both library kernels need the gradient in fp32 and leave the rounding of the new weights to
another pass; ``csrc/fused_host_adam.cpp`` reads the bf16 gradient and writes the bf16 weight in
the same pass (see bench/host_adam.py and BENCHMARKS.md for the measured difference).
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import torch

from zero_cache.native import load_csrc

logger = logging.getLogger(__name__)

_FUSED = (torch.bfloat16, torch.float32)
"""Gradient / weight dtypes the csrc kernel reads and writes."""


def torch_fused_adam(masters: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                     exp_avg_sqs: list[torch.Tensor], *, decoupled: bool, step: int, lr: float,
                     betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """torch's fused multi-tensor Adam (CUDA and CPU, on the tensors' device): AdamW, or Adam with L2 decay."""
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    step_tensor = torch.tensor(float(step), device=masters[0].device)
    kernel(masters, grads, exp_avgs, exp_avg_sqs, [], [step_tensor] * len(masters), lr=lr, beta1=betas[0],
           beta2=betas[1], weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)


class HostAdam:
    """One Adam/AdamW update over lists of flat fp32 CPU tensors.

    Args:
        decoupled: AdamW (True) or Adam with L2 weight decay (False).
        try_deepspeed: attempt to load DeepSpeed's cpu_adam op (a JIT C++ build on first use).
    """

    def __init__(self, decoupled: bool, *, try_deepspeed: bool, try_native: bool = False) -> None:
        self.decoupled = decoupled
        self._ds = None
        self._native = load_csrc("fused_host_adam") if try_native else None
        # Every core but one: the training thread must keep launching GPU kernels meanwhile.
        self.threads = max(1, len(os.sched_getaffinity(0)) - 1)
        if try_deepspeed:
            self._ds = _load_deepspeed_cpu_adam(decoupled)
        self.name = "deepspeed cpu_adam" if self._ds is not None else "torch fused CPU Adam"
        if self._native is not None:
            self.name = f"csrc fused_host_adam (bf16/fp32 gradients; {self.name} otherwise)"
        logger.info("ZeRO-Cache host optimizer: %s", self.name)

    def fuses(self, dtype: torch.dtype) -> bool:
        """Whether :meth:`update_in_place` takes gradients of this dtype."""
        return self._native is not None and dtype in _FUSED

    def update_in_place(self, master: torch.Tensor, grad_and_param: torch.Tensor, exp_avg: torch.Tensor,
                        exp_avg_sq: torch.Tensor, *, step: int, lr: float, betas: tuple[float, float], eps: float,
                        weight_decay: float, grad_scale: float, kept: torch.Tensor | None = None) -> None:
        """One step over flat views; ``grad_and_param`` holds the gradient and receives the rounded new weight;
        ``kept`` (same dtype) receives a copy of the gradient in the same pass."""
        self._native.fused_adam_(master, grad_and_param, exp_avg, exp_avg_sq, step, lr, betas[0], betas[1], eps,
                                 weight_decay, grad_scale, self.decoupled, self.threads, kept)

    def revise(self, master: torch.Tensor, grad: torch.Tensor, out: torch.Tensor, exp_avg: torch.Tensor,
               exp_avg_sq: torch.Tensor, *, step: int, hyper: dict[str, Any], undo_scale: float,
               redo_scale: float) -> None:
        """Take back the step made from ``grad * undo_scale`` (if > 0), then make it from ``grad * redo_scale``
        (if > 0); the rounded weight goes to ``out``. See :mod:`zero_cache.revision`."""
        if self._native is not None and grad.dtype in _FUSED and out.dtype in _FUSED:
            self._native.adam_revise_(master, grad, out, exp_avg, exp_avg_sq, step, hyper["lr"], hyper["betas"][0],
                                      hyper["betas"][1], hyper["eps"], hyper["weight_decay"], undo_scale, redo_scale,
                                      self.decoupled, self.threads)
            return
        if undo_scale > 0:
            undo_adam_(master, grad.float() * undo_scale, exp_avg, exp_avg_sq, decoupled=self.decoupled, step=step,
                       **hyper)
        if redo_scale > 0:
            self.update([master], [grad.float() * redo_scale], [exp_avg], [exp_avg_sq], step=step, **hyper)
        out.copy_(master)

    def update(self, masters: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
               exp_avg_sqs: list[torch.Tensor], *, step: int, lr: float, betas: tuple[float, float], eps: float,
               weight_decay: float) -> None:
        """Apply one step to every (master, grad, exp_avg, exp_avg_sq) quadruple."""
        if self._ds is not None:
            module, opt_id = self._ds
            for master, grad, exp_avg, exp_avg_sq in zip(masters, grads, exp_avgs, exp_avg_sqs):
                module.adam_update(opt_id, step, lr, betas[0], betas[1], eps, weight_decay, True, master, grad,
                                   exp_avg, exp_avg_sq)
            return
        torch_fused_adam(masters, grads, exp_avgs, exp_avg_sqs, decoupled=self.decoupled, step=step, lr=lr,
                         betas=betas, eps=eps, weight_decay=weight_decay)


def undo_adam_(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
               decoupled: bool, step: int, lr: float, betas: tuple[float, float], eps: float,
               weight_decay: float) -> None:
    """Take back, in place, the Adam step ``step`` that ``grad`` (fp32, already scaled) made: the inverse of
    torch's fused Adam line by line (``csrc/fused_host_adam.cpp`` has the same in one pass).

    Exact up to fp32 rounding: each state comes back within about one ulp of the *stepped* value
    (relative error 1e-7 of it). At step 1 the moments return to exactly zero, what they were.
    """
    beta1, beta2 = betas
    bias_correction1, bias_correction2 = 1 - beta1 ** step, 1 - beta2 ** step
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
    master.addcdiv_(exp_avg, denom, value=lr / bias_correction1)
    if decoupled:
        master.div_(1 - lr * weight_decay)
    else:
        grad = grad.add(master, alpha=weight_decay)
    if step == 1:
        exp_avg.zero_()
        exp_avg_sq.zero_()
        return
    exp_avg.sub_(grad, alpha=1 - beta1).div_(beta1)
    exp_avg_sq.addcmul_(grad, grad, value=-(1 - beta2)).div_(beta2).clamp_(min=0)


def _load_deepspeed_cpu_adam(decoupled: bool):
    """(op module, optimizer id) of a DeepSpeedCPUAdam instance, or None if it cannot be built here."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        # The instance is only a handle on the C++ optimizer state (its id); it never steps itself.
        holder = DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(1))], adamw_mode=decoupled)
    except Exception as err:  # no compiler, no deepspeed, or an unsupported CPU: fall back, say why
        logger.warning("DeepSpeed cpu_adam is unavailable (%s: %s); using torch's fused CPU Adam",
                       type(err).__name__, str(err).splitlines()[0] if str(err) else "")
        return None
    _HOLDERS.append(holder)
    return holder.ds_opt_adam, holder.opt_id


_HOLDERS: list = []  # keeps the C++ optimizer objects alive for the life of the process
