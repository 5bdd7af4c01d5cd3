"""Unit tests of the config edge (DeepSpeed JSON -> typed tree) and the config helpers it relies on.

Covers ``angelptm.config.load_config`` / ``resolve_batch_sizes``, ``zero_cache.plan.units``,
``MoEConfig.capacity`` and ``AutoPipeConfig.bubble_fraction``.
"""

from __future__ import annotations

import json
import math
import random
from fractions import Fraction

import pytest
import torch

from angelptm.config import EngineConfig, LossScaleConfig, load_config, resolve_batch_sizes
from angelptm.errors import ConfigError
from autopipe import AutoPipeConfig
from moe import MoEConfig
from zero_cache import ZeroCacheConfig, parse_budget, parse_bytes

BATCH = {"train_batch_size": 8}


def load(extra: dict, *, world_size: int = 1) -> EngineConfig:
    """Load ``extra`` on top of a minimal valid config (a batch size is the only required input)."""
    config = dict(BATCH) if not {"train_batch_size", "train_micro_batch_size_per_gpu"} & set(extra) else {}
    config.update(extra)
    return load_config(config, world_size=world_size)


def config_error(extra: dict, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        load(extra, **kwargs)
    return str(info.value)


# --------------------------------------------------------------------------------------------
# Valid configs
# --------------------------------------------------------------------------------------------


def typical_deepspeed_config(rng: random.Random) -> dict:
    """A ZeRO-2 bf16 AdamW config of the shape DeepSpeed's tutorials use, with random values."""
    return {
        "train_batch_size": 64,
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {
            "lr": rng.uniform(1e-5, 1e-3), "betas": [rng.uniform(0.8, 0.9), rng.uniform(0.95, 0.99)],
            "eps": rng.choice([1e-6, 1e-7]), "weight_decay": rng.uniform(0.01, 0.2)}},
        "scheduler": {"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": 0, "warmup_max_lr": rng.uniform(1e-4, 1e-3),
            "warmup_num_steps": rng.randint(10, 100), "total_num_steps": rng.randint(1000, 5000),
            "warmup_type": "linear"}},
        "bf16": {"enabled": True},
        "gradient_clipping": rng.uniform(0.5, 2.0),
        "zero_optimization": {"stage": 2, "contiguous_gradients": True, "overlap_comm": True,
                              "reduce_scatter": True, "reduce_bucket_size": 2e8, "allgather_bucket_size": 2e8},
        "steps_per_print": rng.randint(20, 200),
        "wall_clock_breakdown": False,
    }


def test_typical_deepspeed_config_gives_expected_typed_values():
    raw = typical_deepspeed_config(random.Random(11))
    cfg = load_config(raw, world_size=4)

    assert (cfg.batch.train_batch_size, cfg.batch.micro_batch_size, cfg.batch.gradient_accumulation_steps,
            cfg.batch.world_size) == (64, 4, 4, 4)
    assert cfg.precision.dtype == torch.bfloat16 and cfg.precision.loss_scale is None

    opt = raw["optimizer"]["params"]
    assert cfg.optimizer.lr == opt["lr"]
    assert cfg.optimizer.betas == tuple(opt["betas"])
    assert cfg.optimizer.eps == opt["eps"]
    assert cfg.optimizer.weight_decay == opt["weight_decay"]
    assert cfg.optimizer.decoupled_weight_decay is True

    sched = raw["scheduler"]["params"]
    assert cfg.scheduler.type == "WarmupDecayLR"
    assert {k: cfg.scheduler.params[k] for k in sched} == sched
    assert cfg.scheduler.params["last_batch_iteration"] == -1  # DeepSpeed's default filled in

    assert cfg.gradient_clipping == raw["gradient_clipping"]
    assert cfg.zero.stage == 2
    assert cfg.zero.reduce_bucket_size == 200_000_000 and isinstance(cfg.zero.reduce_bucket_size, int)
    assert cfg.zero.offload_param_device == "none" and not cfg.zero_cache.enabled
    assert cfg.monitor.steps_per_print == raw["steps_per_print"]
    assert cfg.monitor.tensorboard_dir is None and cfg.monitor.csv_dir is None


def test_input_dict_is_not_mutated():
    raw = typical_deepspeed_config(random.Random(3))
    raw["flops_profiler"] = {"enabled": False}
    before = json.dumps(raw, sort_keys=True)
    load_config(raw, world_size=4)
    assert json.dumps(raw, sort_keys=True) == before


@pytest.mark.parametrize("key", ["bf16", "bfloat16"])
def test_bfloat16_alias(key):
    assert load({key: {"enabled": True}}).precision.dtype == torch.bfloat16
    assert load({key: {"enabled": False}}).precision.dtype == torch.float32


