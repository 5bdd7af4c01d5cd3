"""Issue 38: a user's own script (angelptm.initialize + engine.step) keeps DeepSpeed's behaviour, skipped steps
go on, but gets one warning line when the run turns unhealthy and one info line when it recovers."""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

import angelptm

HEALTH_LOGGER = "angelptm.engine.engine"


def user_engine(**extra: dict) -> angelptm.Engine:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    config = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, **extra}
    engine, _, _, _ = angelptm.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def train(engine: angelptm.Engine, steps: int, *, poison: float = 1.0) -> list[float]:
    """``steps`` optimizer steps; ``poison`` nan makes every loss (and so every gradient) non-finite."""
    losses = []
    for _ in range(steps):
        loss = engine(torch.randn(4, 8)).pow(2).mean() * poison
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def health_lines(caplog) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records
            if "healthy" in r.getMessage() and r.name == HEALTH_LOGGER]


def test_a_users_run_warns_once_when_unhealthy_goes_on_and_says_when_it_recovers(caplog):
    engine = user_engine(train={"max_bad_steps": 3})
    caplog.set_level(logging.INFO, logger="angelptm")
    assert all(math.isfinite(loss) for loss in train(engine, 2))
    assert all(math.isnan(loss) for loss in train(engine, 10, poison=math.nan))
    assert engine.global_steps == 12 and engine.skipped_steps == 10  # DeepSpeed's behaviour: the steps go on
    lines = health_lines(caplog)
    assert len(lines) == 1 and lines[0][0] == logging.WARNING, lines
    assert "no healthy step in the last 3 steps (up to step 5" in lines[0][1], lines
    assert "the loss is not finite" in lines[0][1] and "train.max_bad_steps" in lines[0][1], lines
    train(engine, 2)
    lines = health_lines(caplog)
    assert len(lines) == 2 and lines[1][0] == logging.INFO, lines
    assert "healthy again at step 13 after 10 unhealthy steps" in lines[1][1], lines
    train(engine, 2, poison=math.nan)  # fewer than max_bad_steps: nothing more said
    assert len(health_lines(caplog)) == 2


def test_a_users_run_without_a_train_section_warns_after_20_bad_steps(caplog):
    engine = user_engine()
    caplog.set_level(logging.INFO, logger="angelptm")
    train(engine, 19, poison=math.nan)
    assert health_lines(caplog) == []
    train(engine, 1, poison=math.nan)
    lines = health_lines(caplog)
    assert len(lines) == 1 and "no healthy step in the last 20 steps (up to step 20" in lines[0][1], lines


def test_fp16s_scale_search_is_not_an_unhealthy_run(caplog):
    """fp16.initial_scale_power 40: the scaler skips steps while it halves its scale (DeepSpeed's behaviour), which
    is not the run diverging: no "lower optimizer.params.lr" line after max_bad_steps of them."""
    engine = user_engine(fp16={"enabled": True, "initial_scale_power": 40}, train={"max_bad_steps": 3})
    caplog.set_level(logging.INFO, logger="angelptm")
    for _ in range(40):
        loss = engine(torch.randn(4, 8, dtype=torch.float16)).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    assert engine.skipped_steps >= 3 and engine.skipped_steps < 40, engine.skipped_steps  # searched, then trained
    assert health_lines(caplog) == []
