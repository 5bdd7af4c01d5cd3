"""The device's Adam over a chunk in one pass: the gradient in its own dtype, scaled, and the new params written.

A device-held chunk's update was four passes over device memory: the compute-dtype gradient copied into an fp32
scratch (6 bytes an element), scaled by the step's factor (8), torch's fused Adam over the fp32 master and moments
(28), and the param chunk rewritten from the master (6): 48 bytes an element, where plain torch's bf16 AdamW without
masters moves 14. The update is bound by memory bandwidth, so on the whole H100 at 2.78B that difference was most of
the gap to plain torch (0.359 against 0.326 s a step). :func:`adam_in_one_pass` reads the gradient, master and
moments and writes the master, moments and params once: 28 bytes an element.

It is a Triton kernel, so it runs where Triton does: CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1`` (read
when this module is imported; the CPU tests reload it so); :func:`one_pass_available` says where. Elsewhere the
callers keep the four passes. The arithmetic is torch's fused Adam's (``_fused_adam_`` / ``_fused_adamw_``) line for
line, in fp32 with IEEE-rounded square root and division, so the two agree to an ulp or two of fp32; bf16 params are
rounded to nearest even, as torch rounds.
"""

from __future__ import annotations

import os
from typing import Iterable, Sequence

import torch

from zero_cache.plan.layout import ALIGN_NUMEL, TensorSlot

BLOCK = 2048
"""Elements per Triton program: memory-bound, so any size that fills the SMs' loads is as fast."""


def contiguous_runs(slots: Iterable[TensorSlot]) -> list[tuple[int, int]]:
    """The elements of ``slots`` as maximal runs of adjacent elements, in chunk order: one launch per run instead of
    one per parameter (a chunk packs its parameters back to back)."""
    runs: list[tuple[int, int]] = []
    for slot in sorted(slots, key=lambda slot: slot.offset):
        if runs and runs[-1][1] == slot.offset:
            runs[-1] = (runs[-1][0], slot.offset + slot.numel)
        else:
            runs.append((slot.offset, slot.offset + slot.numel))
    return runs


try:  # (an optional dependency: CUDA builds of torch bring it)
    import triton
    import triton.language as tl
except ImportError:
    triton = None
else:
    def _adam_body(master_ptr, exp_avg_ptr, exp_avg_sq_ptr, grad_ptr, param_ptr, numel, grad_factor, lr,
                   weight_decay, beta1, beta2, eps, step_size, bias_correction2_sqrt,
                   DECOUPLED: tl.constexpr, PARAMS_BF16: tl.constexpr, BLOCK: tl.constexpr, EVEN: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        if EVEN:  # (every program's block is whole: no mask, so nothing keeps the loads from being vectorized)
            inside = None
        else:
            inside = offsets < numel
        weight = tl.load(master_ptr + offsets, mask=inside)
        grad = tl.load(grad_ptr + offsets, mask=inside).to(tl.float32) * grad_factor
        exp_avg = tl.load(exp_avg_ptr + offsets, mask=inside)
        exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=inside)
        if DECOUPLED:
            weight -= lr * weight_decay * weight
        else:
            grad += weight * weight_decay
        exp_avg = beta1 * exp_avg + (1 - beta1) * grad
        exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
        denom = tl.div_rn(tl.sqrt_rn(exp_avg_sq), bias_correction2_sqrt) + eps
        weight -= tl.div_rn(step_size * exp_avg, denom)
        tl.store(master_ptr + offsets, weight, mask=inside)
        tl.store(exp_avg_ptr + offsets, exp_avg, mask=inside)
        tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq, mask=inside)
        if PARAMS_BF16:  # rounded to nearest even by hand, as torch rounds (Triton's interpreter truncates)
            bits = weight.to(tl.uint32, bitcast=True)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16)
            rounded = tl.where(weight != weight, 0x7FC0, rounded)  # NaN stays NaN (torch's quiet one)
            tl.store(param_ptr + offsets, rounded.to(tl.bfloat16, bitcast=True), mask=inside)
        else:
            tl.store(param_ptr + offsets, weight.to(param_ptr.dtype.element_ty), mask=inside)

    _adam_kernel = triton.jit(do_not_specialize=["numel"])(_adam_body)  # (one compile whatever the runs' lengths)
    _adam_kernel_numel_known = triton.jit(_adam_body)
    """The same kernel compiled knowing whether ``numel`` is a multiple of 16 (Triton's default): the mask is then
    constant over 16 elements and the loads can be vectorized; every run of a chunk is (its slots are multiples of
    :data:`~zero_cache.plan.layout.ALIGN_NUMEL`). ``bench/device_adam.py --sweep`` times it against the other before
    the engine switches."""