def test_config_as_json_file_path(tmp_path):
    raw = typical_deepspeed_config(random.Random(5))
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(raw, indent=2))
    from_dict = load_config(raw, world_size=4)
    for given in (str(path), path):
        from_file = load_config(given, world_size=4)
        assert from_file.batch == from_dict.batch
        assert from_file.optimizer == from_dict.optimizer
        assert from_file.scheduler == from_dict.scheduler
        assert from_file.precision == from_dict.precision
        assert from_file.zero == from_dict.zero
        assert from_file.accepted_not_acted == from_dict.accepted_not_acted


def test_fp16_dynamic_loss_scale_fields():
    rng = random.Random(21)
    fp16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": rng.randint(8, 24),
            "loss_scale_window": rng.randint(10, 2000), "hysteresis": rng.randint(1, 5),
            "consecutive_hysteresis": True, "min_loss_scale": rng.choice([1, 2, 4])}
    cfg = load({"fp16": fp16})
    assert cfg.precision.dtype == torch.float16
    assert cfg.precision.loss_scale == LossScaleConfig(
        static_scale=None, initial_scale_power=fp16["initial_scale_power"], window=fp16["loss_scale_window"],
        hysteresis=fp16["hysteresis"], consecutive_hysteresis=True, min_scale=fp16["min_loss_scale"])


def test_a_fractional_min_loss_scale_is_refused_as_deepspeed_refuses_it():
    """DeepSpeed 0.19.8's ``min_loss_scale`` is an integer (its model refuses 0.5 too); a whole float is read."""
    with pytest.raises(ConfigError, match=r"fp16.min_loss_scale: .*integer.*\(got 0.5\)"):
        load({"fp16": {"enabled": True, "min_loss_scale": 0.5}})
    assert load({"fp16": {"enabled": True, "min_loss_scale": 8.0}}).precision.loss_scale.min_scale == 8.0


def test_fp16_defaults_match_deepspeed():
    scale = load({"fp16": {"enabled": True}}).precision.loss_scale
    # DeepSpeed 0.19 fp16 defaults: dynamic, 2**16, window 1000, hysteresis 2, min 1.
    assert scale == LossScaleConfig(static_scale=None, initial_scale_power=16, window=1000, hysteresis=2,
                                    consecutive_hysteresis=False, min_scale=1.0)


def test_gradient_clipping_default_is_deepspeeds_and_a_written_zero_is_off():
    """Left out, DeepSpeed 0.19 clips at GRADIENT_CLIPPING_DEFAULT (1.0): the same here (issue 28)."""
    constants = pytest.importorskip("deepspeed.runtime.constants")
    assert load({}).gradient_clipping == constants.GRADIENT_CLIPPING_DEFAULT == 1.0
    assert load({"gradient_clipping": 0}).gradient_clipping == 0.0


def test_fp16_static_loss_scale():
    scale = load({"fp16": {"enabled": True, "loss_scale": 128}}).precision.loss_scale
    assert scale.static_scale == 128.0


def test_fp16_section_disabled_means_fp32():
    cfg = load({"fp16": {"enabled": False, "loss_scale": 64}})
    assert cfg.precision.dtype == torch.float32 and cfg.precision.loss_scale is None


def test_no_optimizer_or_scheduler_sections():
    cfg = load({})
    assert cfg.optimizer is None and cfg.scheduler is None
    assert cfg.precision.dtype == torch.float32


@pytest.mark.parametrize("opt_type, adam_w_mode, decoupled", [
    ("Adam", None, True),       # DeepSpeed: "Adam" is AdamW unless adam_w_mode is false
    ("Adam", True, True),
    ("Adam", False, False),
    ("AdamW", None, True),
    ("AdamW", False, True),     # "AdamW" forces decoupled decay whatever adam_w_mode says
    ("adam", False, False),     # type names are case-insensitive, as in DeepSpeed
    ("ADAMW", None, True),
])
def test_adam_weight_decay_mode(opt_type, adam_w_mode, decoupled):
    params = {"lr": 1e-3, "weight_decay": 0.05}
    if adam_w_mode is not None:
        params["adam_w_mode"] = adam_w_mode
    cfg = load({"optimizer": {"type": opt_type, "params": params}})
    assert cfg.optimizer.decoupled_weight_decay is decoupled
    assert cfg.optimizer.weight_decay == 0.05


# --------------------------------------------------------------------------------------------
# Batch triple
# --------------------------------------------------------------------------------------------

