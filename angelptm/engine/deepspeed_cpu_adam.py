"""The config's Adam on a CPU, stepped by DeepSpeed's own C++ Adam, so its weights are DeepSpeed's bit for bit.

DeepSpeed builds the config's ``"Adam"`` / ``"AdamW"`` (without ``torch_adam``) as ``FusedAdam``; on the CPU
accelerator that runs ``ds_adam_step`` of ``csrc/adam/cpu_adam_impl.cpp``, the function DeepSpeed's ``cpu_adam``
op binds as ``adam_update``. Its float arithmetic is not torch's Adam: the bias corrections are fp32, with
beta^t kept by multiplying by beta once per step; the moments and the update are fused multiply-adds; the
denominator is sqrt(v) * (1 / sqrt(1 - beta2^t)) + eps; the step size -lr / (1 - beta1^t) and lr itself are fp32.
Most elements then differ from torch's in the last bit after every step, and that difference grows through
training: DeepSpeedExamples' cifar10 CNN, whose losses otherwise part from DeepSpeed's within its first epoch.

:class:`DeepSpeedCpuAdam` keeps torch's ``Adam`` state layout (a tensor ``step``, ``exp_avg``, ``exp_avg_sq``), so
checkpoints, ZeRO-Cache and LR schedulers see a torch Adam; only the update goes through the C++ kernel.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Iterable, Iterator

import torch

from angelptm.integrations import deepspeed_alias

logger = logging.getLogger(__name__)


class CpuAdamKernel:
    """One optimizer in the table of DeepSpeed's ``cpu_adam`` op, freed with this object.

    The op keeps beta1^t and beta2^t per optimizer and multiplies them by beta once per step only when steps come
    one after another (any other step recomputes them with ``pow``, which rounds differently). A run resumed at
    step ``n`` would thus round as DeepSpeed's resumed run does, not as the uninterrupted one; :meth:`update`
    replays the steps before ``n`` on a one-element scratch tensor first, so a resumed run is bit-equal to the
    uninterrupted run (and so to DeepSpeed's uninterrupted run).

    Args:
        op: the loaded ``cpu_adam`` extension.
        optimizer_id: a free id in its table.
        decoupled: AdamW (True) or Adam with L2 weight decay (False).
        betas: the betas the first steps will use.
    """

    def __init__(self, op: Any, optimizer_id: int, decoupled: bool, betas: tuple[float, float]) -> None:
        self.op, self.optimizer_id, self.decoupled = op, optimizer_id, decoupled
        self._scratch = [torch.zeros(1) for _ in range(4)]  # param, grad, exp_avg, exp_avg_sq of the replays
        self._create(betas)

    def _create(self, betas: tuple[float, float]) -> None:
        # (lr, eps, weight_decay are per call; the last argument: no log line from the C++ side)
        self.op.create_adam(self.optimizer_id, 0.0, betas[0], betas[1], 1e-8, 0.0, self.decoupled, False)
        self.last_step, self.betas = 0, tuple(betas)

    def update(self, step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
               param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """One Adam step of contiguous CPU tensors, in place (``step`` counts from 1): fp32 parameter, gradient and
        moments, or bf16 parameter and gradient with bf16 or fp32 moments (the op's dtype pairs)."""
        betas = tuple(betas)
        if betas == self.betas and step < self.last_step:  # an earlier checkpoint loaded: start the powers over
            self.op.destroy_adam(self.optimizer_id)
            self._create(betas)
        if betas == self.betas:
            for earlier in range(self.last_step + 1, step):
                self.op.adam_update(self.optimizer_id, earlier, 0.0, betas[0], betas[1], eps, 0.0, True,
                                    *self._scratch)
        self.op.adam_update(self.optimizer_id, step, lr, betas[0], betas[1], eps, weight_decay, True,
                            param, grad, exp_avg, exp_avg_sq)
        self.last_step, self.betas = step, betas

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # (at interpreter exit the op may be gone already)
            self.op.destroy_adam(self.optimizer_id)


@contextlib.contextmanager
def _quiet_cpu_accelerator() -> Iterator[None]:
    """Without a GPU, DeepSpeed's import warns that it falls back to its CPU accelerator unless DS_ACCELERATOR names
    it; name it for the import (the process's environment is left as it was)."""
    named = "DS_ACCELERATOR" in os.environ or torch.cuda.is_available()
    if not named:
        os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        yield
    finally:
        if not named:
            del os.environ["DS_ACCELERATOR"]


def load_kernel(decoupled: bool, betas: tuple[float, float]) -> CpuAdamKernel | None:
    """A new optimizer of DeepSpeed's ``cpu_adam`` op (built on first use, once per machine), or None, with a
    warning saying why, where it cannot be loaded here (no compiler, no DeepSpeed)."""
    try:
        with deepspeed_alias.suspended(), _quiet_cpu_accelerator():
            from deepspeed.ops.adam import DeepSpeedCPUAdam
            from deepspeed.ops.op_builder import CPUAdamBuilder

            if not _built("cpu_adam"):  # (a silent minute or two otherwise, on a newcomer's first run)
                logger.info("compiling DeepSpeed's C++ CPU Adam for this machine (first use only, about a minute; "
                            "cached afterwards)")
            op = CPUAdamBuilder().load(verbose=False)
    except Exception as err:  # noqa: BLE001 (a failed JIT build raises whatever the toolchain raised)
        logger.warning("DeepSpeed's C++ CPU Adam is unavailable (%s: %s): the config's optimizer is torch's Adam, "
                       "whose weights agree with DeepSpeed's to rounding, not bit for bit",
                       type(err).__name__, str(err).splitlines()[0] if str(err) else "")
        return None
    # Ids are shared with DeepSpeedCPUAdam instances (ZeRO-Cache's host Adam makes some): take the next one.
    optimizer_id = DeepSpeedCPUAdam.optimizer_id
    DeepSpeedCPUAdam.optimizer_id += 1
    return CpuAdamKernel(op, optimizer_id, decoupled, betas)


class DeepSpeedCpuAdam(torch.optim.Adam):
    """torch's ``Adam`` (state, param groups, ``decoupled_weight_decay``) whose update is DeepSpeed's C++ one.

    The op takes fp32 parameters, and bf16 ones (DeepSpeed's ``bf16_master_weights_and_grads``) with bf16 gradients
    and moments of ``state_dtype``. Parameters it does not take (not contiguous CPU tensors of those dtypes), or a
    kernel of None, take torch's update instead, or :func:`adam_step_with_state_dtype` where ``state_dtype`` is not
    the parameters' (torch's Adam keeps moments in the parameter's dtype).

    Args:
        params: parameters or param-group dicts.
        kernel: from :func:`load_kernel`.
        lr, betas, eps, weight_decay, decoupled_weight_decay: Adam's hyperparameters (``decoupled_weight_decay``
            must be the kernel's).
        state_dtype: dtype of exp_avg and exp_avg_sq; None: the parameter's (torch's rule). fp32 with bf16
            parameters is DeepSpeedCPUAdam's ``fp32_optimizer_states`` under bf16 masters.
    """

    def __init__(self, params: Iterable[Any], kernel: CpuAdamKernel | None, *, lr: float, betas: tuple[float, float],
                 eps: float, weight_decay: float, decoupled_weight_decay: bool,
                 state_dtype: torch.dtype | None = None) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=decoupled_weight_decay, foreach=False)
        assert kernel is None or kernel.decoupled == decoupled_weight_decay, "the kernel's mode is fixed at creation"
        self.kernel = kernel
        self.state_dtype = state_dtype

    def _on_kernel(self) -> bool:
        return self.kernel is not None and all(
            param.device.type == "cpu" and (param.dtype, self.state_dtype or param.dtype) in _KERNEL_DTYPES
            and param.is_contiguous() and param.grad.is_contiguous() and param.grad.dtype == param.dtype
            for group in self.param_groups for param in group["params"] if param.grad is not None)

    def _state_of(self, param: torch.Tensor) -> dict[str, Any]:
        """The parameter's state, created in torch Adam's layout (so either optimizer loads the other's state dict)
        with moments in ``state_dtype``."""
        state = self.state[param]
        if not state:
            dtype = self.state_dtype or param.dtype
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        if not self._on_kernel():
            if self.state_dtype is None or all(p.dtype == self.state_dtype for group in self.param_groups
                                               for p in group["params"]):
                return super().step(closure)
            return self._step_with_state_dtype(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            stepped = [param for param in group["params"] if param.grad is not None]
            for param in stepped:
                state = self._state_of(param)
                state["step"] += 1
                for key in ("exp_avg", "exp_avg_sq"):  # (the op would step a contiguous copy of a strided one)
                    state[key] = state[key].contiguous()
            if not stepped:
                continue
            # One count for the group, as DeepSpeed's FusedAdam passes (the engine steps every parameter together,
            # so it is each parameter's own count too).
            step = max(int(self.state[param]["step"]) for param in stepped)
            for param in stepped:
                state = self.state[param]
                self.kernel.update(step, float(group["lr"]), group["betas"], group["eps"], group["weight_decay"],
                                   param, param.grad, state["exp_avg"], state["exp_avg_sq"])
        return loss

    def _step_with_state_dtype(self, closure: Any) -> Any:
        """torch's update where the moments' dtype is not the parameters' (bf16 parameters, fp32 moments off the C++
        op: on a GPU, or without it)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self._state_of(param)
                state["step"] += 1
                adam_step_with_state_dtype(param, param.grad, state["exp_avg"], state["exp_avg_sq"],
                                           int(state["step"]), lr=float(group["lr"]), betas=group["betas"],
                                           eps=group["eps"], weight_decay=group["weight_decay"],
                                           decoupled=group["decoupled_weight_decay"])
        return loss


_KERNEL_DTYPES = ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32))
"""(parameter and gradient, moments) dtype pairs of the op's invokers used here (``cpu_adam_impl.cpp``)."""


def adam_step_with_state_dtype(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                               exp_avg_sq: torch.Tensor, step: int, *, lr: float, betas: tuple[float, float],
                               eps: float, weight_decay: float, decoupled: bool) -> None:
    """One Adam step of ``param`` (any float dtype) in the moments' dtype, with torch's single-tensor Adam
    arithmetic; the parameter is rounded back to its dtype once at the end, as DeepSpeed's CPU Adam stores it."""
    compute = exp_avg.dtype
    weight, grad = param.to(compute), grad.to(compute)
    if weight_decay:
        if decoupled:
            weight.mul_(1 - lr * weight_decay)
        else:
            grad = grad.add(weight, alpha=weight_decay)
    exp_avg.lerp_(grad, 1 - betas[0])
    exp_avg_sq.mul_(betas[1]).addcmul_(grad, grad, value=1 - betas[1])
    bias_correction1, bias_correction2 = 1 - betas[0] ** step, 1 - betas[1] ** step
    denominator = (exp_avg_sq.sqrt() / bias_correction2 ** 0.5).add_(eps)
    weight.addcdiv_(exp_avg, denominator, value=-lr / bias_correction1)
    param.copy_(weight)


def _built(extension: str) -> bool:
    """Whether torch's extension cache holds a build of ``extension`` already (False where this torch does not say)."""
    try:
        from pathlib import Path

        from torch.utils.cpp_extension import _get_build_directory  # private, hence the guard

        return any(Path(_get_build_directory(extension, verbose=False)).glob(f"{extension}*.so"))
    except Exception:  # noqa: BLE001 (then only the message is left out)
        return True
