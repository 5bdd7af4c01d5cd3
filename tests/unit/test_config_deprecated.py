"""DeepSpeed's deprecated config keys load with DeepSpeed's meaning and a warning naming the new key (issue 28).

Each case is parsed by DeepSpeed 0.19's own ``get_zero_config``: the deprecated config and the config as we
rewrite it must mean the same to DeepSpeed, and our typed config must carry what DeepSpeed's parse holds.
"""

from __future__ import annotations

import copy
import logging

import pytest

from angelptm.config import edge, load_config
from angelptm.errors import ConfigError

zero_config = pytest.importorskip("deepspeed.runtime.zero.config")

DEPRECATED_FIELDS = {name for name, info in zero_config.DeepSpeedZeroConfig.model_fields.items()
                     if (info.json_schema_extra or {}).get("deprecated")}
BASE = {"train_batch_size": 16, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}

CASES = {
    # DeepSpeedExamples' training/cifar/cifar10_deepspeed.py writes this one.
    "cpu_offload false (cifar)": ({"zero_optimization": {"stage": 2, "cpu_offload": False}}, "offload_optimizer"),
    "cpu_offload true": ({"zero_optimization": {"stage": 2, "cpu_offload": True}}, "offload_optimizer"),
    "cpu_offload_param true": ({"zero_optimization": {"stage": 3, "cpu_offload_param": True}}, "offload_param"),
    "cpu_offload_param false": ({"zero_optimization": {"stage": 3, "cpu_offload_param": False}}, "offload_param"),
    "cpu_offload_use_pin_memory": ({"zero_optimization": {"stage": 2, "cpu_offload_use_pin_memory": True}},
                                   "offload_optimizer.pin_memory"),
    "stage3_gather_fp16_weights_on_model_save": (
        {"zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True}},
        "stage3_gather_16bit_weights_on_model_save"),
    "zero_optimization true": ({"zero_optimization": True, "allgather_size": 20_000_000}, '"stage": 1'),
    "zero_optimization false": ({"zero_optimization": False}, '"stage": 0'),
}


def _ds_device(offload) -> str:
    return "none" if offload is None else str(offload.device.value if hasattr(offload.device, "value")
                                              else offload.device)


@pytest.mark.parametrize("name", sorted(CASES))
def test_deprecated_key_means_what_it_means_to_deepspeed(name, caplog):
    extra, new_key = CASES[name]
    config = {**BASE, **copy.deepcopy(extra)}
    theirs = zero_config.get_zero_config(copy.deepcopy(config))

    rewritten = copy.deepcopy(config)
    warnings = edge.upgrade_deprecated_keys(rewritten)
    # The same meaning, to DeepSpeed (its dump lists the deprecated fields it did not read, not those it did).
    assert (zero_config.get_zero_config(copy.deepcopy(rewritten)).model_dump(exclude=DEPRECATED_FIELDS)
            == theirs.model_dump(exclude=DEPRECATED_FIELDS))
    assert len(warnings) == 1 and new_key in warnings[0]

    with caplog.at_level(logging.WARNING, logger="angelptm.config.loader"):
        ours = load_config(config, device_type="cpu")
    assert any(new_key in record.message and record.levelno == logging.WARNING for record in caplog.records)
    assert ours.zero.stage == int(theirs.stage)
    assert ours.zero.offload_param_device == _ds_device(theirs.offload_param)
    # An offload device at stage 3 turns ZeRO-Cache on: the one effect offload_optimizer has here.
    offloads = {_ds_device(theirs.offload_optimizer), _ds_device(theirs.offload_param)} - {"none"}
    assert ours.zero_cache.enabled == (int(theirs.stage) == 3 and bool(offloads))


def test_every_deprecated_field_of_deepspeeds_zero_config_is_in_the_table():
    """The table follows DeepSpeed: a field it marks deprecated and we do not map would be refused here."""
    assert {f"zero_optimization.{name}" for name in DEPRECATED_FIELDS} == {key.path for key in edge.DEPRECATED_KEYS}


@pytest.mark.parametrize("deprecated, replacing", [
    ("cpu_offload", {"offload_optimizer": {"device": "cpu"}}),
    ("cpu_offload_param", {"offload_param": {"device": "cpu"}}),
    ("stage3_gather_fp16_weights_on_model_save", {"stage3_gather_16bit_weights_on_model_save": True}),
])
def test_deprecated_key_beside_its_replacement_is_refused_as_deepspeed_does(deprecated, replacing):
    config = {**BASE, "zero_optimization": {"stage": 3, deprecated: True, **replacing}}
    with pytest.raises(AssertionError, match="together"):
        zero_config.get_zero_config(copy.deepcopy(config))
    with pytest.raises(ConfigError, match=f"zero_optimization.{deprecated} .deprecated. and "
                                          f"zero_optimization.{next(iter(replacing))}"):
        load_config(config, device_type="cpu")


def test_deepspeedexamples_cifar_config_loads_as_deepspeed_reads_it():
    """training/cifar/cifar10_deepspeed.py's get_ds_config(), verbatim for --dtype fp32 --stage 0: it stopped at
    "zero_optimization.cpu_offload: unknown key"."""
    config = {
        "train_batch_size": 16, "steps_per_print": 2000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                 "weight_decay": 3e-7}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                     "warmup_num_steps": 1000}},
        "gradient_clipping": 1.0, "prescale_gradients": False,
        "bf16": {"enabled": False},
        "fp16": {"enabled": False, "fp16_master_weights_and_grads": False, "loss_scale": 0, "loss_scale_window": 500,
                 "hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 15},
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": 0, "allgather_partitions": True, "reduce_scatter": True,
                              "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000, "overlap_comm": True,
                              "contiguous_gradients": True, "cpu_offload": False},
    }
    theirs = zero_config.get_zero_config(copy.deepcopy(config))
    ours = load_config(config, device_type="cpu")
    assert _ds_device(theirs.offload_optimizer) == "none"
    assert (ours.zero.stage, ours.zero_cache.enabled) == (int(theirs.stage), False)
    assert ours.zero.reduce_bucket_size == theirs.reduce_bucket_size == 50_000_000
    assert str(ours.precision.dtype) == "torch.float32" and ours.gradient_clipping == 1.0
