"""Issue 38: values the config used to accept silently, or turn into a traceback, refused in one line.

Each message names the key, the value given and what is allowed.
"""

from __future__ import annotations

import pytest

from angelptm.config import load_config
from angelptm.errors import ConfigError
from angelptm.pretraining.models import ModelConfig

BATCH = {"train_batch_size": 8}


def refused(extra: dict) -> str:
    with pytest.raises(ConfigError) as info:
        load_config({**BATCH, **extra})
    message = str(info.value)
    assert "Traceback" not in message
    return message


def test_scheduler_type_given_as_a_list_is_refused_by_name():
    message = refused({"scheduler": {"type": ["WarmupLR"], "params": {}}})
    assert "scheduler.type" in message and "['WarmupLR']" in message and "use one of WarmupLR, WarmupDecayLR" in message


@pytest.mark.parametrize("params, key, value", [
    ({"warmup_min_lr": -0.01, "warmup_max_lr": 1e-3}, "warmup_min_lr", "-0.01"),
    ({"warmup_min_lr": 0.0, "warmup_max_lr": -1e-3}, "warmup_max_lr", "-0.001"),
    ({"warmup_min_lr": [0.0, -0.5], "warmup_max_lr": 1e-3}, "warmup_min_lr", "-0.5"),
])
def test_warmup_lr_bounds_below_zero_are_refused(params, key, value):
    message = refused({"scheduler": {"type": "WarmupLR", "params": {**params, "warmup_num_steps": 5}}})
    assert f"scheduler.params.{key}" in message and value in message and ">= 0" in message


@pytest.mark.parametrize("ratio_key", ["warmup_min_ratio", "cos_min_ratio"])
def test_cosine_ratios_below_zero_are_refused(ratio_key):
    message = refused({"scheduler": {"type": "WarmupCosineLR",
                                     "params": {"total_num_steps": 100, "warmup_num_steps": 10, ratio_key: -0.5}}})
    assert f"scheduler.params.{ratio_key}" in message and "-0.5" in message


@pytest.mark.parametrize("kind", ["WarmupDecayLR", "WarmupCosineLR"])
@pytest.mark.parametrize("total", [0, -5, 10])
def test_total_num_steps_zero_negative_or_below_the_warmup_is_refused(kind, total):
    message = refused({"scheduler": {"type": kind, "params": {"total_num_steps": total, "warmup_num_steps": 30}}})
    assert "scheduler.params.total_num_steps" in message and str(total) in message
    assert "warmup_num_steps" in message and "30" in message


def test_a_total_equal_to_the_warmup_still_loads():
    cfg = load_config({**BATCH, "scheduler": {"type": "WarmupCosineLR",
                                              "params": {"total_num_steps": 30, "warmup_num_steps": 30}}})
    assert cfg.scheduler.params["total_num_steps"] == 30


def test_data_seq_len_above_model_max_seq_len_is_refused_at_load():
    message = refused({"model": {"max_seq_len": 256}, "data": {"seq_len": 512}})
    assert "data.seq_len" in message and "512" in message and "model.max_seq_len" in message and "256" in message


def test_moe_aux_loss_coef_beyond_its_bound_is_refused():
    message = refused({"moe": {"enabled": True, "num_experts": 2, "aux_loss_coef": 1e30}})
    assert "moe.aux_loss_coef" in message and "1e+30" in message and "1000" in message


@pytest.mark.parametrize("key", ["num_layers", "hidden_size", "ffn_hidden_size", "vocab_size", "max_seq_len"])
def test_absurd_model_sizes_are_refused_by_the_config(key):
    value = 2**62
    extra = {"num_heads": 1} if key == "hidden_size" else {}
    with pytest.raises(ValueError) as info:
        ModelConfig(**{key: value, **extra})
    assert f"model.{key}" in str(info.value) and str(value) in str(info.value) and "at most" in str(info.value)


def test_model_num_layers_of_two_to_the_62_is_refused_at_load():
    message = refused({"model": {"num_layers": 4611686018427387904}})
    assert "model.num_layers" in message and "4611686018427387904" in message


# Scheduler rates get the optimizer's bounds (issue 38's lr 1e10 came back through warmup_max_lr), and the cosine's
# ratios are fractions of the lr. Each of these used to load and end the run in NaN.