# (train, micro, gas, world) -> (train, micro, gas) or an error fragment
BATCH_CASES = [
    # all three given
    ((32, 4, 8, 1), (32, 4, 8)),
    ((32, 4, 2, 4), (32, 4, 2)),
    ((32, 4, 2, 1), "train_batch_size 32 != train_micro_batch_size_per_gpu 4 * gradient_accumulation_steps 2 "
                    "* world_size 1 = 8"),
    ((32, 4, 8, 4), "= 128"),
    # two given -> the third derived
    ((32, 4, None, 1), (32, 4, 8)),
    ((32, 4, None, 4), (32, 4, 2)),
    ((32, None, 2, 1), (32, 16, 2)),
    ((32, None, 2, 4), (32, 4, 2)),
    ((None, 4, 2, 1), (8, 4, 2)),
    ((None, 4, 2, 4), (32, 4, 2)),
    # one given -> accumulation 1
    ((32, None, None, 1), (32, 32, 1)),
    ((32, None, None, 4), (32, 8, 1)),
    ((None, 4, None, 1), (4, 4, 1)),
    ((None, 4, None, 4), (16, 4, 1)),
    # non-divisible
    ((30, 4, None, 1), "not a whole number"),
    ((30, None, 4, 1), "not a whole number"),
    ((32, 4, None, 3), "not a whole number"),
    ((32, None, None, 3), "not a whole number"),
    # nothing to go on
    ((None, None, None, 1), "train_batch_size or train_micro_batch_size_per_gpu"),
    ((None, None, 4, 1), "train_batch_size or train_micro_batch_size_per_gpu"),
    # below 1
    ((0, 4, None, 1), "train_batch_size: must be >= 1"),
    ((32, 4, 0, 1), "gradient_accumulation_steps: must be >= 1"),
]


@pytest.mark.parametrize("given, expected", BATCH_CASES)
def test_batch_triple_table(given, expected):
    train, micro, gas, world = given
    if isinstance(expected, str):
        with pytest.raises(ConfigError) as info:
            resolve_batch_sizes(train, micro, gas, world)
        assert expected in str(info.value)
    else:
        batch = resolve_batch_sizes(train, micro, gas, world)
        assert (batch.train_batch_size, batch.micro_batch_size, batch.gradient_accumulation_steps) == expected
        assert batch.world_size == world


@pytest.mark.parametrize("given, expected", BATCH_CASES)
def test_batch_triple_table_through_load_config(given, expected):
    train, micro, gas, world = given
    raw = {key: value for key, value in zip(
        ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"), (train, micro, gas))
        if value is not None}
    if isinstance(expected, str):
        with pytest.raises(ConfigError) as info:
            load_config(raw, world_size=world)
        assert expected in str(info.value)
    else:
        batch = load_config(raw, world_size=world).batch
        assert (batch.train_batch_size, batch.micro_batch_size, batch.gradient_accumulation_steps) == expected


def test_non_divisible_message_shows_the_arithmetic():
    with pytest.raises(ConfigError) as info:
        resolve_batch_sizes(30, 4, None, 2)
    message = str(info.value)
    assert "gradient_accumulation_steps" in message
    assert "train_batch_size 30 / (train_micro_batch_size_per_gpu 4 * world_size 2) = 3.75" in message


def test_batch_triple_random_draws_follow_the_formula():
    rng = random.Random(1234)
    for _ in range(60):
        micro, gas, world = rng.randint(1, 16), rng.randint(1, 16), rng.choice([1, 2, 3, 4, 8, 16])
        train = micro * gas * world
        for given in ((train, micro, gas), (train, micro, None), (train, None, gas), (None, micro, gas)):
            batch = resolve_batch_sizes(*given, world)
            assert (batch.train_batch_size, batch.micro_batch_size, batch.gradient_accumulation_steps) == (
                train, micro, gas), (given, world)
        # a wrong third member is rejected, with the product in the message
        wrong = train + rng.randint(1, 5)
        with pytest.raises(ConfigError) as info:
            resolve_batch_sizes(wrong, micro, gas, world)
        assert f"= {train}" in str(info.value)


# --------------------------------------------------------------------------------------------
# Unknown keys
# --------------------------------------------------------------------------------------------

TYPO_CASES = [
    ({"gradient_acumulation_steps": 2}, "gradient_acumulation_steps", "gradient_accumulation_steps"),
    ({"zero_optimization": {"stgae": 2}}, "zero_optimization.stgae", "stage"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memroy": True}}},
     "zero_optimization.offload_optimizer.pin_memroy", "pin_memory"),
    ({"zero_optimization": {"offload_param": {"devcie": "cpu"}}}, "zero_optimization.offload_param.devcie", "device"),
    ({"fp16": {"enabled": True, "loss_scale_windw": 100}}, "fp16.loss_scale_windw", "loss_scale_window"),
    ({"optimizer": {"type": "AdamW", "params": {"weight_decy": 0.1}}}, "optimizer.params.weight_decy",
     "weight_decay"),
    ({"optimizer": {"type": "AdamW", "parms": {}}}, "optimizer.parms", "params"),
    ({"zero_cache": {"prefetch_dpeth": 3}}, "zero_cache.prefetch_dpeth", "prefetch_depth"),
    ({"moe": {"num_expert": 4}}, "moe.num_expert", "num_experts"),
    ({"model": {"hiden_size": 64}}, "model.hiden_size", "hidden_size"),
    ({"data": {"seq_length": 64}}, "data.seq_length", "seq_len"),
    ({"train": {"save_intervall": 5}}, "train.save_intervall", "save_interval"),
    ({"autopipe": {"num_stage": 4}}, "autopipe.num_stage", "num_stages"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 10}}}, "scheduler.params.warmup_num_step",
     "warmup_num_steps"),
    ({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "cos_min_ration": 0.1}}},
     "scheduler.params.cos_min_ration", "cos_min_ratio"),
    ({"flops_profilr": {"enabled": False}}, "flops_profilr", "flops_profiler"),  # accepted keys are suggested too
]


