"""DeepSpeed's public runtime modules on angelptm (``runtime.config``, ``config_utils``, ``zero.config``,
``precision_config``, ``lr_schedules``) and ``initialize``'s return values, against DeepSpeed's own in-process.

DeepSpeed's own unit tests of these modules run by ``bench/deepspeed_api_tests.py`` (slow, not in CI)."""

from __future__ import annotations

import base64
import json
import math
import random

import pytest
import torch
from pydantic import ValidationError
from torch import nn

import angelptm
from angelptm.runtime import lr_schedules as ours
from angelptm.runtime.config import DeepSpeedConfig
from angelptm.runtime.precision_config import DeepSpeedFP16Config, get_bfloat16_config
from angelptm.runtime.zero.config import DeepSpeedZeroConfig, DeepSpeedZeroOffloadParamConfig

deepspeed = pytest.importorskip("deepspeed")
from deepspeed.runtime import lr_schedules as theirs  # noqa: E402


def optimizer(groups: int = 2, lr: float | torch.Tensor = 0.1) -> torch.optim.Optimizer:
    params = [{"params": [nn.Parameter(torch.zeros(2))], "lr": lr if groups == 1 else 0.1 * (i + 1)}
              for i in range(groups)]
    return torch.optim.Adam(params, lr=0.1)


def trajectory(module, name: str, kwargs: dict, steps: int) -> list[list[float]]:
    """Each step's lrs (and beta1s where the schedule cycles momentum) of ``module.name`` over two groups."""
    opt = optimizer()
    schedule = getattr(module, name)(opt, **kwargs)
    rows = []
    for _ in range(steps):
        schedule.step()
        rows.append([float(g["lr"]) for g in opt.param_groups] + [g["betas"][0] for g in opt.param_groups])
    return rows


CASES = [
    ("OneCycle", dict(cycle_min_lr=0.01, cycle_max_lr=[0.1, 0.2], cycle_first_step_size=5, cycle_second_step_size=3,
                      decay_lr_rate=0.5, decay_step_size=2, cycle_min_mom=0.8, cycle_max_mom=0.95,
                      decay_mom_rate=0.01)),
    ("OneCycle", dict(cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=6, cycle_first_stair_count=3)),
    ("LRRangeTest", dict(lr_range_test_min_lr=[1e-3, 2e-3], lr_range_test_step_size=3, lr_range_test_step_rate=2.0,
                         lr_range_test_staircase=True)),
    ("LRRangeTest", dict(lr_range_test_min_lr=1e-3, lr_range_test_step_size=4)),
    ("WarmupLR", dict(warmup_min_lr=0.01, warmup_num_steps=5, warmup_type="linear")),
    ("WarmupDecayLR", dict(total_num_steps=12, warmup_max_lr=0.2, warmup_num_steps=4)),
    ("WarmupCosineLR", dict(total_num_steps=12, warmup_num_steps=4, warmup_min_ratio=0.1, cos_min_ratio=0.05)),
]


@pytest.mark.parametrize("name,kwargs", CASES)
def test_every_schedule_steps_as_deepspeeds(name, kwargs) -> None:
    got, expected = trajectory(ours, name, kwargs, 16), trajectory(theirs, name, kwargs, 16)
    assert len({tuple(row) for row in expected}) > 3, "the schedule must move, or agreement proves little"
    for row, want in zip(got, expected):
        assert row == pytest.approx(want, rel=1e-12, abs=0)
    assert ours.VALID_LR_SCHEDULES == theirs.VALID_LR_SCHEDULES


def test_warmup_cosine_ratio_tensor_lrs_and_validation_follow_deepspeed(caplog) -> None:
    rows = []
    for module in (ours, theirs):
        schedule = module.WarmupCosineLR(optimizer(), total_num_steps=10, warmup_num_steps=3, warmup_type="cubic")
        ratios = []
        for _ in range(12):
            schedule.step()
            ratios.append(schedule.get_lr_ratio())
        rows.append(ratios)
    assert rows[0] == pytest.approx(rows[1]) and rows[0][0] == 0.0 and rows[0][2] == pytest.approx(1.0)
    assert any("unknown warmup_type 'cubic'" in record.getMessage() for record in caplog.records)
    lr = torch.tensor(0.1, dtype=torch.float64)
    opt = optimizer(groups=1, lr=lr)
    schedule = ours.WarmupLR(opt, warmup_num_steps=10)
    schedule.step(1)
    assert opt.param_groups[0]["lr"] is lr and lr.item() == pytest.approx(0.1 * math.log(2) / math.log(10))
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match="warmup_num_steps must be a positive integer"):
            ours.WarmupDecayLR(optimizer(), total_num_steps=10, warmup_num_steps=bad)
    with pytest.raises(ValueError, match="cycle_first_step_size must be positive"):
        ours.OneCycle(optimizer(), 0.01, 0.1, cycle_first_step_size=0)


