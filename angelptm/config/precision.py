"""The compute dtype: what the config asks for, settled against the device it runs on.

The rule (README "Config reference"):

* ``fp16.enabled: true`` -> fp16; ``bf16.enabled: true`` -> bf16, on any device. On a CPU without bf16
  units bf16 is kept as asked, with a warning giving the slowdown measured there.
* ``bf16.enabled: "auto"`` (the shipped default job) -> bf16 where the device computes it natively (a
  CUDA GPU with bf16, a CPU with AVX512-BF16 / AMX / ARM BF16), else fp32.
* no precision in the config (neither a ``bf16`` nor an ``fp16`` section) -> fp32 on every device,
  DeepSpeed's own default, so a DeepSpeed script trains as it did under DeepSpeed: its fp32 inputs meet
  fp32 weights, and its losses are DeepSpeed's from the first step (issue 28). ``"bf16": {"enabled":
  false}`` is the same fp32, said explicitly.

Why the CPU case matters: without bf16 units a bf16 matmul is emulated, 15x slower than fp32 on a
2-core AVX2 EPYC (issue 18), which turned the two-minute default job into 55 minutes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import torch

from angelptm.engine.cpu_bf16 import CpuBf16, detect_cpu_bf16

BF16_AUTO = "auto"


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    """The compute dtype the rule picked, and why (one log line)."""

    dtype: torch.dtype
    reason: str
    slow_bf16: bool = False
    """bf16 asked for explicitly on a CPU without bf16 units (kept; worth a warning with the slowdown)."""


def choose_dtype(*, bf16: bool | Literal["auto"] | None, fp16: bool, device_type: str,
                 cpu: Callable[[], CpuBf16] = detect_cpu_bf16,
                 cuda_bf16: Callable[[], bool] = lambda: _gpu_has_bf16()) -> DtypeChoice:
    """Apply the module's rule.

    Args:
        bf16: ``bf16.enabled`` as written; None when the config names no precision (neither a ``bf16`` nor
            an ``fp16`` section): fp32.
        fp16: ``fp16.enabled``.
        device_type: "cuda" or "cpu", the device the run computes on.
        cpu, cuda_bf16: the hardware questions, asked only when the rule needs them (tests pass fakes).

    Returns:
        The dtype with its reason.
    """
    if fp16:
        return DtypeChoice(torch.float16, "fp16.enabled is true")
    if bf16 is True:
        if device_type == "cpu":
            support = cpu()
            if not support.native:
                return DtypeChoice(torch.bfloat16, f"bf16.enabled is true, though this CPU has no bf16 units "
                                                   f"({support.evidence})", slow_bf16=True)
        return DtypeChoice(torch.bfloat16, "bf16.enabled is true")
    if bf16 is False:
        return DtypeChoice(torch.float32, "the config turns bf16 and fp16 off")
    if bf16 is None:
        return DtypeChoice(torch.float32, 'the config names no precision: fp32, as DeepSpeed ("bf16": {"enabled": '
                                          '"auto"} picks bf16 where the device computes it natively)')
    asked = 'bf16.enabled is "auto"'
    if device_type == "cuda":
        if cuda_bf16():
            planned = "" if torch.cuda.is_available() else " (assumed of a GPU planned for, not on this machine)"
            return DtypeChoice(torch.bfloat16, f"{asked} and this GPU computes bf16{planned}")
        return DtypeChoice(torch.float32, f"{asked} and this GPU has no bf16 support")
    if device_type != "cpu":
        return DtypeChoice(torch.float32, f"{asked}: fp32 on a {device_type} device")
    support = cpu()
    if support.native:
        return DtypeChoice(torch.bfloat16, f"{asked} and this CPU has bf16 units ({support.evidence})")
    return DtypeChoice(torch.float32, f"{asked} and this CPU has no bf16 units ({support.evidence}), where bf16 "
                                      f"is emulated and many times slower")


def _gpu_has_bf16() -> bool:
    """Whether the CUDA device computes bf16. Without CUDA here the GPU is one being planned for (``pretrain.py
    --plan --gpus ...``), taken to be bf16-capable like every data-centre GPU since Ampere."""
    return not torch.cuda.is_available() or torch.cuda.is_bf16_supported()