@pytest.mark.parametrize("extra, path, suggestion", TYPO_CASES)
def test_unknown_key_names_path_and_closest_key(extra, path, suggestion):
    message = config_error(extra)
    assert f"{path}: unknown key; did you mean {suggestion!r}?" in message


def test_unknown_key_without_close_match_lists_valid_keys():
    message = config_error({"moe": {"qqqqqqqq": 1}})
    assert "moe.qqqqqqqq: unknown key; valid keys here:" in message
    for key in ("num_experts", "top_k", "capacity_factor", "ep_size"):
        assert key in message


def test_several_typos_reported_in_one_error():
    extra = {
        "train_batch_sze": 8, "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stgae": 1, "offload_optimizer": {"devce": "cpu"}},
        "moe": {"top_kk": 1},
        "model": {"num_haeds": 2},
    }
    message = config_error(extra)
    for path in ("train_batch_sze", "zero_optimization.stgae", "zero_optimization.offload_optimizer.devce",
                 "moe.top_kk", "model.num_haeds"):
        assert f"{path}: unknown key" in message
    assert message.count("unknown key") == 5


def test_aliases_are_valid_keys():
    cfg = load({"zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True},
                "aio": {"thread_count": 2}})
    assert cfg.zero.stage == 3


# --------------------------------------------------------------------------------------------
# Bad types and bad values
# --------------------------------------------------------------------------------------------

BAD_TYPE_CASES = [
    ({"train_batch_size": "eight"}, "train_batch_size", "'eight'"),
    ({"gradient_accumulation_steps": 2.5}, "gradient_accumulation_steps", "2.5"),
    ({"fp16": [True]}, "fp16", "[True]"),
    ({"bf16": {"enabled": "maybe"}}, "bf16.enabled", "'maybe'"),
    ({"gradient_clipping": "high"}, "gradient_clipping", "'high'"),
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage", "4"),
    ({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}},
     "zero_optimization.offload_optimizer.device", "'gpu'"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": "0.9"}}}, "optimizer.params.betas", "'0.9'"),
    ({"moe": {"num_experts": "many"}}, "moe.num_experts", "'many'"),
    ({"zero_cache": {"enabled": [1]}}, "zero_cache.enabled", "[1]"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "ten"}}},
     "scheduler.params.warmup_num_steps", "'ten'"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": 3}}},
     "scheduler.params.warmup_type", "3"),
]


@pytest.mark.parametrize("extra, path, shown", BAD_TYPE_CASES)
def test_bad_type_names_key_and_value(extra, path, shown):
    message = config_error(extra)
    assert f"{path}: " in message
    assert f"(got {shown})" in message


