"""Fits or explains before allocating (issue 29, point 1): an oversized model is refused by its plan before it is built.

A 9.7B GPT with 64 MiB / 256 MiB budgets used to be built first and killed by the OOM killer; now
``pretrain.py``, ``zero.Init`` and ``initialize`` ask ZeRO-Cache's planner first and stop with its
"short by N" message.
"""

from __future__ import annotations

import random
import resource
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import angelptm
from angelptm.config import load_config
from angelptm.errors import ConfigError
from angelptm.memory import fit_check

ROOT = Path(__file__).resolve().parents[2]
TINY_BUDGETS = {"enabled": True, "device_memory_budget": "64MiB", "host_memory_budget": "256MiB"}
GPT_9B7 = {"flavour": "llama", "vocab_size": 50304, "max_seq_len": 1024, "num_layers": 48, "hidden_size": 4096,
           "num_heads": 32}


def config(zero_cache: dict, model: dict | None = None, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "bf16": {"enabled": False}, "zero_cache": zero_cache, **({"model": model} if model else {}), **extra}


def test_pretrain_refuses_a_9b7_model_with_tiny_budgets_before_building_it(tmp_path, capsys, monkeypatch):
    sys.path.insert(0, str(ROOT))
    import pretrain as job

    def must_not_run(*args, **kwargs):
        raise AssertionError("the run should stop before building the model or reading data")

    monkeypatch.setattr(job, "build_model", must_not_run)
    monkeypatch.setattr(job, "build_dataset", must_not_run)
    path = tmp_path / f"big{random.randrange(1 << 30)}.json"
    path.write_text(__import__("json").dumps(config(TINY_BUDGETS, GPT_9B7)))
    rss_before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.monotonic()
    assert job.main(["--config", str(path), "--save-dir", str(tmp_path / "ckpt"), "--steps", "1"]) == 2
    seconds = time.monotonic() - started
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "does not fit, refused before building or moving it" in err
    assert "llama of 9" in err and "short by" in err and "budget is 64.00 MiB" in err
    # The meta-device twin allocates nothing: the process's peak RSS grows by far less than one layer (400 MB).
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before_kib < 200 * 1024
    assert seconds < 60


def test_the_refusal_is_the_same_plan_as_pretrain_plan():
    cfg = load_config(config(TINY_BUDGETS, GPT_9B7), device_type="cpu")
    with pytest.raises(ConfigError) as refused:
        fit_check.check_config_fits(cfg, device=torch.device("cpu"))
    from angelptm.memory.plan_report import PlanRequest, plan_report

    text, fits = plan_report(cfg, PlanRequest())
    assert not fits
    planned = text.split("does not fit: ", 1)[1]
    assert planned in str(refused.value)


def test_a_model_that_fits_passes_the_check(tmp_path):
    cfg = load_config(config({"enabled": True, "device_memory_budget": "64MiB", "host_memory_budget": "256MiB"},
                             {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "vocab_size": 512}),
                      device_type="cpu")
    fit_check.check_config_fits(cfg, device=torch.device("cpu"))  # raises if it does not fit


def test_a_model_whose_build_exceeds_the_hosts_memory_is_refused_without_zero_cache(monkeypatch):
    class Memory:
        available = 3 << 30  # a 3 GiB machine: the 9.7B GPT's fp32 build takes 37 GiB
        total = 4 << 40

    monkeypatch.setattr(fit_check.psutil, "virtual_memory", lambda: Memory)
    cfg = load_config(config({"enabled": False}, GPT_9B7), device_type="cpu")
    with pytest.raises(ConfigError, match=r"llama of 98\d\d\.\d M parameters is built in host memory first "
                                          r"\(36\.\d\d GiB in float32, before it is cast\), but this machine has "
                                          r"3\.00 GiB available"):
        fit_check.check_config_fits(cfg, device=torch.device("cpu"))
    Memory.available = 256 << 30  # its fp32 weights, gradients and Adam states (16 B/param, 146 GiB) fit too
    fit_check.check_config_fits(cfg, device=torch.device("cpu"))  # no ZeRO-Cache: no plan to ask


class Stack(nn.Module):
    """``layers`` Linear(256, 256) layers (256 KiB each in fp32); counts how many were built."""

    built = 0

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList()
        for _ in range(layers):
            self.layers.append(nn.Linear(256, 256, bias=False))
            Stack.built += 1


def test_zero_init_stops_a_build_that_cannot_fit_after_the_first_plan(monkeypatch):
    monkeypatch.setattr(fit_check, "FIRST_CHECK_BYTES", 1 << 20)  # plan at 1 MiB (4 layers), then at each doubling
    Stack.built = 0
    ds = config({"enabled": True, "device_memory_budget": "256KiB", "host_memory_budget": "512KiB"})
    with pytest.raises(ConfigError, match=r"built under zero\.Init \(its first 4 parameters, 1\.00 MiB.*short by"):
        with angelptm.zero.Init(config_dict_or_path=ds):
            Stack(1000)  # 250 MiB if it were built whole
    assert Stack.built == 3  # the 4th layer's weight was registered, planned and refused before its Linear returned
    assert torch.get_default_dtype() == torch.float32  # the context was left


def test_zero_init_builds_a_model_that_fits_and_plans_it_as_it_grows(monkeypatch):
    monkeypatch.setattr(fit_check, "FIRST_CHECK_BYTES", 1 << 20)
    ds = config({"enabled": True, "device_memory_budget": "64MiB", "host_memory_budget": "256MiB"})
    with angelptm.zero.Init(config_dict_or_path=ds) as init:
        model = Stack(16)  # 4 MiB: planned at 1, 2 and 4 MiB
    assert init.watch.checks == 3
    assert sum(p.numel() for p in model.parameters()) == 16 * 256 * 256
    engine, *_ = angelptm.initialize(model=model, config=ds)
    assert engine.optimizer.store.layout.num_chunks >= 1


def test_initialize_refuses_before_casting_or_moving_the_model():
    torch.manual_seed(0)
    model = Stack(8)
    before = {name: (p.data_ptr(), p.dtype) for name, p in model.named_parameters()}
    ds = config({"enabled": True, "device_memory_budget": "128KiB", "host_memory_budget": "256KiB"})
    ds["bf16"] = {"enabled": True}
    with pytest.raises(ConfigError, match=r"Stack of 0\.5 M trainable params does not fit.*short by"):
        angelptm.initialize(model=model, config=ds)
    # Not cast to bf16 (initialize casts before attaching), not copied into a chunk: the refusal came first.
    assert {name: (p.data_ptr(), p.dtype) for name, p in model.named_parameters()} == before
