"""Issue 38: absurd optimizer hyperparameters (lr 1e10, weight_decay 1e59, eps 1e59) are refused at parse.

Each used to be accepted: the first step wrecked the weights and every later step was skipped. Each message
names the key, the value given and the range allowed.
"""

from __future__ import annotations

import math

import pytest
import torch

from angelptm.config import load_config
from angelptm.errors import ConfigError

BATCH = {"train_batch_size": 8}


def refused(params: dict) -> str:
    with pytest.raises(ConfigError) as info:
        load_config({**BATCH, "optimizer": {"type": "AdamW", "params": params}})
    return str(info.value)


@pytest.mark.parametrize("key, value, allowed", [
    ("lr", 1e10, "[0, 10]"),
    ("lr", -1e-3, "[0, 10]"),
    ("weight_decay", 1e59, "[0, 10]"),
    ("weight_decay", -0.1, "[0, 10]"),
    ("eps", 1e59, "[1.18e-38, 1)"),
    ("eps", 0.0, "[1.18e-38, 1)"),
    ("eps", 1.0, "[1.18e-38, 1)"),
])
def test_an_absurd_optimizer_value_is_refused_naming_key_value_and_range(key, value, allowed):
    message = refused({key: value})
    assert f"optimizer.params.{key}: {value!r}" in message and allowed in message, message
    assert len(message.strip().splitlines()[-1]) < 200 and "Traceback" not in message


@pytest.mark.parametrize("key, value", [("lr", math.inf), ("lr", math.nan), ("weight_decay", math.nan),
                                        ("eps", math.nan), ("betas", [0.9, math.nan])])
def test_a_non_finite_optimizer_value_is_refused_by_name(key, value):
    message = refused({key: value})
    assert f"optimizer.params.{key}" in message and "finite" in message, message


@pytest.mark.parametrize("betas", [[0.9, 1.0], [-0.1, 0.999], [1.5, 0.9]])
def test_betas_outside_zero_one_are_refused(betas):
    message = refused({"betas": betas})
    assert "optimizer.params.betas" in message and "[0, 1)" in message and repr(tuple(betas)) in message, message


def test_the_issues_lr_of_1e10_is_refused_by_name():
    message = refused({"lr": 1e10})
    assert "optimizer.params.lr: 10000000000.0" in message and "lower it" in message, message


def test_large_but_plausible_values_still_load():
    cfg = load_config({**BATCH, "optimizer": {"type": "Adam", "params": {
        "lr": 10.0, "weight_decay": 10.0, "eps": 0.5, "betas": [0.0, 0.9999]}}})
    assert (cfg.optimizer.lr, cfg.optimizer.weight_decay, cfg.optimizer.eps) == (10.0, 10.0, 0.5)
    assert cfg.optimizer.betas == (0.0, 0.9999)


@pytest.mark.parametrize("eps", [1e-300, 1e-45, 0.0])
def test_an_eps_below_float32s_smallest_normal_is_refused(eps):
    """fp32 Adam states (the masters and moments are fp32) round 1e-300 to 0: eps no longer guards the division,
    and a parameter whose second moment is 0 divides 0 by 0."""
    message = refused({"eps": eps})
    tiny = torch.finfo(torch.float32).tiny
    assert f"optimizer.params.eps: {eps!r}" in message and f"{tiny:.3g}" in message and "float32" in message, message


def test_the_smallest_normal_eps_still_loads():
    tiny = torch.finfo(torch.float32).tiny
    cfg = load_config({**BATCH, "optimizer": {"type": "AdamW", "params": {"eps": tiny}}})
    assert cfg.optimizer.eps == tiny
