"""Issue 38, item 5: the fit check counts what will be allocated against what the machine has, and refuses
absurd sizes by arithmetic, before anything (even a meta-device model) is built."""

from __future__ import annotations

from collections import namedtuple

import psutil
import pytest
import torch

from angelptm.config import load_config
from angelptm.errors import ConfigError
from angelptm.memory import fit_check
from zero_cache import ZeroCacheConfig
from zero_cache.storage.hardware import tier_budgets

GiB = 2**30
Memory = namedtuple("Memory", "total available")
GPT_1B57 = {"flavour": "gpt2", "vocab_size": 50304, "max_seq_len": 1024, "num_layers": 48, "hidden_size": 1600,
            "num_heads": 25}


@pytest.fixture
def machine_of_24gib(monkeypatch):
    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory(total=24 * GiB, available=20 * GiB))


def config(model: dict, zero_cache: dict | None = None, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "bf16": {"enabled": False}, "model": model, "zero_cache": zero_cache or {}, **extra}


def test_a_host_budget_above_the_machines_ram_is_refused_with_the_figures(machine_of_24gib):
    with pytest.raises(ValueError) as info:
        tier_budgets(ZeroCacheConfig(enabled=True, host_memory_budget="200GB"), torch.device("cpu"))
    message = str(info.value)
    assert "zero_cache.host_memory_budget" in message and "200GB" in message and "24.00 GiB" in message
    assert "auto" in message


def test_a_host_budget_times_the_ranks_of_a_host_above_its_ram_is_refused(machine_of_24gib):
    config = ZeroCacheConfig(enabled=True, host_memory_budget="10GiB")
    assert tier_budgets(config, torch.device("cpu"), 2).host_bytes == 10 * GiB  # 20 GiB of 24: allowed
    with pytest.raises(ValueError) as info:
        tier_budgets(config, torch.device("cpu"), 4)
    assert "zero_cache.host_memory_budget" in str(info.value) and "4 ranks" in str(info.value)


def test_pretrain_fit_check_refuses_a_200gb_host_budget_before_building(machine_of_24gib, monkeypatch):
    def must_not_build(*args, **kwargs):
        raise AssertionError("refused before building")

    cfg = load_config(config({"num_layers": 1, "hidden_size": 32, "num_heads": 2},
                             {"enabled": True, "host_memory_budget": "200GB"}), device_type="cpu")
    monkeypatch.setattr("angelptm.pretraining.models.build_model", must_not_build)
    with pytest.raises(ConfigError, match=r"zero_cache.host_memory_budget.*200GB"):
        fit_check.check_config_fits(cfg, device=torch.device("cpu"))


def test_without_zero_cache_a_1b57_model_on_24gib_is_refused_with_the_figures(machine_of_24gib):
    cfg = load_config(config(GPT_1B57), device_type="cpu")
    with pytest.raises(ConfigError) as info:
        fit_check.check_config_fits(cfg, device=torch.device("cpu"))
    message = str(info.value)
    assert "1,5" in message and "parameters" in message  # ~1,5xx M parameters
    assert "20.00 GiB available" in message and "zero_cache" in message and "gradients" in message


def test_without_zero_cache_a_small_model_passes(machine_of_24gib):
    cfg = load_config(config({"num_layers": 2, "hidden_size": 64, "num_heads": 4}), device_type="cpu")
    fit_check.check_config_fits(cfg, device=torch.device("cpu"))


def test_model_states_bytes_count_masters_gradients_and_adam():
    fp32 = load_config(config({}), device_type="cpu")
    bf16 = load_config(config({}, bf16={"enabled": True}), device_type="cpu")
    none = load_config({"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": False}}, device_type="cpu")
    assert fit_check.state_bytes_per_param(fp32) == 4 + 4 + 8  # param (its own master), fp32 grads, Adam m and v
    assert fit_check.state_bytes_per_param(bf16) == 2 + 2 + 4 + 4 + 8  # and a bf16 grad, an fp32 master
    assert fit_check.state_bytes_per_param(none) == 4 + 4


def test_sizes_within_the_bounds_but_absurd_together_are_refused_by_arithmetic(monkeypatch):
    def must_not_build(*args, **kwargs):
        raise AssertionError("refused by arithmetic before any model is built")

    monkeypatch.setattr("angelptm.pretraining.models.build_model", must_not_build)
    cfg = load_config(config({"num_layers": 16_384, "hidden_size": 2**20, "num_heads": 2**10}), device_type="cpu")
    with pytest.raises(ConfigError) as info:
        fit_check.check_config_fits(cfg, device=torch.device("cpu"))
    message = str(info.value)
    assert "model.num_layers 16384" in message and "model.hidden_size 1048576" in message
    assert "parameters" in message