def one_pass_available(device: torch.device) -> bool:
    """Whether :func:`adam_in_one_pass` runs on ``device``'s tensors here (Triton on CUDA, or its interpreter)."""
    return triton is not None and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


def adam_in_one_pass(states: Sequence[torch.Tensor], grad: torch.Tensor, params: torch.Tensor, *,
                     grad_factor: float, step: int, lr: float, betas: tuple[float, float], eps: float,
                     weight_decay: float, decoupled: bool, block: int = BLOCK, num_warps: int = 4,
                     numel_known: bool = False, even_blocks: bool = False) -> None:
    """One Adam step over flat, contiguous, equally long tensors, in place.

    Args:
        states: the fp32 master, exp_avg and exp_avg_sq.
        grad: the gradient in any float dtype (the compute dtype's param chunk, or an fp32 accumulator); it may be
            ``params`` itself (each element is read before it is written), and is not changed otherwise.
        params: where the new params go, rounded to its dtype.
        grad_factor: what the gradient is multiplied by first (unscale and clip).
        step: the Adam step number (from 1), for the bias corrections.
        decoupled: AdamW's weight decay (True) or Adam's L2 term in the gradient (False).
        block, num_warps: elements per Triton program and warps per program (``bench/device_adam.py --sweep`` times
            others against these).
        numel_known: launch the compile that knows ``numel``'s divisibility (:data:`_adam_kernel_numel_known`).
        even_blocks: the whole blocks in a launch without a mask, the rest in a second launch with one.
    """
    master, exp_avg, exp_avg_sq = states
    numel = master.numel()
    tensors = (master, exp_avg, exp_avg_sq, grad, params)
    if any(t.numel() != numel or not t.is_contiguous() for t in tensors):
        raise ValueError(f"adam_in_one_pass takes equally long contiguous tensors; got "
                         f"{[(tuple(t.shape), t.is_contiguous()) for t in tensors]}")
    if numel == 0:
        return
    kernel = _adam_kernel_numel_known if numel_known else _adam_kernel
    beta1, beta2 = betas
    hyper = (float(grad_factor), float(lr), float(weight_decay), float(beta1), float(beta2), float(eps),
             float(lr) / (1 - beta1 ** step), (1 - beta2 ** step) ** 0.5)
    flags = dict(DECOUPLED=decoupled, PARAMS_BF16=params.dtype == torch.bfloat16, BLOCK=block, num_warps=num_warps)
    whole = numel // block * block if even_blocks else 0
    if whole:
        kernel[(whole // block,)](*tensors, whole, *hyper, EVEN=True, **flags)
    if whole < numel:
        rest = tuple(tensor[whole:] for tensor in tensors)
        kernel[(triton.cdiv(numel - whole, block),)](*rest, numel - whole, *hyper, EVEN=False, **flags)


def warm(device: torch.device, grad_dtype: torch.dtype, param_dtype: torch.dtype, decoupled: bool) -> None:
    """Compile the kernel for these dtypes now, on a few elements (Triton compiles on first use, and a compile in the
    first steps after the warm-up was measured as the tuning's first count: 1.78 s against 0.63 at 2.7B on an H100).
    Slots start on :data:`~zero_cache.plan.layout.ALIGN_NUMEL` boundaries, so the chunks' runs are aligned as these
    tensors are, and the length is not specialized on: the runs of training reuse this compile."""
    states = [torch.zeros(ALIGN_NUMEL, device=device) for _ in range(3)]
    adam_in_one_pass(states, torch.zeros(ALIGN_NUMEL, dtype=grad_dtype, device=device),
                     torch.zeros(ALIGN_NUMEL, dtype=param_dtype, device=device), grad_factor=1.0, step=1, lr=0.0,
                     betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled=decoupled)