def test_short_betas_list_shows_the_value():
    message = config_error({"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}})
    assert "optimizer.params.betas" in message
    assert "[0.9]" in message


def test_several_bad_types_reported_in_one_error():
    message = config_error({"steps_per_print": "often", "moe": {"top_k": "two"}, "fp16": {"hysteresis": []}})
    for path in ("steps_per_print", "moe.top_k", "fp16.hysteresis"):
        assert f"{path}: " in message


def test_missing_required_scheduler_key():
    message = config_error({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}})
    assert "scheduler.params.total_num_steps: required key is missing" in message


OWNER_CHECK_CASES = [
    ({"moe": {"num_experts": 4, "top_k": 5}}, "moe.top_k"),
    ({"moe": {"num_experts": 6, "ep_size": 4}}, "moe.ep_size"),
    ({"zero_cache": {"device_memory_budget": "2XB"}}, "zero_cache.device_memory_budget"),
    ({"zero_cache": {"host_memory_budget": -5}}, "zero_cache.host_memory_budget"),
    ({"zero_cache": {"chunk_size": 100}}, "zero_cache.chunk_size"),
    ({"model": {"hidden_size": 100, "num_heads": 3}}, "model.hidden_size"),
    ({"autopipe": {"schedule": "zigzag"}}, "autopipe.schedule"),
    ({"autopipe": {"schedule": "1f1b", "virtual_stages_per_rank": 2}}, "autopipe.virtual_stages_per_rank"),
    ({"data": {"seq_len": 0}}, "data.seq_len"),
    ({"train": {"steps": 0}}, "train.steps"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}}, "scheduler.params.warmup_num_steps"),
    ({"gradient_clipping": -1.0}, "gradient_clipping"),
]


@pytest.mark.parametrize("extra, key", OWNER_CHECK_CASES)
def test_owner_value_checks_become_config_errors(extra, key):
    assert key in config_error(extra)


def test_owner_value_check_shows_offending_value():
    assert "'zigzag'" in config_error({"autopipe": {"schedule": "zigzag"}})
    assert "'2XB'" in config_error({"zero_cache": {"device_memory_budget": "2XB"}})


# Checks in the typed dataclasses built after validation (_to_typed) raise a bare ValueError that
# load_config does not turn into a ConfigError.
@pytest.mark.parametrize("extra, key", [
    ({"steps_per_print": 0}, "steps_per_print"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": -1.0}}}, "optimizer.params.lr"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1.5]}}}, "optimizer.params.betas"),
    ({"fp16": {"enabled": True, "loss_scale_window": 0}}, "fp16.loss_scale_window"),
    ({"fp16": {"enabled": True, "loss_scale": -2}}, "fp16.loss_scale"),
])
def test_typed_config_checks_raise_config_error(extra, key):
    with pytest.raises(ValueError) as info:  # raised either way: ConfigError subclasses ValueError
        load(extra)
    assert key in str(info.value)
    assert isinstance(info.value, ConfigError), f"got a bare {type(info.value).__name__}"


# --------------------------------------------------------------------------------------------
# Accepted but not acted on
# --------------------------------------------------------------------------------------------


def test_accepted_not_acted_keys_are_listed():
    cfg = load({"flops_profiler": {"enabled": True, "profile_step": 1}, "prescale_gradients": False,
                "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": False,
                                      "reduce_bucket_size": 1000, "offload_optimizer": {"device": "cpu"}},
                "gradient_clipping": 1.0, "bf16": {"enabled": True}, "steps_per_print": 5})
    assert set(cfg.accepted_not_acted) == {"flops_profiler", "prescale_gradients", "zero_optimization.overlap_comm",
                                          "zero_optimization.contiguous_gradients"}
    # acted-on keys took effect and are not listed
    assert cfg.zero.stage == 2 and cfg.zero.reduce_bucket_size == 1000
    for acted in ("train_batch_size", "gradient_clipping", "bf16", "steps_per_print", "zero_optimization",
                  "zero_optimization.stage", "zero_optimization.reduce_bucket_size",
                  "zero_optimization.offload_optimizer"):
        assert acted not in cfg.accepted_not_acted


@pytest.mark.parametrize("spelling", ["stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
                                      "stage3_gather_fp16_weights_on_model_save"])
def test_the_16bit_gather_on_save_is_not_listed_as_inert_and_a_stage_3_false_is_named(spelling):
    """save_16bit_model gathers the whole 16-bit weights at either value: the key is not "no effect"; with stage 3,
    false (DeepSpeed's ZeRO-3 then writes no weights) gets a start-up line saying the gather happens all the same."""
    from angelptm.engine.builders import gather_note

    for stage in (0, 3):
        for value in (True, False):
            cfg = load({"zero_optimization": {"stage": stage, spelling: value}})
            assert not any("gather" in key for key in cfg.accepted_not_acted)
            assert cfg.zero.gather_16bit_weights_on_model_save is value
            note = gather_note(cfg)
            assert (note is not None) == (stage == 3 and not value)
    assert "gathers and writes the whole 16-bit weights all the same" in gather_note(
        load({"zero_optimization": {"stage": 3, spelling: False}}))
    assert gather_note(load({"zero_optimization": {"stage": 3}})) is None


