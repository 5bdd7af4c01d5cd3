"""The compute dtype by device (issue 18): bf16 on a CPU only where it has bf16 units, unless asked for; a config
naming no precision is fp32 on every device, as in DeepSpeed (issue 28).

The CPU's answer is faked (the suite pins ANGELPTM_CPU_BF16=0 in conftest; these tests set their own).
"""

from __future__ import annotations

import logging

import pytest
import torch

import angelptm
from angelptm.config import load_config
from angelptm.config.precision import choose_dtype
from angelptm.engine.cpu_bf16 import CpuBf16, detect_cpu_bf16, measure_bf16_slowdown, read_cpu_flags

NATIVE = CpuBf16(native=True, evidence="amx_bf16 in /proc/cpuinfo")
EMULATED = CpuBf16(native=False, evidence="no avx512_bf16/amx_bf16 in /proc/cpuinfo")
BASE = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


@pytest.mark.parametrize("flags, native", [
    ({"avx2", "fma"}, False),                        # AMD EPYC Rome, many cloud CPUs
    ({"avx2", "avx512f", "avx512bw"}, False),        # Skylake: AVX512 but no bf16
    ({"avx512f", "avx512_bf16"}, True),              # Cooper Lake, Zen 4
    ({"avx512f", "amx_bf16", "amx_tile"}, True),     # Sapphire Rapids
    ({"fp", "asimd", "sve", "bf16"}, True),          # Neoverse V1/V2 (ARM "Features")
])
def test_detection_reads_the_bf16_flags(flags, native):
    answer = detect_cpu_bf16(flags=frozenset(flags), capability="AVX512", env={})
    assert answer.native is native
    assert "AVX512" in answer.evidence


def test_override_and_onednn_cap_win_over_the_flags():
    amx = frozenset({"amx_bf16"})
    assert not detect_cpu_bf16(flags=amx, capability="AVX512", env={"ANGELPTM_CPU_BF16": "0"}).native
    assert detect_cpu_bf16(flags=frozenset(), capability="AVX2", env={"ANGELPTM_CPU_BF16": "1"}).native
    capped = detect_cpu_bf16(flags=amx, capability="AVX512", env={"ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert not capped.native and "ONEDNN_MAX_CPU_ISA=AVX2" in capped.evidence
    assert detect_cpu_bf16(flags=amx, capability="AVX512", env={"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}).native


def test_cpuinfo_parsing(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse avx2 fma\n\nprocessor\t: 1\n")
    assert read_cpu_flags(cpuinfo) == frozenset({"fpu", "sse", "avx2", "fma"})
    assert read_cpu_flags(tmp_path / "missing") == frozenset()


@pytest.mark.parametrize("bf16, device, cpu, cuda, dtype", [
    (None, "cpu", EMULATED, False, torch.float32),      # no precision: DeepSpeed's fp32 on every device
    (None, "cpu", NATIVE, True, torch.float32),         # even with AMX (issue 28: fp32 inputs, DeepSpeed's losses)
    (None, "cuda", NATIVE, True, torch.float32),
    ("auto", "cpu", EMULATED, True, torch.float32),
    ("auto", "cpu", NATIVE, False, torch.bfloat16),
    ("auto", "cuda", EMULATED, True, torch.bfloat16),   # the default job keeps bf16 on a GPU
    ("auto", "cuda", NATIVE, False, torch.float32),     # a GPU without bf16
    (False, "cpu", NATIVE, True, torch.float32),        # "bf16": {"enabled": false} is explicit
    (True, "cpu", EMULATED, True, torch.bfloat16),      # kept as asked (with a warning)
])
def test_rule(bf16, device, cpu, cuda, dtype):
    choice = choose_dtype(bf16=bf16, fp16=False, device_type=device, cpu=lambda: cpu, cuda_bf16=lambda: cuda)
    assert choice.dtype == dtype
    assert choice.slow_bf16 == (bf16 is True and not cpu.native)
    assert choice.reason


def test_fp16_needs_no_hardware_question():
    def unasked() -> CpuBf16:
        raise AssertionError("fp16 does not depend on the CPU's bf16 units")

    assert choose_dtype(bf16=None, fp16=True, device_type="cpu", cpu=unasked).dtype == torch.float16


def test_loader_applies_the_rule(monkeypatch):
    monkeypatch.setenv("ANGELPTM_CPU_BF16", "1")
    cfg = load_config(BASE, device_type="cpu")
    assert cfg.precision.dtype == torch.float32 and "names no precision" in cfg.precision.reason
    assert load_config({**BASE, "fp16": {"enabled": False}}, device_type="cpu").precision.dtype == torch.float32
    assert load_config({**BASE, "bfloat16": {"enabled": "auto"}}, device_type="cpu").precision.dtype == torch.bfloat16
    assert load_config(BASE, device_type="cuda").precision.dtype == torch.float32
    monkeypatch.setenv("ANGELPTM_CPU_BF16", "0")
    cfg = load_config({**BASE, "bf16": {"enabled": "auto"}}, device_type="cpu")
    assert cfg.precision.dtype == torch.float32 and "no bf16 units" in cfg.precision.reason
    # bf16 "auto" defers to an explicit fp16.
    assert load_config({**BASE, "bf16": {"enabled": "auto"}, "fp16": {"enabled": True}},
                       device_type="cpu").precision.dtype == torch.float16


def test_initialize_logs_the_choice_and_warns_with_the_measured_slowdown(monkeypatch, caplog):
    monkeypatch.setenv("ANGELPTM_CPU_BF16", "0")
    monkeypatch.setattr("angelptm.engine.cpu_bf16.bf16_slowdown_once", lambda: 15.0)
    model = torch.nn.Linear(4, 4)
    with caplog.at_level(logging.INFO, logger="angelptm.engine.builders"):
        engine, *_ = angelptm.initialize(model=model, config={**BASE, "bf16": {"enabled": "auto"}})
    assert engine.module.weight.dtype == torch.float32
    assert any("compute dtype float32" in r.message and "no bf16 units" in r.message for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="angelptm.engine.builders"):
        engine, *_ = angelptm.initialize(model=torch.nn.Linear(4, 4), config={**BASE, "bf16": {"enabled": True}})
    assert engine.module.weight.dtype == torch.bfloat16
    warnings = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "15.0x the time of an fp32" in warnings[0]


def test_slowdown_measurement_is_a_positive_ratio():
    assert measure_bf16_slowdown(size=32, repeats=1) > 0


def test_a_gpu_planned_for_on_a_machine_without_one_is_taken_as_bf16_capable(monkeypatch):
    """pretrain.py --plan --gpus N on a CPU machine: "auto" plans the bf16 params the GPUs will hold."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    choice = choose_dtype(bf16="auto", fp16=False, device_type="cuda")
    assert choice.dtype == torch.bfloat16 and "planned for" in choice.reason
    assert choose_dtype(bf16=None, fp16=False, device_type="cuda").dtype == torch.float32  # DeepSpeed's default
