"""Does this CPU compute bf16 natively? And how much slower is bf16 than fp32 here when it does not?

Where the CPU has bf16 units (x86 AVX512-BF16 or AMX, ARM's BF16 extension) oneDNN runs bf16 matmuls
2-3x faster than fp32 (AMX on the CI host: 1024x1024 in 2.5 ms against 7.6 ms). Without them a bf16
matmul is emulated: on a 2-core AVX2-only AMD EPYC (issue 18) it was 15x slower than fp32, and with
oneDNN held to AVX2 on the CI host (``ONEDNN_MAX_CPU_ISA=AVX2``) 75x at 256x256. So the precision
rule (:mod:`angelptm.config.precision`) picks bf16 on a CPU only where :func:`detect_cpu_bf16` says so.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch

OVERRIDE_ENV = "ANGELPTM_CPU_BF16"
""""1" or "0" declares whether the CPU computes bf16 natively, skipping the detection (a container whose
/proc/cpuinfo is not the host's; the test suite, which pins it so results do not depend on the CI CPU)."""
NATIVE_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")
"""/proc/cpuinfo flags of bf16 arithmetic units: x86 AMX and AVX512-BF16, ARM (``Features: ... bf16``)."""
ONEDNN_ISA_ENVS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
"""oneDNN, which runs the CPU matmuls, uses no ISA above these (e.g. ``AVX2``) when set."""


@dataclass(frozen=True, slots=True)
class CpuBf16:
    """Whether the CPU has bf16 units, and the evidence, for the log line."""

    native: bool
    """bf16 matmuls run on bf16 hardware (as fast as fp32 or faster), not emulated."""
    evidence: str
    """What the answer rests on, e.g. "amx_bf16 in /proc/cpuinfo; torch kernels AVX512"."""


def detect_cpu_bf16(*, flags: frozenset[str] | None = None, capability: str | None = None,
                    env: Mapping[str, str] | None = None) -> CpuBf16:
    """Whether this CPU computes bf16 natively.

    Args:
        flags: the CPU's feature flags (default: read from /proc/cpuinfo; empty where it does not exist).
        capability: torch's CPU kernel level (default: ``torch.backends.cpu.get_cpu_capability()``), reported
            as evidence: it names the vector width, not bf16 support (AVX512 CPUs without bf16 exist).
        env: environment (default ``os.environ``): :data:`OVERRIDE_ENV` and oneDNN's ISA cap are read.

    Returns:
        The answer with its evidence.
    """
    env = os.environ if env is None else env
    override = env.get(OVERRIDE_ENV, "").strip()
    if override in ("0", "1"):
        return CpuBf16(native=override == "1", evidence=f"{OVERRIDE_ENV}={override}")
    capability = torch.backends.cpu.get_cpu_capability() if capability is None else capability
    for name in ONEDNN_ISA_ENVS:
        isa = env.get(name, "").strip().upper()
        if isa and isa != "ALL" and "BF16" not in isa and "AMX" not in isa:
            return CpuBf16(native=False, evidence=f"{name}={isa} keeps oneDNN's matmuls off the bf16 units")
    flags = read_cpu_flags() if flags is None else flags
    found = [flag for flag in NATIVE_FLAGS if flag in flags]
    if found:
        return CpuBf16(native=True, evidence=f"{', '.join(found)} in /proc/cpuinfo; torch kernels {capability}")
    return CpuBf16(native=False, evidence=f"no {'/'.join(NATIVE_FLAGS[:2])} in /proc/cpuinfo; torch kernels "
                                          f"{capability}")


def read_cpu_flags(path: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first processor's feature flags (x86 ``flags``, ARM ``Features``); empty if unreadable."""
    try:
        text = path.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def measure_bf16_slowdown(size: int = 512, repeats: int = 3) -> float:
    """How many times longer a ``size`` x ``size`` bf16 matmul takes than an fp32 one on this CPU, now.

    The fastest of ``repeats`` runs of each (the others carry noise from whatever else runs). Where bf16
    is emulated it costs about ``repeats`` x 0.1 s at 512 (oneDNN held to AVX2 on the CI host).
    """
    def seconds(dtype: torch.dtype) -> float:
        a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
        torch.mm(a, b)  # the first call pays for dispatch and oneDNN's kernel generation
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - start)
        return best

    return seconds(torch.bfloat16) / max(seconds(torch.float32), 1e-9)


@functools.cache
def bf16_slowdown_once() -> float:
    """:func:`measure_bf16_slowdown`, measured once per process (the warning may be given more than once)."""
    return measure_bf16_slowdown()


def slow_bf16_warning(reason: str) -> str:
    """The one-line warning for bf16 kept on a CPU without bf16 units, with the slowdown measured here."""
    return (f"compute dtype bf16: {reason}; a bf16 matmul takes {bf16_slowdown_once():.1f}x the time of an fp32 "
            f"one here (512x512, measured in this process). Set \"bf16\": {{\"enabled\": \"auto\"}} or remove the bf16 "
            f"section for fp32 on this CPU")