def test_nothing_listed_for_a_config_without_inert_keys():
    assert load({"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}}).accepted_not_acted == ()


def test_wandb_enabled_is_listed():
    assert "wandb" in load({"wandb": {"enabled": True, "project": "p"}}).accepted_not_acted
    assert "wandb" not in load({"wandb": {"enabled": False}}).accepted_not_acted


def test_aio_section_is_listed_as_not_acted_without_an_nvme_tier():
    cfg = load({"aio": {"block_size": 262144, "queue_depth": 32}})
    assert "aio" in cfg.accepted_not_acted
    with_nvme = load({"aio": {"block_size": 262144, "queue_depth": 32}, "zero_cache": {"nvme_path": "/tmp"}})
    assert "aio" not in with_nvme.accepted_not_acted and with_nvme.zero_cache.aio.queue_depth == 32


def test_scheduler_per_group_lr_lists_load():
    cfg = load({"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": [0.0, 0.0],
                                                             "warmup_max_lr": [0.1, 0.01]}}})
    assert cfg.scheduler.params["warmup_max_lr"] == [0.1, 0.01]


# --------------------------------------------------------------------------------------------
# Unreadable input, conflicts, unsupported types
# --------------------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.json")


def test_no_config():
    with pytest.raises(ConfigError, match="no config given"):
        load_config(None)


def test_invalid_json_reports_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{\n  "train_batch_size": 8,\n  "steps_per_print": 10,\n  "gradient_clipping": 1.0,,\n}\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "not valid JSON at line 4" in str(info.value)
    assert str(path) in str(info.value)


def test_top_level_json_array(tmp_path):
    path = tmp_path / "list.json"
    path.write_text(json.dumps([{"train_batch_size": 8}]))
    with pytest.raises(ConfigError, match="top level must be a JSON object, got list"):
        load_config(path)


def test_fp16_and_bf16_both_enabled():
    message = config_error({"fp16": {"enabled": True}, "bfloat16": {"enabled": True}})
    assert "fp16.enabled" in message and "bf16.enabled" in message


@pytest.mark.parametrize("opt_type", ["Lamb", "OneBitAdam", "SGD"])
def test_unsupported_optimizer_lists_supported(opt_type):
    message = config_error({"optimizer": {"type": opt_type, "params": {"lr": 0.1}}})
    assert f"optimizer.type: {opt_type!r} is not supported" in message
    assert "Adam, AdamW" in message


@pytest.mark.parametrize("sched_type", ["warmuplr", "CosineAnnealing"])
def test_unsupported_scheduler_lists_supported(sched_type):
    message = config_error({"scheduler": {"type": sched_type, "params": {}}})
    assert f"scheduler.type: {sched_type!r} is not supported" in message
    assert "WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest" in message


def test_bias_correction_false_rejected():
    message = config_error({"optimizer": {"type": "Adam", "params": {"bias_correction": False}}})
    assert "optimizer.params.bias_correction" in message


# --------------------------------------------------------------------------------------------
# zero_cache.plan.units
# --------------------------------------------------------------------------------------------

PARSE_BYTES_CASES = [
    ("2GB", 2 * 10**9),
    ("2GiB", 2 * 2**30),
    ("2 GiB", 2 * 2**30),
    ("  512mb ", 512 * 10**6),
    ("1.5G", 3 * 2**29),
    ("1.5 GiB", 3 * 2**29),
    ("0.5KiB", 512),
    ("4k", 4096),
    ("3T", 3 * 2**40),
    ("2TB", 2 * 10**12),
    ("1e3KB", 10**6),
    ("100", 100),
    ("100B", 100),
    (1e9, 10**9),
    (2.0, 2),
    (0, 0),
    (2147483648, 2147483648),
]


@pytest.mark.parametrize("value, expected", PARSE_BYTES_CASES)
def test_parse_bytes_table(value, expected):
    got = parse_bytes(value)
    assert got == expected and type(got) is int


@pytest.mark.parametrize("value, fragment", [
    (-1, "not a whole, non-negative"),
    (-1.0, "not a whole, non-negative"),
    ("-2GB", "cannot read"),
    ("2XB", "unknown unit 'xb'"),
    ("2 G B", "cannot read"),
    ("", "cannot read"),
    (True, "expected a byte count"),
    (False, "expected a byte count"),
    (None, "expected a byte count"),
    ([2], "expected a byte count"),
    (0.5, "not a whole"),
    ("1.5B", "not a whole"),
    ("0.1KiB", "not a whole"),
])
def test_parse_bytes_errors(value, fragment):
    with pytest.raises(ValueError) as info:
        parse_bytes(value, name="zero_cache.device_memory_budget")
    assert fragment in str(info.value)
    assert "zero_cache.device_memory_budget" in str(info.value)


