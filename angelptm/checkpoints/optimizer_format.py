"""Optimizer states across the two formats: a ZeRO-Cache checkpoint resumed with ZeRO-Cache off, and the reverse.

The replicated engine's :class:`~angelptm.engine.mixed_precision.MixedPrecisionOptimizer` saves torch's Adam state
(``{"state": {index: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [... "params": [index, ...]]}``); ZeRO-Cache's
optimizer (:mod:`zero_cache.optim.optimizer_state`) saves one ``step`` and the moments by parameter name, flat. Both
save the fp32 masters by parameter name, in the optimizer's parameter order, which is torch's index order. So the
moments map 1:1 and the conversion is exact: the same numbers, reshaped. What cannot map exactly (parameters
without moments, unequal per-parameter steps, other parameter groups) is refused by name, with how to go on.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from angelptm.errors import CheckpointError
from zero_cache import OptimizerCheckpoint

logger = logging.getLogger("angelptm.engine.engine")

MOMENTS = ("exp_avg", "exp_avg_sq")
FRESH_START = ("or take the weights only and start the optimizer afresh: load_checkpoint(..., "
               "load_optimizer_states=False) (pretrain.py: start a new --save-dir from the exported weights)")


def is_zero_cache_format(optimizer_state: dict[str, Any]) -> bool:
    """Whether ``state_dict()["optimizer"]`` was written by ZeRO-Cache (one step, moments by name)."""
    return "state" not in optimizer_state and "step" in optimizer_state


def adapt(saved: dict[str, Any], optimizer: Any, path: Any) -> dict[str, Any]:
    """``saved`` (an optimizer ``state_dict()``) in the format ``optimizer`` loads, converted if it is the other one.

    Raises:
        CheckpointError: the states cannot be converted exactly; the message names why and what to do.
    """
    saved_zero_cache = is_zero_cache_format(saved["optimizer"])
    running_zero_cache = isinstance(optimizer, OptimizerCheckpoint)
    if saved_zero_cache == running_zero_cache:
        return saved
    logger.info("%s: optimizer states saved with zero_cache.enabled %s, resumed with it %s: converted by parameter "
                "name (exact)", path, str(saved_zero_cache).lower(), str(running_zero_cache).lower())
    if running_zero_cache:
        return to_zero_cache(saved, path)
    return to_plain(saved, path, names=optimizer.names, param_groups=optimizer.optimizer.state_dict()["param_groups"])


def to_zero_cache(saved: dict[str, Any], path: Any) -> dict[str, Any]:
    """The replicated engine's optimizer ``state_dict()`` as ZeRO-Cache's (moments by name, flat; one step)."""
    masters, torch_state = saved["masters"], saved["optimizer"]
    names = list(masters)  # the saved optimizer's order, which is torch's index order
    groups = torch_state["param_groups"]
    indexed = sum(len(group["params"]) for group in groups)
    if indexed != len(names):
        _refuse(path, f"its optimizer indexes {indexed} parameters but holds {len(names)} masters")
    states = torch_state["state"]
    missing = [name for i, name in enumerate(names) if states and not all(k in states.get(i, {}) for k in MOMENTS)]
    if missing:
        _refuse(path, f"it holds no Adam state for {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
    steps = sorted({int(states[i]["step"]) for i in range(len(names))}) if states else [0]
    if len(steps) > 1:
        _refuse(path, f"its parameters were updated different numbers of times (steps {steps[:5]}), where "
                      "ZeRO-Cache keeps one step for all")
    moments = {field: {name: (states[i][field] if states else torch.zeros_like(masters[name])).reshape(-1)
                       for i, name in enumerate(names)} for field in MOMENTS}
    hypers = [{k: v for k, v in group.items() if k != "params"} for group in groups]
    return {"optimizer": {"step": steps[0], "param_groups": hypers, **moments}, "masters": masters,
            "loss_scaler": saved.get("loss_scaler")}


def to_plain(saved: dict[str, Any], path: Any, *, names: list[str],
             param_groups: list[dict[str, Any]]) -> dict[str, Any]:
    """ZeRO-Cache's optimizer ``state_dict()`` as the replicated engine's, for an optimizer whose parameters are
    ``names`` in torch's index order and whose torch ``param_groups`` (with index lists) are ``param_groups``."""
    masters, zc_state = saved["masters"], saved["optimizer"]
    if len(zc_state["param_groups"]) != len(param_groups):
        _refuse(path, f"it holds {len(zc_state['param_groups'])} parameter groups and this run has {len(param_groups)}")
    missing = [name for name in names if not all(name in zc_state[field] for field in MOMENTS)]
    if missing:
        _refuse(path, f"it holds no Adam state for {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
    step = torch.tensor(float(zc_state["step"]))
    state = {i: {"step": step.clone(), **{field: zc_state[field][name].reshape(masters[name].shape)
                                          for field in MOMENTS}} for i, name in enumerate(names)}
    groups = [{**group, **{k: v for k, v in hyper.items() if k in group and k != "params"}}
              for group, hyper in zip(param_groups, zc_state["param_groups"])]
    return {"optimizer": {"state": state, "param_groups": groups}, "masters": masters,
            "loss_scaler": saved.get("loss_scaler")}


def _refuse(path: Any, why: str) -> None:
    raise CheckpointError(f"{path}: its optimizer states cannot be converted to the other ZeRO-Cache setting exactly: "
                          f"{why}. Resume with zero_cache.enabled as it was saved, {FRESH_START}")