@pytest.mark.parametrize("kind, params, key", [
    ("WarmupLR", {"warmup_max_lr": 1e10}, "warmup_max_lr"),
    ("WarmupLR", {"warmup_min_lr": 1e10, "warmup_max_lr": 1e-3}, "warmup_min_lr"),
    ("WarmupLR", {"warmup_max_lr": [1e-3, 1e10]}, "warmup_max_lr"),
    ("WarmupDecayLR", {"total_num_steps": 100, "warmup_max_lr": 1e10}, "warmup_max_lr"),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e10}, "cycle_max_lr"),
    ("OneCycle", {"cycle_min_lr": 1e10, "cycle_max_lr": 1e-3}, "cycle_min_lr"),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e10}, "lr_range_test_min_lr"),
])
def test_scheduler_learning_rates_get_the_optimizers_bounds(kind, params, key):
    message = refused({"scheduler": {"type": kind, "params": {"warmup_num_steps": 5, **params}
                                     if kind.startswith("Warmup") else params}})
    assert f"scheduler.params.{key}" in message and "optimizer.params.lr" in message and "10" in message, message
    assert message.strip().splitlines()[-1].lstrip().startswith(f"scheduler.params.{key}")


@pytest.mark.parametrize("ratio_key", ["cos_min_ratio", "warmup_min_ratio"])
@pytest.mark.parametrize("value", [1000, 1.5])
def test_cosine_ratios_above_one_are_refused(ratio_key, value):
    message = refused({"scheduler": {"type": "WarmupCosineLR",
                                     "params": {"total_num_steps": 100, "warmup_num_steps": 10, ratio_key: value}}})
    assert f"scheduler.params.{ratio_key}: {value!r}" in message and "[0, 1]" in message, message


@pytest.mark.parametrize("kind", ["WarmupLR", "OneCycle"])
def test_rates_at_the_bound_still_load(kind):
    params = ({"warmup_max_lr": 10.0, "warmup_num_steps": 5} if kind == "WarmupLR"
              else {"cycle_min_lr": 0.0, "cycle_max_lr": 10.0})
    cfg = load_config({**BATCH, "scheduler": {"type": kind, "params": params}})
    assert cfg.scheduler.type == kind


def test_cosine_ratios_of_zero_and_one_still_load():
    cfg = load_config({**BATCH, "scheduler": {"type": "WarmupCosineLR", "params": {
        "total_num_steps": 100, "warmup_num_steps": 10, "warmup_min_ratio": 1.0, "cos_min_ratio": 0.0}}})
    assert (cfg.scheduler.params["warmup_min_ratio"], cfg.scheduler.params["cos_min_ratio"]) == (1.0, 0.0)


@pytest.mark.parametrize("key", ["cycle_min_mom", "cycle_max_mom"])
def test_one_cycle_momentum_outside_zero_one_is_refused(key):
    message = refused({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3,
                                                                    key: 5.0}}})
    assert f"scheduler.params.{key}: 5.0" in message and "[0, 1)" in message, message


# MoE sizes, by arithmetic: the experts' parameter count from the moe and model sections (moe.ffn_hidden_size 2**63
# used to load, then end pretrain.py in torch's "Overflow when unpacking long long" traceback).

MOE = {"enabled": True, "num_experts": 8, "top_k": 2, "moe_every": 2}
SMALL_MODEL = {"num_layers": 4, "hidden_size": 128, "num_heads": 4}


@pytest.mark.parametrize("moe, named", [
    ({"ffn_hidden_size": 2**63}, "moe.ffn_hidden_size 9223372036854775808"),
    ({"ffn_hidden_size": 2**40}, "moe.ffn_hidden_size 1099511627776"),
    ({"num_experts": 2**40, "top_k": 1}, "moe.num_experts 1099511627776"),
])
def test_huge_moe_sizes_are_refused_by_their_parameter_count(moe, named):
    message = refused({"model": SMALL_MODEL, "moe": {**MOE, **moe}})
    assert named in message and "expert parameters" in message and "at most" in message, message
    assert "2 MoE layers" in message and "model.hidden_size 128" in message, message


def test_pretrain_with_a_huge_moe_ffn_is_one_line(tmp_path, capsys):
    import json
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root))
    import pretrain as job

    config = json.loads((root / "configs" / "tiny_moe.json").read_text())
    config["moe"]["ffn_hidden_size"] = 2**63
    path = tmp_path / "moe.json"
    path.write_text(json.dumps(config))
    code = job.main(["--config", str(path), "--save-dir", str(tmp_path / "run"), "--plan"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "Traceback" not in err and "moe.ffn_hidden_size" in err.splitlines()[-1], err


def test_a_large_but_real_moe_still_loads():
    cfg = load_config({**BATCH, "model": {"num_layers": 64, "hidden_size": 8192, "num_heads": 64},
                       "moe": {**MOE, "num_experts": 256, "ffn_hidden_size": 2048, "moe_every": 1}})
    assert cfg.moe.num_experts == 256


def test_a_huge_size_in_a_disabled_moe_section_changes_nothing():
    cfg = load_config({**BATCH, "moe": {"enabled": False, "ffn_hidden_size": 2**63}})
    assert not cfg.moe.enabled
