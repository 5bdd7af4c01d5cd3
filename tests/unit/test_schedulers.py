"""Our learning-rate schedules against DeepSpeed's own (``deepspeed.runtime.lr_schedules``), step by step."""

from __future__ import annotations

import json
import logging
import random

import pytest
import torch

from angelptm.config import SchedulerConfig, load_config
from angelptm.engine import schedulers as ours

ds_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
logging.getLogger("DeepSpeed").setLevel(logging.ERROR)  # "total_num_steps < warmup" / "before started" warnings

STEPS = 300
TOL = 0.0  # the same float operations in the same order: bit-equal rates


def make_optimizer(rng: random.Random, groups: int) -> torch.optim.Optimizer:
    """An AdamW over ``groups`` param groups with different (random) base learning rates."""
    params = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": rng.uniform(1e-4, 1e-1)} for _ in range(groups)]
    return torch.optim.AdamW(params, lr=0.01)


def random_lr_pair(rng: random.Random, groups: int, as_list: bool) -> tuple:
    lows = [rng.uniform(0.0, 1e-3) for _ in range(groups)]
    highs = [rng.uniform(2e-3, 5e-2) for _ in range(groups)]
    if as_list:
        return lows, highs
    return lows[0], highs[0]


def warmup_lr_cases():
    rng = random.Random(100)
    cases = [
        dict(warmup_num_steps=1),                                    # clamped to 2; max lr from the optimizer
        dict(warmup_min_lr=0.0, warmup_max_lr=0.01, warmup_num_steps=1),
        dict(warmup_min_lr=1e-4, warmup_max_lr=0.03, warmup_num_steps=2),
        dict(warmup_min_lr=0.0, warmup_num_steps=50),                # max lr = each group's own lr
    ]
    for as_list in (False, True, False):
        low, high = random_lr_pair(rng, 2, as_list)
        cases.append(dict(warmup_min_lr=low, warmup_max_lr=high, warmup_num_steps=rng.randint(3, 400)))
    return cases


def warmup_decay_cases():
    rng = random.Random(200)
    cases = [
        dict(total_num_steps=250, warmup_num_steps=1),
        dict(total_num_steps=5, warmup_num_steps=20, warmup_min_lr=1e-3, warmup_max_lr=0.02),   # total < warmup
        dict(total_num_steps=20, warmup_num_steps=20),                                          # no decay window
        dict(total_num_steps=21, warmup_num_steps=20),
        dict(total_num_steps=120, warmup_num_steps=10),                                        # decays past 0
    ]
    for as_list in (False, True, False):
        low, high = random_lr_pair(rng, 2, as_list)
        warmup = rng.randint(2, 150)
        cases.append(dict(total_num_steps=warmup + rng.randint(1, 400), warmup_num_steps=warmup,
                          warmup_min_lr=low, warmup_max_lr=high))
    return cases


def warmup_cosine_cases():
    rng = random.Random(300)
    cases = [
        dict(total_num_steps=250, warmup_num_steps=1),
        dict(total_num_steps=5, warmup_num_steps=20, warmup_min_ratio=0.1),                   # total < warmup
        dict(total_num_steps=20, warmup_num_steps=20, cos_min_ratio=0.2),
        dict(total_num_steps=100, warmup_num_steps=10, warmup_min_ratio=0.05, cos_min_ratio=0.0),
    ]
    for _ in range(3):
        warmup = rng.randint(2, 150)
        cases.append(dict(total_num_steps=warmup + rng.randint(1, 400), warmup_num_steps=warmup,
                          warmup_min_ratio=rng.uniform(0, 0.5), cos_min_ratio=rng.uniform(0, 0.3)))
    return cases


CASES = (
    [("WarmupLR", p) for p in warmup_lr_cases()]
    + [("WarmupDecayLR", p) for p in warmup_decay_cases()]
    + [("WarmupCosineLR", p) for p in warmup_cosine_cases()]
)


def build_pair(name: str, params: dict, warmup_type: str, groups: int, seed: int):
    """The same schedule over two identical optimizers: (ours, DeepSpeed's)."""
    opt_ours = make_optimizer(random.Random(seed), groups)
    opt_ds = make_optimizer(random.Random(seed), groups)
    mine = getattr(ours, name)(opt_ours, warmup_type=warmup_type, **params)
    theirs = getattr(ds_schedules, name)(opt_ds, warmup_type=warmup_type, **params)
    return mine, opt_ours, theirs, opt_ds


def assert_same_lrs(opt_ours, opt_ds, step):
    for index, (a, b) in enumerate(zip(opt_ours.param_groups, opt_ds.param_groups)):
        assert a["lr"] == pytest.approx(b["lr"], abs=TOL, rel=0), f"step {step}, group {index}"