def test_parse_bytes_random_integer_amounts():
    rng = random.Random(77)
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30,
             "K": 2**10, "M": 2**20, "G": 2**30}
    for _ in range(200):
        amount, unit = rng.randint(0, 4096), rng.choice(list(units))
        text = f"{amount}{' ' * rng.randint(0, 2)}{rng.choice([unit, unit.lower(), unit.upper()])}"
        assert parse_bytes(text) == amount * units[unit], text


@pytest.mark.parametrize("text, expected", [("2.01KB", 2010), ("1.07GB", 1_070_000_000), ("0.27TB", 270 * 10**9)])
def test_parse_bytes_exact_decimal_amounts(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("value", ["auto", "AUTO", " auto ", None])
def test_parse_budget_auto(value):
    assert parse_budget(value, name="zero_cache.host_memory_budget") is None


def test_parse_budget_sizes_and_errors():
    assert parse_budget("2GB", name="x") == 2 * 10**9
    assert parse_budget(4096, name="x") == 4096
    with pytest.raises(ValueError, match="x: cannot read 'automatic'"):
        parse_budget("automatic", name="x")
    with pytest.raises(ValueError, match="x: unknown unit 'kg'"):
        parse_budget("3kg", name="x")


def test_zero_cache_budget_through_load_config():
    cfg = load({"zero_cache": {"enabled": True, "device_memory_budget": "1.5GiB", "host_memory_budget": "auto"}})
    assert cfg.zero_cache.device_budget_bytes == 3 * 2**29
    assert cfg.zero_cache.host_budget_bytes is None


# --------------------------------------------------------------------------------------------
# MoEConfig.capacity and AutoPipeConfig.bubble_fraction
# --------------------------------------------------------------------------------------------


def test_moe_capacity_matches_hand_computation():
    rng = random.Random(2024)
    for _ in range(300):
        num_experts = rng.choice([1, 2, 4, 6, 8, 16, 32, 64])
        top_k = rng.randint(1, min(num_experts, 4))
        # multiples of 1/8 are exact in binary, so the hand computation is unambiguous
        train_factor, eval_factor = rng.randint(1, 32) / 8, rng.randint(1, 32) / 8
        min_capacity = rng.randint(0, 16)
        cfg = MoEConfig(num_experts=num_experts, top_k=top_k, capacity_factor=train_factor,
                        eval_capacity_factor=eval_factor, min_capacity=min_capacity, ep_size=1)
        tokens = rng.randint(1, 100_000)
        for training, factor in ((True, train_factor), (False, eval_factor)):
            exact = Fraction(factor) * tokens * top_k / num_experts
            expected = max(math.ceil(exact), min_capacity)
            assert cfg.capacity(tokens, training=training) == expected, (cfg, tokens, training)


def test_moe_capacity_min_capacity_floor():
    cfg = MoEConfig(num_experts=64, top_k=1, capacity_factor=1.0, min_capacity=7)
    assert cfg.capacity(64, training=True) == 7      # 1 token per expert, raised to 7
    assert cfg.capacity(64 * 10, training=True) == 10


def test_moe_capacity_decimal_factor_exact_multiple():
    cfg = MoEConfig(num_experts=8, top_k=2, capacity_factor=1.1, min_capacity=0)
    assert cfg.capacity(200, training=True) == 55  # 1.1 * 200 * 2 / 8 = 55 exactly


def simulated_gpipe_bubble(stages: int, micro: int) -> Fraction:
    """Idle share of a GPipe flush from an explicit timetable (unit-time forward and backward)."""
    finish = {}
    for m in range(micro):  # forwards: stage s starts microbatch m after s-1 finished it and s finished m-1
        for s in range(stages):
            start = max(finish.get(("f", s - 1, m), 0), finish.get(("f", s, m - 1), 0))
            finish[("f", s, m)] = start + 1
    t_fwd_end = max(finish.values())
    for m in range(micro):  # backwards flow from the last stage to the first
        for s in reversed(range(stages)):
            start = max(finish.get(("b", s + 1, m), t_fwd_end), finish.get(("b", s, m - 1), t_fwd_end))
            finish[("b", s, m)] = start + 1
    total = max(finish.values())
    busy_per_stage = 2 * micro
    return Fraction(total - busy_per_stage, total)


@pytest.mark.parametrize("stages, micro", [(1, 1), (1, 8), (2, 1), (2, 4), (4, 4), (4, 16), (8, 3)])
def test_bubble_fraction_gpipe_matches_timetable(stages, micro):
    cfg = AutoPipeConfig(num_stages=stages, num_microbatches=micro, schedule="gpipe")
    assert cfg.bubble_fraction() == pytest.approx(float(simulated_gpipe_bubble(stages, micro)), abs=1e-15)
    assert cfg.bubble_fraction() == pytest.approx((stages - 1) / (micro + stages - 1), abs=1e-15)


def test_bubble_fraction_formula_random():
    rng = random.Random(9)
    for _ in range(50):
        stages, micro, virtual = rng.randint(1, 16), rng.randint(1, 64), rng.randint(1, 4)
        schedule = "interleaved" if virtual > 1 else rng.choice(["gpipe", "1f1b", "interleaved"])
        cfg = AutoPipeConfig(num_stages=stages, num_microbatches=micro, virtual_stages_per_rank=virtual,
                             schedule=schedule)
        expected = Fraction(stages - 1, virtual * micro + stages - 1)
        assert cfg.bubble_fraction() == pytest.approx(float(expected), abs=1e-15)
        # interleaving with v chunks cuts the GPipe bubble time (S-1)/M by v
        gpipe = AutoPipeConfig(num_stages=stages, num_microbatches=micro, schedule="gpipe").bubble_fraction()
        assert cfg.bubble_fraction() <= gpipe + 1e-15
        if stages > 1 and virtual > 1:
            assert cfg.bubble_fraction() < gpipe


def test_deepspeed_overlap_and_prefetch_keys_steer_sharded_zero_cache(caplog):
    defaults = ZeroCacheConfig()
    prefetch = random.randint(defaults.gather_ahead_elements + 1, 10**10)
    base = {"train_micro_batch_size_per_gpu": 1, "zero_cache": {"enabled": True}}
    cfg = load_config({**base, "zero_optimization": {"stage": 3, "overlap_comm": False,
                                                     "stage3_prefetch_bucket_size": prefetch}})
    assert cfg.zero_cache.overlap_comm is False and cfg.zero_cache.gather_ahead_elements == prefetch
    assert not any("overlap_comm" in key or "prefetch" in key for key in cfg.accepted_not_acted)
    # Without ZeRO-Cache they change nothing, and say so; unset, ZeRO-Cache keeps its own defaults.
    plain = load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"overlap_comm": False}})
    assert "zero_optimization.overlap_comm" in plain.accepted_not_acted
    assert load_config(base).zero_cache.overlap_comm is True
    # Judged by the validated values: stage "3" (read as 3) with an offload device is sharded ZeRO-Cache too.
    offloaded = load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": "3", "overlap_comm": False, "offload_optimizer": {"device": "cpu"}}})
    assert offloaded.zero_cache.enabled and offloaded.zero_cache.overlap_comm is False
    assert "zero_optimization.overlap_comm" not in offloaded.accepted_not_acted
    live = random.randint(defaults.max_live_elements, 10**11)
    carried = load_config({**base, "zero_optimization": {"stage3_max_live_parameters": live}}).zero_cache
    assert carried.max_live_elements == live and carried.shard_params == "auto"
    # Below the defaults they would only slow the step: raised to them, with the key that forces a value.
    small_prefetch, small_live = random.randint(0, defaults.gather_ahead_elements - 1), random.randint(0, 10**6)
    with caplog.at_level("INFO", logger="angelptm.config.loader"):
        clamped = load_config({**base, "zero_optimization": {"stage3_prefetch_bucket_size": small_prefetch,
                                                             "stage3_max_live_parameters": small_live}}).zero_cache
    assert clamped.gather_ahead_elements == defaults.gather_ahead_elements
    assert clamped.max_live_elements == defaults.max_live_elements
    assert f"stage3_prefetch_bucket_size {small_prefetch:,} is below" in caplog.text
    assert "set zero_cache.gather_ahead_elements to force a value" in caplog.text
    assert "set zero_cache.max_live_elements to force a value" in caplog.text
    forced = load_config({**base, "zero_cache": {"enabled": True, "gather_ahead_elements": small_prefetch + 1},
                          "zero_optimization": {"stage3_prefetch_bucket_size": small_prefetch}}).zero_cache
    assert forced.gather_ahead_elements == small_prefetch + 1  # the zero_cache section's own value wins
    with pytest.raises(ConfigError, match="shard_params: expected true, false or 'auto'"):
        load_config({**base, "zero_cache": {"enabled": True, "shard_params": "sometimes"}})
    with pytest.raises(ConfigError, match="gather_ahead_elements"):
        load_config({**base, "zero_cache": {"enabled": True, "gather_ahead_elements": -1}})
    with pytest.raises(ConfigError, match="hierarchical: expected true, false or 'auto'"):
        load_config({**base, "zero_cache": {"enabled": True, "hierarchical": "sometimes"}})
    with pytest.raises(ConfigError, match="ranks_per_host: must be >= 1"):
        load_config({**base, "zero_cache": {"enabled": True, "ranks_per_host": 0}})
