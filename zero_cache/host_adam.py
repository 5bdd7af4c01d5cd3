"""Adam on the host: DeepSpeed's ``cpu_adam`` op (AVX, OpenMP) when it builds, else torch's fused CPU kernel.

Both update flat fp32 views in place, so the optimizer state stays inside the chunks. Which
backend runs is logged once. DeepSpeed measured 4.3 G params/s on 16 cores against 1.0 G/s for
torch's foreach AdamW (see DESIGN.md), which is why it is preferred where it can be built.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def fused_adam_kernel(decoupled: bool):
    """torch's fused multi-tensor Adam (CUDA and CPU): AdamW with decoupled weight decay, or Adam with L2."""
    return torch._fused_adamw_ if decoupled else torch._fused_adam_


class HostAdam:
    """One Adam/AdamW update over lists of flat fp32 CPU tensors.

    Args:
        decoupled: AdamW (True) or Adam with L2 weight decay (False).
        try_deepspeed: attempt to load DeepSpeed's cpu_adam op (a JIT C++ build on first use).
    """

    def __init__(self, decoupled: bool, *, try_deepspeed: bool) -> None:
        self.decoupled = decoupled
        self._ds = None
        if try_deepspeed:
            self._ds = _load_deepspeed_cpu_adam(decoupled)
        self.name = "deepspeed cpu_adam" if self._ds is not None else "torch fused CPU Adam"
        logger.info("ZeRO-Cache host optimizer: %s", self.name)

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
        kernel = fused_adam_kernel(self.decoupled)
        step_tensor = torch.tensor(float(step))
        kernel(masters, grads, exp_avgs, exp_avg_sqs, [], [step_tensor] * len(masters), lr=lr, beta1=betas[0],
               beta2=betas[1], weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)


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
