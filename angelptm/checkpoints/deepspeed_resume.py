"""A DeepSpeed checkpoint resumed by this engine: ``load_checkpoint``'s branch for DeepSpeed's own layout.

:func:`load` puts what :mod:`angelptm.checkpoints.deepspeed_format` read into the engine as DeepSpeed's own
``load_checkpoint`` would into DeepSpeed's: the module's weights, the fp32 masters, with ``load_optimizer_states``
Adam's moments, steps and each group's hyperparameters (lr, betas, eps, weight_decay, as saved), the loss scale, the
lr scheduler and the counters; it returns the script's ``client_state``. The optimizer states are handed to the
engine's optimizer in the replicated engine's format, and through :func:`optimizer_format.adapt` to ZeRO-Cache's when
that is on: one conversion, by parameter name, for both. The checkpoint's data-parallel world size need not be this
run's (every rank reads the whole states; ZeRO-Cache takes the names each rank owns).

What DeepSpeed's checkpoints do not hold is not made up: there is no RNG state and no data position (DeepSpeed's
own resume starts its data loader from the first batch and draws on from its RNG as it stands; so does this one).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from angelptm.checkpoints import deepspeed_format, optimizer_format
from angelptm.checkpoints.deepspeed_format import DeepSpeedCheckpoint
from angelptm.checkpoints.deepspeed_partitions import IMPLEMENTATION_KEYS, MOMENTS
from angelptm.engine.optimizer_contract import EngineOptimizer
from zero_cache import OptimizerCheckpoint

logger = logging.getLogger("angelptm.engine.engine")


def load(engine: Any, path: Path, *, load_module_strict: bool, load_optimizer_states: bool,
         load_lr_scheduler_states: bool, load_module_only: bool) -> tuple[str, dict[str, Any]]:
    """Resume ``engine`` (an :class:`~angelptm.engine.engine.Engine`) from the DeepSpeed checkpoint at ``path``.

    Returns:
        ``(path, client_state)``: the keys the DeepSpeed script saved with ``save_checkpoint(client_state=...)``
        (DeepSpeed's ``load_checkpoint`` returns them mixed with its own entries; those are left out).

    Raises:
        CheckpointError: what cannot be read or mapped, naming DeepSpeed's format and what to do.
    """
    if engine.experts is not None:
        raise deepspeed_format.refuse(path, "this run spreads experts over ranks (moe.ep_size > 1), which a DeepSpeed "
                                            "checkpoint is not resumed into here")
    optimizer = engine.optimizer
    with_states = optimizer is not None and load_optimizer_states and not load_module_only
    saved = deepspeed_format.read(path, optimizer_states=with_states,
                                  optimizer_order=optimizer.names if optimizer is not None else None)
    if engine.ctx.is_main:
        ranks = saved.optimizer.world_size
        logger.info("%s: a DeepSpeed checkpoint (ZeRO stage %d, %d rank%s, step %d), read by parameter name%s", path,
                    saved.optimizer.stage, ranks, "s" if ranks > 1 else "", saved.global_steps,
                    " with its optimizer states" if with_states else "")
    engine._load_module_state(path, {"module": saved.module}, strict=load_module_strict, has_optimizer_file=True)
    if optimizer is not None:
        masters = _masters(saved, optimizer.names, path)
        state = _optimizer_state(saved, optimizer, masters, path) if with_states else {"masters": masters}
        optimizer.load_state_dict(state, load_optimizer_states=with_states)
    if load_module_only:
        return str(path), saved.client_state
    if load_lr_scheduler_states and engine.lr_scheduler is not None and saved.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(saved.lr_scheduler)
    engine.global_steps, engine.global_samples = saved.global_steps, saved.global_samples
    engine.skipped_steps = saved.skipped_steps
    engine.micro_steps = saved.global_steps * engine.gradient_accumulation_steps()  # saved at a boundary
    if engine.training_dataloader is not None and engine.ctx.is_main:
        logger.warning("%s holds no data position (DeepSpeed saves none): the data loader starts from its first "
                       "batch, as under DeepSpeed's own resume", path)
    return str(path), saved.client_state


def _masters(saved: DeepSpeedCheckpoint, names: list[str], path: Path) -> dict[str, torch.Tensor]:
    missing = [name for name in names if name not in saved.module]
    if missing:
        raise deepspeed_format.refuse(path, f"it holds no weights for {', '.join(missing[:3])}"
                                            f"{' ...' if len(missing) > 3 else ''} of this model's parameters",
                                      "Build the model as the DeepSpeed script did")
    return {name: saved.module[name] for name in names}


def _names_by_group(optimizer: EngineOptimizer) -> list[list[str]]:
    """The resuming optimizer's parameter names, group by group, in its (torch index) order."""
    if isinstance(optimizer, OptimizerCheckpoint):  # ZeRO-Cache: a (group index, slot) per parameter
        groups: list[list[str]] = [[] for _ in optimizer.param_groups]
        for index, slot in optimizer.members:
            groups[index].append(slot.name)
        return groups
    names = iter(optimizer.names)
    return [[next(names) for _ in group["params"]] for group in optimizer.optimizer.param_groups]


def _optimizer_state(saved: DeepSpeedCheckpoint, optimizer: EngineOptimizer, masters: dict[str, torch.Tensor],
                     path: Path) -> dict[str, Any]:
    """The replicated engine's optimizer ``state_dict()`` from DeepSpeed's states (converted for ZeRO-Cache)."""
    moments = saved.optimizer.moments or {}
    missing = [name for name in optimizer.names if not all(name in moments.get(field, {}) for field in MOMENTS)]
    if missing:
        raise deepspeed_format.refuse(path, f"it holds no Adam moments for {', '.join(missing[:3])}"
                                            f"{' ...' if len(missing) > 3 else ''} (frozen when it was saved?)",
                                      deepspeed_format.WEIGHTS_ALONE)
    state = {index: {"step": torch.tensor(saved.optimizer.steps.get(name, 0.0), dtype=torch.float32),
                     **{field: moments[field][name] for field in MOMENTS}}
             for index, name in enumerate(optimizer.names)}
    groups, first = [], 0
    for group, names in zip(optimizer.param_groups, _names_by_group(optimizer)):
        hypers = {k: v for k, v in group.items() if k != "params"}
        hypers.update(_saved_hypers(saved, names, hypers, path))
        groups.append({**hypers, "params": list(range(first, first + len(names)))})
        first += len(names)
    plain = {"optimizer": {"state": state, "param_groups": groups}, "masters": masters,
             "loss_scaler": _loss_scale(saved, optimizer.loss_scaler)}
    return optimizer_format.adapt(plain, optimizer, path)


def _saved_hypers(saved: DeepSpeedCheckpoint, names: list[str], current: dict[str, Any],
                  path: Path) -> dict[str, Any]:
    """The hyperparameters DeepSpeed saved for the parameters of one of this run's groups (one set for all)."""
    found = [saved.optimizer.hypers[name] for name in names if name in saved.optimizer.hypers]
    values = [{k: v for k, v in hypers.items() if k in current and k not in IMPLEMENTATION_KEYS} for hypers in found]
    if any(value != values[0] for value in values[1:]):
        differing = sorted({k for value in values for k in value if value[k] != values[0].get(k)})
        raise deepspeed_format.refuse(
            path, f"its optimizer kept parameters in other groups than this run's ({', '.join(differing)} differ "
                  f"within one group here, e.g. {names[0]}'s group)",
            f"Build the optimizer's parameter groups as the DeepSpeed script did. {deepspeed_format.WEIGHTS_ALONE}")
    return values[0] if values else {}


def _loss_scale(saved: DeepSpeedCheckpoint, scaler: Any) -> dict[str, Any] | None:
    """This run's loss-scaler state with DeepSpeed's values, when both scale the same way (fp16, dynamic or not)."""
    saved_scale = saved.optimizer.loss_scale
    if scaler is None or not saved_scale or bool(saved_scale.get("dynamic")) != scaler.dynamic:
        return None
    return {**scaler.state_dict(), **{k: v for k, v in saved_scale.items() if k in scaler.state_dict()}}