def test_deepspeed_config_resolves_batches_and_reads_files_as_deepspeed(tmp_path) -> None:
    config = DeepSpeedConfig({"train_batch_size": 32, "gradient_accumulation_steps": 4,
                              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                              "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 7},
                              "bf16": {"enabled": True}})
    assert (config.train_micro_batch_size_per_gpu, config.optimizer_name, config.zero_optimization_stage,
            config.zero_config.prefetch_bucket_size, config.bfloat16_enabled) == (8, "adamw", 3, 7, True)
    config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps = 33, 17, 2
    with pytest.raises(AssertionError, match="Check batch related parameters"):
        config._configure_train_batch_size()
    path = tmp_path / "ds.hjson"
    path.write_text("{\n  # hjson: comments, unquoted keys, trailing commas\n  train_micro_batch_size_per_gpu: 3,\n}")
    assert DeepSpeedConfig(str(path)).train_batch_size == 3
    encoded = base64.urlsafe_b64encode(json.dumps({"train_batch_size": 6}).encode()).decode()
    assert DeepSpeedConfig(encoded).train_micro_batch_size_per_gpu == 6
    path.write_text('{"train_batch_size": 2, "train_batch_size": 2}')
    with pytest.raises(ValueError, match="duplicate keys"):
        DeepSpeedConfig(str(path))
    with pytest.raises(ValueError, match="not supported with ZeRO stage 3"):
        DeepSpeedConfig({"train_batch_size": 1, "gradient_allreduce_op": "sum", "zero_optimization": {"stage": 3}})


def test_zero_and_precision_models_follow_deepspeeds() -> None:
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config as TheirFP16
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig as TheirZero

    for values in ({"stage": 3}, {"stage": 1, "stage3_max_reuse_distance": 5}, {"cpu_offload": True},
                   {"stage3_gather_fp16_weights_on_model_save": True}, {"reduce_bucket_size": "auto"}):
        mine, real = DeepSpeedZeroConfig(**values), TheirZero(**values)
        for field in ("stage", "overlap_comm", "max_reuse_distance", "gather_16bit_weights_on_model_save",
                      "reduce_bucket_size"):
            assert getattr(mine, field) == getattr(real, field), (values, field)
        assert (mine.offload_optimizer is None) == (real.offload_optimizer is None)
    assert isinstance(DeepSpeedZeroConfig(cpu_offload_param=True).offload_param, DeepSpeedZeroOffloadParamConfig)
    with pytest.raises(AssertionError):
        DeepSpeedZeroConfig(cpu_offload=True, offload_optimizer={"device": "cpu"})
    for bad in ({"loss_scale": -1}, {"loss_scale": True}, {"enabled": True, "loss_scale_window": 0},
                {"min_loss_scale": float("nan")}):
        for model in (DeepSpeedFP16Config, TheirFP16):
            with pytest.raises(ValidationError):
                model(**bad)
    assert DeepSpeedFP16Config(loss_scale="3").loss_scale == 3.0
    assert get_bfloat16_config({"bfloat16": {"enabled": True}}).enabled


def test_initialize_returns_deepspeeds_choice_of_optimizer_and_asserts_without_a_model() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    client = torch.optim.Adam(model.parameters(), lr=0.01)
    config = {"train_batch_size": 1, "bf16": {"enabled": False}, "gradient_clipping": 0.0}
    engine, returned, _, _ = angelptm.initialize(model=model, optimizer=client, config=config)
    assert returned is client and engine.optimizer is not client  # the engine keeps its wrapper
    engine, returned, _, _ = angelptm.initialize(model=nn.Linear(4, 2), optimizer=client.__class__,
                                                 config={**config, "zero_optimization": {"stage": 2}})
    assert returned is engine.optimizer  # under ZeRO, as in DeepSpeed, the wrapper
    with pytest.raises(AssertionError, match="model= is required"):
        angelptm.initialize(model=None, config=config)


def test_one_cycle_from_the_config_moves_the_engines_lr_and_beta1_like_deepspeeds() -> None:
    params = {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 3, "cycle_min_mom": 0.85,
              "cycle_max_mom": 0.95}
    config = {"train_batch_size": 1, "bf16": {"enabled": False},
              "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
              "scheduler": {"type": "OneCycle", "params": params}}
    engine, _, _, scheduler = angelptm.initialize(model=nn.Linear(3, 1), config=config)
    reference = theirs.OneCycle(optimizer(groups=1), **params)
    rng = random.Random(0)
    for _ in range(7):
        engine.backward(engine(torch.tensor([[rng.random() for _ in range(3)]])).sum())
        engine.step()
        reference.step()
        assert engine.get_lr() == pytest.approx(reference.get_lr())
        assert scheduler.get_mom()[0][0] == pytest.approx(reference.get_mom()[0][0])
        assert engine.optimizer.param_groups[0]["betas"][0] == pytest.approx(reference.get_mom()[0][0])
