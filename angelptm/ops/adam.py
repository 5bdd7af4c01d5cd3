"""``deepspeed.ops.adam``'s optimizers as torch's Adam with DeepSpeed's constructor arguments.

Both are ``torch.optim.Adam`` (decoupled weight decay unless told otherwise), so they work as client
optimizers of :func:`angelptm.initialize`: the replicated path steps them on the fp32 masters, and
ZeRO-Cache reads their hyperparameters for its own hybrid Adam (which runs a CPU Adam for host chunks,
the job DeepSpeedCPUAdam does in DeepSpeed). The update formula is DeepSpeed's: Adam with bias
correction, and ``eps`` added after the square root.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch


def _check(bias_correction: bool, amsgrad: bool, name: str) -> None:
    if not bias_correction:
        raise NotImplementedError(f"{name}(bias_correction=False) is not supported (torch's Adam always corrects "
                                  "the bias); leave it True")
    if amsgrad:
        raise NotImplementedError(f"{name}(amsgrad=True) is not supported (DeepSpeed's does not implement it "
                                  "either); use torch.optim.AdamW(amsgrad=True) as the client optimizer")


class DeepSpeedCPUAdam(torch.optim.Adam):
    """``deepspeed.ops.adam.DeepSpeedCPUAdam``'s signature over ``torch.optim.Adam``.

    Args:
        model_params: parameters or param-group dicts.
        lr, betas, eps, weight_decay: Adam's hyperparameters.
        bias_correction: must be True.
        amsgrad: must be False.
        adamw_mode: decoupled weight decay (AdamW) when True, L2 added to the gradient when False.
        fp32_optimizer_states: must be True (the states are fp32 here).
    """

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> None:
        _check(bias_correction, amsgrad, "DeepSpeedCPUAdam")
        if not fp32_optimizer_states:
            raise NotImplementedError("DeepSpeedCPUAdam(fp32_optimizer_states=False) is not supported; optimizer "
                                      "states are kept in fp32")
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=adamw_mode)


class FusedAdam(torch.optim.Adam):
    """``deepspeed.ops.adam.FusedAdam``'s signature over torch's Adam (its multi-tensor path on CUDA).

    Args:
        params: parameters or param-group dicts.
        lr, betas, eps, weight_decay: Adam's hyperparameters.
        bias_correction: must be True.
        adam_w_mode: decoupled weight decay (AdamW) when True.
        amsgrad: must be False (as in DeepSpeed).
        set_grad_none: accepted; ``zero_grad`` sets gradients to None by default.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True) -> None:
        _check(bias_correction, amsgrad, "FusedAdam")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=adam_w_mode)


__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