def lr_lists(params: dict) -> bool:
    return any(isinstance(v, list) for v in params.values())


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
@pytest.mark.parametrize("name, params", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_same_lrs_as_deepspeed(name, params, warmup_type):
    for groups in ((2,) if lr_lists(params) else (1, 2)):
        mine, opt_ours, theirs, opt_ds = build_pair(name, params, warmup_type, groups, seed=len(str(params)))
        assert_same_lrs(opt_ours, opt_ds, -1)  # both write the step -1 rates at construction
        seen = set()
        for step in range(STEPS):
            mine.step()
            theirs.step()
            assert_same_lrs(opt_ours, opt_ds, step)
            assert mine.get_last_lr() == pytest.approx(theirs.get_last_lr(), abs=TOL, rel=0)
            seen.add(round(opt_ours.param_groups[0]["lr"], 15))
        assert mine.last_batch_iteration == theirs.last_batch_iteration == STEPS - 1
        assert len(seen) > 1  # the schedule actually moved


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
@pytest.mark.parametrize("name, params", CASES[::3], ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES[::3])])
def test_explicit_step_index_jumps(name, params, warmup_type):
    """step(last_batch_iteration=k) jumps straight to step k, in any order, in both."""
    mine, opt_ours, theirs, opt_ds = build_pair(name, params, warmup_type, 2, seed=5)
    rng = random.Random(len(CASES) + len(str(params)))
    for _ in range(60):
        k = rng.randint(0, 2 * STEPS)
        mine.step(k)
        theirs.step(k)
        assert_same_lrs(opt_ours, opt_ds, k)


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
@pytest.mark.parametrize("name, params", CASES[1::3], ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES[1::3])])
def test_state_dict_round_trip_continues_identically(name, params, warmup_type):
    rng = random.Random(len(str(params)))
    split = rng.randint(1, STEPS - 1)
    mine, opt_ours, theirs, opt_ds = build_pair(name, params, warmup_type, 2, seed=9)
    for _ in range(split):
        mine.step()
        theirs.step()
    state = mine.state_dict()
    assert state == theirs.state_dict() == {"last_batch_iteration": split - 1}

    # a fresh optimizer and schedule (as after a restart), restored from the saved state
    opt_restored = make_optimizer(random.Random(9), 2)
    restored = getattr(ours, name)(opt_restored, warmup_type=warmup_type, **params)
    restored.load_state_dict(state)
    assert_same_lrs(opt_restored, opt_ours, "after load")
    for step in range(split, STEPS):
        for scheduler in (mine, theirs, restored):
            scheduler.step()
        assert_same_lrs(opt_restored, opt_ours, step)
        assert_same_lrs(opt_restored, opt_ds, step)


@pytest.mark.parametrize("name, params", CASES[2::5], ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES[2::5])])
def test_deepspeed_state_dict_loads_into_ours(name, params):
    rng = random.Random(len(str(params)) + 1)
    mine, opt_ours, theirs, opt_ds = build_pair(name, params, "linear", 2, seed=3)
    for _ in range(rng.randint(1, 150)):
        theirs.step()
    mine.load_state_dict(theirs.state_dict())
    for step in range(50):
        mine.step()
        theirs.step()
        assert_same_lrs(opt_ours, opt_ds, step)


@pytest.mark.parametrize("name, params", [
    ("WarmupLR", {"warmup_min_lr": 1e-4, "warmup_max_lr": 2e-2, "warmup_num_steps": 40, "warmup_type": "linear"}),
    ("WarmupLR", {"warmup_num_steps": 30}),
    ("WarmupDecayLR", {"total_num_steps": 200, "warmup_max_lr": 3e-2, "warmup_num_steps": 1}),
    ("WarmupCosineLR", {"total_num_steps": 150, "warmup_num_steps": 15, "cos_min_ratio": 0.1}),
])
def test_build_scheduler_from_loaded_config(name, params):
    cfg = load_config({"train_batch_size": 4, "scheduler": {"type": name, "params": params}})
    assert isinstance(cfg.scheduler, SchedulerConfig) and cfg.scheduler.type == name

    rng = random.Random(len(str(params)))
    opt_ours, opt_ds = make_optimizer(rng, 2), make_optimizer(random.Random(len(str(params))), 2)
    mine = ours.build_scheduler(cfg.scheduler, opt_ours)
    assert type(mine) is getattr(ours, name)
    theirs = getattr(ds_schedules, name)(opt_ds, **params)  # DeepSpeed's defaults for the rest
    for step in range(STEPS):
        mine.step()
        theirs.step()
        assert_same_lrs(opt_ours, opt_ds, step)


def test_build_scheduler_from_config_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "scheduler": {
        "type": "WarmupDecayLR", "params": {"total_num_steps": 100, "warmup_num_steps": 10}}}))
    scheduler = ours.build_scheduler(load_config(path).scheduler, make_optimizer(random.Random(0), 1))
    assert isinstance(scheduler, ours.WarmupDecayLR)
    assert scheduler.total_num_steps == 100 and scheduler.warmup_num_steps == 10
    assert scheduler.max_lrs == [0.001] and scheduler.warmup_type == "log"  # DeepSpeed's defaults


def test_build_scheduler_direct_config():
    opt = make_optimizer(random.Random(1), 2)
    scheduler = ours.build_scheduler(SchedulerConfig(type="WarmupCosineLR", params={"total_num_steps": 10}), opt)
    assert isinstance(scheduler, ours.WarmupCosineLR)
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.0]  # step -1: ratio 0


def test_per_group_list_length_mismatch():
    opt = make_optimizer(random.Random(2), 2)
    with pytest.raises(ValueError, match="warmup_max_lr: 3 values for 2 param groups"):
        ours.WarmupLR(opt, warmup_max_lr=[0.1, 0.2, 0.3])
