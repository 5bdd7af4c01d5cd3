"""A seeded fuzz of the shipped configs: every value an extreme or a wrong type, one at a time.

Each mutation of ``configs/*.json`` must either load or be refused with a ``ValueError`` (``ConfigError`` is one)
whose message names the key changed; never another exception type (a traceback from inside). A mutation that
loads goes on through what reads the config next, cheaply: the LR schedule over a one-parameter optimizer for a
few steps (its rates at the first steps, the warm-up's end and the total must stay within optimizer.params.lr's
bounds: ``warmup_max_lr: 1e10`` used to load and end the run in NaN), and, for the model's and the MoE section's
sizes of the tiny configs, the model built on the meta device (``moe.ffn_hidden_size: 2**63`` used to load and
then fail there with torch's overflow traceback).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import random
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from angelptm.config import load_config
from angelptm.config.typed import MAX_LR
from angelptm.engine.schedulers import build_scheduler
from angelptm.pretraining.models import build_model

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.json"))
SEED = 20261203
SAMPLES_PER_CONFIG = 450
"""Mutations tried per shipped config, of some 900 (all of them take ~13 s here, this half ~7 s, on 2 cores)."""

EXTREMES: tuple[Any, ...] = (
    0, -1, 1, 0.5, 1e300, -1e300, 1e-300, 2**63, -(2**63), 2**31, math.nan, math.inf, -math.inf,
    "nan", "NaN", "inf", "-Infinity", "1e999", "", "x", "2", None, True, False, [], {}, [1, 2], {"x": 1},
)
"""Numbers at the edges of every range, nan-like strings, and values of every other JSON type."""

Path_ = tuple[Any, ...]


def leaves(node: Any, path: Path_ = ()) -> Iterator[Path_]:
    """Every value's path in a JSON tree (a list itself, and each of its items)."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from leaves(value, path + (key,))
        return
    yield path
    if isinstance(node, list):
        for i, value in enumerate(node):
            yield from leaves(value, path + (i,))


def mutated(config: dict, path: Path_, value: Any) -> dict:
    result = copy.deepcopy(config)
    node = result
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = copy.deepcopy(value)
    return result


def key_of(path: Path_) -> str:
    """The key a message must name: the innermost key of the path (``betas`` for ``betas[0]``)."""
    return next(str(part) for part in reversed(path) if isinstance(part, str))


def world_size_of(config: dict) -> int:
    autopipe = config.get("autopipe") or {}
    return autopipe.get("num_stages", 1) if autopipe.get("enabled") else 1


def mutations(path: Path) -> list[tuple[Path_, Any]]:
    config = json.loads(path.read_text())
    every = [(where, value) for where in leaves(config) for value in EXTREMES]
    return random.Random(f"{SEED}:{path.name}").sample(every, min(SAMPLES_PER_CONFIG, len(every)))


def use(cfg: Any, config_name: str, path: Path_) -> str | None:
    """What reads the config next, where it is cheap: the schedule, and the model's shapes (meta device).

    Returns:
        What is wrong with a config that loaded (a rate beyond the optimizer's bounds at some step), or None.
    """
    if cfg.scheduler is not None:
        param = torch.nn.Parameter(torch.zeros(1))
        optimizer = torch.optim.AdamW([param], lr=cfg.optimizer.lr if cfg.optimizer else 1e-3)
        schedule = build_scheduler(cfg.scheduler, optimizer)
        for _ in range(3):
            schedule.step()
        ends = [getattr(schedule, name, 0) for name in ("warmup_num_steps", "total_num_steps")]
        for step in (0, 1, 2, *ends):
            rates = [float(rate) for rate in schedule.lr_at(step)]
            if not all(0 <= rate <= MAX_LR for rate in rates):  # (NaN fails too)
                return f"loads, but the schedule's lr at step {step} is {rates}, outside [0, {MAX_LR:g}]"
    if config_name.startswith("tiny") and path[0] in ("model", "moe"):
        with torch.device("meta"):
            build_model(cfg.model, moe=cfg.moe)
    return None


@pytest.fixture(autouse=True)
def quiet():
    logging.disable(logging.WARNING)  # deprecation and "accepted, not acted on" lines, thousands of them
    yield
    logging.disable(logging.NOTSET)


@pytest.mark.parametrize("config_path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_mutation_loads_or_is_refused_naming_its_key(config_path):
    config = json.loads(config_path.read_text())
    world_size = world_size_of(config)
    load_config(config, world_size=world_size, device_type="cpu")  # the shipped config itself loads
    failures = []
    for path, value in mutations(config_path):
        where = ".".join(map(str, path))
        try:
            cfg = load_config(mutated(config, path, value), world_size=world_size, device_type="cpu")
            harm = use(cfg, config_path.stem, path)
            if harm:
                failures.append(f"{where} = {value!r}: {harm}")
        except ValueError as err:
            if key_of(path) not in str(err):
                failures.append(f"{where} = {value!r}: the message does not name {key_of(path)!r}: {err}")
        except Exception as err:  # noqa: BLE001 - the point: anything else is a traceback from inside
            failures.append(f"{where} = {value!r}: {type(err).__name__}: {str(err)[:300]}")
    assert not failures, f"seed {SEED}, {config_path.name}:\n" + "\n".join(failures[:20])
