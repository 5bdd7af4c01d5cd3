"""Adam on the host: our csrc kernel, DeepSpeed's ``cpu_adam`` op (AVX, OpenMP), or torch's fused CPU kernel.

All update flat views in place, so the optimizer state stays inside the chunks: fp32 ones, or bf16 ones under
DeepSpeed's ``bf16_master_weights_and_grads`` + ``bf16_optimizer_states`` (``state_dtype`` bf16), which only the
library kernels take (DeepSpeed's cpu_adam with a bf16 gradient, as DeepSpeed's own offloaded step runs them; torch's
fused Adam without it); the csrc kernel is fp32-only. Which
backend runs is logged once. DeepSpeed measured 4.3 G params/s on 16 cores against 1.0 G/s for
torch's foreach AdamW (see DESIGN.md), which is why it is preferred over torch where it builds.
Both library kernels need the gradient in fp32 and leave the rounding of the new weights to
another pass; ``csrc/fused_host_adam.cpp`` reads the bf16 gradient and writes the bf16 weight in
the same pass (see bench/host_adam.py and BENCHMARKS.md for the measured difference).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
from typing import Any, Callable, ContextManager

import torch

from zero_cache.base.native import load_csrc
from zero_cache.plan.step_cost import STATE_BYTES_PER_ELEMENT, host_adam_bytes_per_element

logger = logging.getLogger(__name__)

_FUSED = (torch.bfloat16, torch.float32)
"""Gradient / weight dtypes the csrc kernel reads and writes."""
PIECE = 1 << 24
"""Elements per piece where the library path works through scratch buffers (2 x 64 MiB)."""


def _pieces(numel: int) -> list[slice]:
    return [slice(start, min(start + PIECE, numel)) for start in range(0, numel, PIECE)]


def torch_fused_adam(masters: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                     exp_avg_sqs: list[torch.Tensor], *, decoupled: bool, step: int, lr: float,
                     betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """torch's fused multi-tensor Adam (CUDA and CPU, on the tensors' device): AdamW, or Adam with L2 decay."""
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    step_tensor = torch.full((), float(step), device=masters[0].device)  # a fill kernel: no host copy
    kernel(masters, grads, exp_avgs, exp_avg_sqs, [], [step_tensor] * len(masters), lr=lr, beta1=betas[0],
           beta2=betas[1], weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)


class HostAdam:
    """One Adam/AdamW update over lists of flat CPU tensors (fp32, or bf16 states).

    Args:
        decoupled: AdamW (True) or Adam with L2 weight decay (False).
        try_deepspeed: attempt to load DeepSpeed's cpu_adam op (a JIT C++ build on first use).
        try_native: build and use ``csrc/fused_host_adam.cpp``.
        deepspeed_import: the context in which ``import deepspeed`` gives the installed DeepSpeed (the caller's to
            know: ``angelptm.integrations`` may have made ``deepspeed`` another name of its engine).
        state_dtype: the masters' and moments' dtype. bf16 always tries DeepSpeed's cpu_adam (DeepSpeed's arithmetic
            on bf16 masters, moments and gradient) and never the csrc kernel, which is fp32-only.
    """

    def __init__(self, decoupled: bool, *, try_deepspeed: bool, try_native: bool = False,
                 deepspeed_import: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
                 state_dtype: torch.dtype = torch.float32) -> None:
        self.decoupled = decoupled
        self.state_dtype = state_dtype
        self._ds = None
        low_precision = state_dtype != torch.float32
        try_deepspeed = try_deepspeed or low_precision
        self._native = load_csrc("fused_host_adam") if try_native and not low_precision else None
        self._buffers: list[torch.Tensor] = []  # (see _scratch)
        self._ds_sequence: tuple[int, tuple[float, float] | None] = (0, None)  # (see _powers_as_in_sequence)
        # Every core but one: the training thread must keep launching GPU kernels meanwhile.
        self.threads = max(1, len(os.sched_getaffinity(0)) - 1)
        if try_deepspeed:
            self._ds = _load_deepspeed_cpu_adam(decoupled, deepspeed_import)
        self.name = "deepspeed cpu_adam" if self._ds is not None else "torch fused CPU Adam"
        if low_precision:
            self.name += f" on {str(state_dtype).removeprefix('torch.')} masters and moments"
        if self._native is not None:
            self.name = f"csrc fused_host_adam (bf16/fp32 gradients; {self.name} otherwise)"
        logger.info("ZeRO-Cache host optimizer: %s", self.name)

    def fuses(self, dtype: torch.dtype) -> bool:
        """Whether :meth:`update_in_place` takes gradients of this dtype."""
        return self._native is not None and dtype in _FUSED

    def probe_work(self, dtype: torch.dtype) -> Callable[[torch.Tensor], Callable[[], int]] | None:
        """The host memory probe's work (:func:`zero_cache.runtime.rates.host_memory_rate`), as the step runs it over
        a group: :meth:`update_in_place` on an fp32 master and moments and a ``dtype`` gradient that takes the new
        weight, carved from a scratch buffer of bytes; each pass answers the bytes it moved
        (:func:`~zero_cache.plan.step_cost.host_adam_bytes_per_element`). None where the csrc kernel does not take
        ``dtype`` (the host's Adam rate then bounds the step long before its memory does)."""
        if not self.fuses(dtype):
            return None
        element_bytes = STATE_BYTES_PER_ELEMENT + dtype.itemsize

        def prepare(buffer: torch.Tensor) -> Callable[[], int]:
            numel = buffer.numel() // element_bytes
            states = buffer[:STATE_BYTES_PER_ELEMENT * numel].view(torch.float32).view(3, numel)
            grad = buffer[STATE_BYTES_PER_ELEMENT * numel:element_bytes * numel].view(dtype)
            states.zero_()
            grad.fill_(1e-3)  # (each pass then reads the weight the last one wrote: small, finite, no denormals)
            master, exp_avg, exp_avg_sq = states.unbind(0)
            steps = itertools.count(1)

            def one_pass() -> int:
                self.update_in_place(master, grad, exp_avg, exp_avg_sq, step=next(steps), lr=1e-4,
                                     betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, grad_scale=1.0)
                return numel * host_adam_bytes_per_element(dtype.itemsize)

            return one_pass

        return prepare

    def lazy_ok(self, hypers: list[dict[str, Any]], dtype: torch.dtype) -> bool:
        """Whether steps with these hyperparameters, on gradients of ``dtype``, leave their moments unstored
        (:mod:`zero_cache.optim.revision`). Not with Adam's L2 decay, whose gradient reads the old weight, so its step
        cannot be taken back alone. Not on DeepSpeed's cpu_adam either (fp16 gradients on a GPU machine): stepping
        copies of the moments there cost more than the step (6.9B in fp16 on the H200: 3.8 s a step, 2.2 s eager)."""
        if self.state_dtype != torch.float32 or self._ds is not None and not self.fuses(dtype):
            return False  # (bf16 states: their steps are not taken back, see zero_cache.resolve)
        return self.decoupled or all(hyper["weight_decay"] == 0 for hyper in hypers)

    def update_in_place(self, master: torch.Tensor, grad_and_param: torch.Tensor, exp_avg: torch.Tensor,
                        exp_avg_sq: torch.Tensor, *, step: int, lr: float, betas: tuple[float, float], eps: float,
                        weight_decay: float, grad_scale: float, kept: torch.Tensor | None = None,
                        lazy: bool = False, fold_scale: float = 0.0) -> None:
        """One step over flat views; ``grad_and_param`` holds the gradient and receives the rounded new weight;
        ``kept`` (same dtype) receives a copy of the gradient in the same pass, after the one it held is folded
        into the moments with ``fold_scale`` (if > 0); ``lazy``: this step's moments are not stored."""
        self._native.fused_adam_(master, grad_and_param, exp_avg, exp_avg_sq, step, lr, betas[0], betas[1], eps,
                                 weight_decay, grad_scale, self.decoupled, self.threads, kept, lazy, fold_scale)

    def fold(self, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, kept: torch.Tensor, *, scale: float,
             betas: tuple[float, float]) -> None:
        """Store a lazy step's moments: fold its gradient (``kept`` times ``scale``) into them."""
        if self._native is not None and kept.dtype in (*_FUSED, torch.float16):
            self._native.adam_fold_(exp_avg, exp_avg_sq, kept, scale, betas[0], betas[1], self.threads)
            return
        for piece in _pieces(kept.numel()):
            step_moments_(exp_avg[piece], exp_avg_sq[piece], self._scratch(0, piece).copy_(kept[piece]).mul_(scale),
                          betas)

    def lazy_update(self, masters: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                    exp_avg_sqs: list[torch.Tensor], *, step: int, **hyper: Any) -> None:
        """:meth:`update` without storing the moments: the library kernels step copies of them, a piece at a time
        through two scratch buffers (whole copies cost page faults on every call)."""
        for master, grad, exp_avg, exp_avg_sq in zip(masters, grads, exp_avgs, exp_avg_sqs):
            for piece in _pieces(master.numel()):
                self.update([master[piece]], [grad[piece]], [self._scratch(0, piece).copy_(exp_avg[piece])],
                            [self._scratch(1, piece).copy_(exp_avg_sq[piece])], step=step, **hyper)

    def _scratch(self, index: int, piece: slice) -> torch.Tensor:
        """One of two fp32 buffers of :data:`PIECE` elements, cut to ``piece``'s length."""
        if not self._buffers:
            self._buffers = [torch.empty(PIECE, dtype=torch.float32) for _ in range(2)]
        return self._buffers[index][:piece.stop - piece.start]

    def revise(self, master: torch.Tensor, grad: torch.Tensor, out: torch.Tensor, exp_avg: torch.Tensor,
               exp_avg_sq: torch.Tensor, *, step: int, hyper: dict[str, Any], undo_scale: float,
               redo_scale: float, undo_lazy: bool = False, redo_lazy: bool = False) -> None:
        """Take back the step made from ``grad * undo_scale`` (if > 0; ``undo_lazy``: a lazy step), then make it
        from ``grad * redo_scale`` (if > 0; ``redo_lazy``: storing no moments); the rounded weight goes to
        ``out``. See :mod:`zero_cache.optim.revision`."""
        if self._native is not None and grad.dtype in _FUSED and out.dtype in _FUSED:
            self._native.adam_revise_(master, grad, out, exp_avg, exp_avg_sq, step, hyper["lr"], hyper["betas"][0],
                                      hyper["betas"][1], hyper["eps"], hyper["weight_decay"], undo_scale, redo_scale,
                                      self.decoupled, self.threads, undo_lazy, redo_lazy)
            return
        if master.dtype != torch.float32:  # bf16 states: never taken back (zero_cache.resolve), the gradient in bf16
            assert undo_scale == 0 and not redo_lazy, "a bf16 step is not taken back"
            if redo_scale > 0:
                self.update([master], [grad.to(master.dtype) * redo_scale], [exp_avg], [exp_avg_sq], step=step,
                            **hyper)
            out.copy_(master)
            return
        if undo_scale > 0:
            undo = undo_lazy_adam_ if undo_lazy else undo_adam_
            undo(master, grad.float() * undo_scale, exp_avg, exp_avg_sq, decoupled=self.decoupled, step=step, **hyper)
        if redo_scale > 0:
            redo = self.lazy_update if redo_lazy else self.update
            redo([master], [grad.float() * redo_scale], [exp_avg], [exp_avg_sq], step=step, **hyper)
        out.copy_(master)

    def update(self, masters: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
               exp_avg_sqs: list[torch.Tensor], *, step: int, lr: float, betas: tuple[float, float], eps: float,
               weight_decay: float) -> None:
        """Apply one step to every (master, grad, exp_avg, exp_avg_sq) quadruple."""
        if self._ds is not None:
            module, opt_id = self._ds
            self._powers_as_in_sequence(step, tuple(betas), eps)
            for master, grad, exp_avg, exp_avg_sq in zip(masters, grads, exp_avgs, exp_avg_sqs):
                module.adam_update(opt_id, step, lr, betas[0], betas[1], eps, weight_decay, True, master, grad,
                                   exp_avg, exp_avg_sq)
            return
        torch_fused_adam(masters, grads, exp_avgs, exp_avg_sqs, decoupled=self.decoupled, step=step, lr=lr,
                         betas=betas, eps=eps, weight_decay=weight_decay)


    def _powers_as_in_sequence(self, step: int, betas: tuple[float, float], eps: float) -> None:
        """Bring cpu_adam's beta powers to ``step`` as an uninterrupted run has them. The op multiplies its beta^t by
        beta once a step while steps come one after another with the same betas, and recomputes it with ``pow``
        (which rounds otherwise) at any other call. A change of betas (param groups with betas of their own, a
        schedule cycling momentum) recomputes in an uninterrupted DeepSpeed run too, so it is left to the op. Where
        the step jumps or goes back under the same betas (the first step of a process resumed from a checkpoint, an
        earlier checkpoint loaded), the op is reset (a call with other betas) and steps 1 .. step - 1 replayed on a
        one-element scratch with lr 0, once, so a resumed run is the uninterrupted one bit for bit."""
        last, last_betas = self._ds_sequence
        self._ds_sequence = (step, betas)
        if (last_betas is not None and betas != last_betas) or step in (last, last + 1):
            return
        module, opt_id = self._ds
        scratch = [torch.zeros(1) for _ in range(4)]
        module.adam_update(opt_id, 1, 0.0, 0.0, 0.0, eps, 0.0, True, *scratch)  # (other betas: the powers restart)
        for earlier in range(1, step):
            module.adam_update(opt_id, earlier, 0.0, betas[0], betas[1], eps, 0.0, True, *scratch)


def step_moments_(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
                  betas: tuple[float, float]) -> None:
    """Adam's moment lines, in place, on a scaled fp32 gradient (as torch's fused Adam writes them)."""
    exp_avg.lerp_(grad, 1 - betas[0])
    exp_avg_sq.mul_(betas[1]).addcmul_(grad, grad, value=1 - betas[1])


def undo_lazy_adam_(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                    decoupled: bool, step: int, lr: float, betas: tuple[float, float], eps: float,
                    weight_decay: float) -> None:
    """Take back, in place, a lazy Adam step (one that stored no moments) that ``grad`` (fp32, already scaled)
    made: its moments are recomputed and the weight line alone runs backwards. The moments are untouched, so
    this is exact but for the rounding of the weight itself (an ulp of it)."""
    exp_avg, exp_avg_sq = exp_avg.clone(), exp_avg_sq.clone()
    step_moments_(exp_avg, exp_avg_sq, grad, betas)
    denom = (exp_avg_sq.sqrt() / math.sqrt(1 - betas[1] ** step)).add_(eps)
    master.addcdiv_(exp_avg, denom, value=lr / (1 - betas[0] ** step))
    if decoupled:
        master.div_(1 - lr * weight_decay)


def undo_adam_(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
               decoupled: bool, step: int, lr: float, betas: tuple[float, float], eps: float,
               weight_decay: float) -> None:
    """Take back, in place, the eager Adam step ``step`` that ``grad`` (fp32, already scaled) made: the inverse of
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


def _load_deepspeed_cpu_adam(decoupled: bool, deepspeed_import: Callable[[], ContextManager[Any]]):
    """(op module, optimizer id) of a DeepSpeedCPUAdam instance, or None if it cannot be built here."""
    try:
        with deepspeed_import():
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
