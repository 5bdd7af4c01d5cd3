"""DeepSpeed's flat per-rank partitions merged back into whole tensors by parameter name (ZeRO stages 0-3).

Each function takes the files :mod:`angelptm.checkpoints.deepspeed_format` read (dicts as DeepSpeed 0.19.8 saves
them) and returns :class:`Partitions`: the fp32 masters and, when asked, Adam's moments, steps and group
hyperparameters, each by ``named_parameters`` name. A file that does not follow that layout raises
:class:`LayoutError` saying where; the caller names the checkpoint and what to do.

Field legend: ``fp32`` the master weights, ``exp_avg`` / ``exp_avg_sq`` Adam's moments; W the data-parallel ranks
that saved the checkpoint.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

logger = logging.getLogger(__name__)

MOMENTS = ("exp_avg", "exp_avg_sq")
IMPLEMENTATION_KEYS = frozenset({"params", "foreach", "fused", "capturable", "differentiable"})
"""Keys of a torch param group that choose an implementation, not a value: the resuming run keeps its own."""
_LOSS_SCALE_KEYS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis", "dynamic")


class LayoutError(Exception):
    """What in the files cannot be put together, or does not fit the resuming optimizer; the message says what.

    ``weights_load``: the weights would still load (``load_optimizer_states=False``); False for damaged files."""

    def __init__(self, message: str, *, weights_load: bool = True) -> None:
        super().__init__(message)
        self.weights_load = weights_load


DAMAGED = "which is not what DeepSpeed 0.19.8 writes (a damaged file, or another version's layout)"


@dataclass(kw_only=True, slots=True)
class Partitions:
    """The optimizer's side of a DeepSpeed checkpoint, whole, by parameter name."""

    stage: int
    world_size: int
    """Data-parallel ranks that saved it."""
    masters: dict[str, torch.Tensor]
    """The fp32 master weight of each parameter the optimizer held."""
    frozen: dict[str, torch.Tensor]
    """Whole frozen parameters (ZeRO-3 saves each rank's fragment of them)."""
    moments: dict[str, dict[str, torch.Tensor]] | None
    """``exp_avg`` / ``exp_avg_sq`` -> name -> tensor of the parameter's shape; None when not read."""
    steps: dict[str, float]
    """Adam's step count of each parameter."""
    hypers: dict[str, dict[str, Any]]
    """Each parameter's group hyperparameters (lr, betas, eps, weight_decay, ...) as saved."""
    loss_scale: dict[str, Any] | None


def _fields(obj: Any) -> dict[str, Any]:
    return getattr(obj, "fields", obj) if obj is not None else {}


def _hypers(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k not in IMPLEMENTATION_KEYS}


def _moments_of(state: dict[str, Any] | None, where: str) -> dict[str, torch.Tensor]:
    if not state or not all(m in state for m in MOMENTS):
        raise LayoutError(f"{where} holds no Adam moments (exp_avg, exp_avg_sq): the optimizer was not Adam, or its "
                          "states were not saved")
    return {m: state[m] for m in MOMENTS}


def _step(state: dict[str, Any] | None, fallback: Any = None) -> float:
    step = (state or {}).get("step", fallback)
    return float(step) if step is not None else 0.0


def _loss_scale(saved: dict[str, Any]) -> dict[str, Any] | None:
    scaler = {**_fields(saved.get("loss_scaler")), **{k: saved[k] for k in _LOSS_SCALE_KEYS if k in saved}}
    if "dynamic" not in scaler and "dynamic_loss_scale" in saved:  # DeepSpeed's fp16 optimizers' name for it
        scaler["dynamic"] = saved["dynamic_loss_scale"]
    return {k: scaler[k] for k in _LOSS_SCALE_KEYS if k in scaler} or None


def _whole(pieces: dict[str, list[torch.Tensor]], shapes: dict[str, torch.Size], where: str
           ) -> dict[str, torch.Tensor]:
    out = {}
    for name, shape in shapes.items():
        if name not in pieces:
            raise LayoutError(f"{where} hold no fragment of {name}, {DAMAGED}", weights_load=False)
        flat = torch.cat(pieces[name]) if len(pieces[name]) > 1 else pieces[name][0]
        if flat.numel() != math.prod(shape):
            raise LayoutError(f"the fragments of {name} in {where} hold {flat.numel()} elements and its shape "
                              f"{tuple(shape)} {math.prod(shape)}, {DAMAGED}", weights_load=False)
        out[name] = flat.view(shape).clone()
    return out


def merge_zero12(model_states: dict[str, Any], ranks: Sequence[dict[str, Any]], *,
                 optimizer_states: bool) -> Partitions:
    """ZeRO stages 1 and 2 (and DeepSpeed's bf16 optimizer): each rank's ``param_slice_mappings`` names the
    (start, numel) of each parameter's fragment in that rank's flat partition of its group; the fragments in rank
    order are the parameter (``ds_to_universal.py``'s ``extract_zero_shards`` and ``_merge_zero_shards``)."""
    fields = ("fp32", *MOMENTS) if optimizer_states else ("fp32",)
    pieces: dict[str, dict[str, list[torch.Tensor]]] = {field: {} for field in fields}
    steps: dict[str, float] = {}
    hypers: dict[str, dict[str, Any]] = {}
    for rank, saved in enumerate(ranks):
        base = saved["base_optimizer_state"]
        for group, mapping in enumerate(saved["param_slice_mappings"]):
            flats = {"fp32": saved["single_partition_of_fp32_groups"][group]}
            if optimizer_states:
                if isinstance(base, list):  # elastic_checkpoint: each group's state without padding, no hypers
                    state, group_hypers = base[group], {}
                    step = _step(state, saved.get("base_optimizer_state_step"))
                else:
                    state, group_hypers = base["state"].get(group), _hypers(base["param_groups"][group])
                    step = _step(state)
                flats.update(_moments_of(state, f"rank {rank}'s optimizer file, group {group},"))
            for name, address in mapping.items():
                start, numel = _fields(address)["start"], _fields(address)["numel"]
                for field, flat in flats.items():
                    pieces[field].setdefault(name, []).append(flat.narrow(0, start, numel))
                if optimizer_states:
                    steps[name], hypers[name] = step, group_hypers
    shapes = {name: shape for group in model_states["param_shapes"] for name, shape in group.items()}
    whole = {field: _whole(pieces[field], shapes, "the optimizer files") for field in fields}
    frozen = dict(model_states.get("frozen_param_fragments") or {})  # whole at stages 1-2
    return Partitions(stage=int(ranks[0]["zero_stage"]), world_size=len(ranks), masters=whole.pop("fp32"),
                      frozen=frozen, moments=whole if optimizer_states else None, steps=steps, hypers=hypers,
                      loss_scale=_loss_scale(ranks[0]))


def merge_zero3(model_states: Sequence[dict[str, Any]], ranks: Sequence[dict[str, Any]], *,
                optimizer_states: bool) -> Partitions:
    """ZeRO stage 3: for each sub-group, in ``param_shapes`` order, every parameter is W parts of ceil(numel / W)
    elements, part r in rank r's flat partition, the last padded (``zero_to_fp32.py``'s
    ``_zero3_merge_trainable_params``). Frozen parameters are cut the same way, one fragment per rank's model file."""
    world_size = len(ranks)
    fields = ("fp32", *MOMENTS) if optimizer_states else ("fp32",)
    whole: dict[str, dict[str, torch.Tensor]] = {field: {} for field in fields}
    steps: dict[str, float] = {}
    hypers: dict[str, dict[str, Any]] = {}
    for group, shapes in enumerate(model_states[0]["param_shapes"]):
        flats = []
        for rank, saved in enumerate(ranks):
            flat = {"fp32": saved["fp32_flat_groups"][group]}
            if optimizer_states:
                torch_state = saved["optimizer_state_dict"]
                state = torch_state["state"].get(group)
                flat.update(_moments_of(state, f"rank {rank}'s optimizer file, sub-group {group},"))
                step, group_hypers = _step(state), _hypers(torch_state["param_groups"][group])
            flats.append(flat)
        offset = 0
        for name, shape in shapes.items():
            numel = math.prod(shape)
            part = math.ceil(numel / world_size)
            for field in fields:
                parts = [flat[field].narrow(0, offset, part) for flat in flats]
                whole[field][name] = torch.cat(parts)[:numel].view(shape).clone()
            if optimizer_states:
                steps[name], hypers[name] = step, group_hypers
            offset += part
        if any(flat["fp32"].numel() != offset for flat in flats):
            raise LayoutError(f"sub-group {group}'s partitions hold {[f['fp32'].numel() for f in flats]} elements "
                              f"where its parameters' parts make {offset}, {DAMAGED}", weights_load=False)
    frozen = {}
    for name, shape in (model_states[0].get("frozen_param_shapes") or {}).items():
        fragments = [saved["frozen_param_fragments"][name] for saved in model_states]
        frozen[name] = torch.cat(fragments)[:math.prod(shape)].view(shape).clone()
    return Partitions(stage=3, world_size=world_size, masters=whole.pop("fp32"), frozen=frozen,
                      moments=whole if optimizer_states else None, steps=steps, hypers=hypers,
                      loss_scale=_loss_scale(ranks[0]))


def merge_stage0(model_states: dict[str, Any], *, optimizer_states: bool,
                 optimizer_order: Sequence[str] | None) -> Partitions:
    """ZeRO stage 0: the module holds whole weights; the optimizer's ``state_dict()`` holds its states by position.

    Position i is the i-th parameter the script gave the optimizer, named by ``optimizer_order`` (the resuming
    run's optimizer, built by the same script). The optimizer is torch's (fp32: the module's weights are the
    masters) or DeepSpeed's unfused bf16/fp16 wrapper (``fp32_groups``: a master per parameter). DeepSpeed's fused
    fp16 wrapper (``fp32_groups_flat``, a flat master per group) is not read: only the module's fp16 weights are. So is
    every stage-0 checkpoint without ``optimizer_order`` (an export): the module's weights, in the dtype it computed in.
    """
    buffers = set(model_states.get("buffer_names") or ())
    world_size = int(model_states.get("dp_world_size", 1))
    weights = {k: v for k, v in model_states["module"].items() if k not in buffers}
    saved = model_states.get("optimizer")
    fused = saved is not None and "fp32_groups_flat" in saved
    if optimizer_states and (saved is None or fused):
        raise LayoutError("its model states hold no optimizer states" if saved is None else
                          "its optimizer is DeepSpeed's fused fp16 one (fp16 at ZeRO stage 0, a flat master per "
                          "group), whose states this engine does not read")
    module_weights = Partitions(stage=0, world_size=world_size, masters={k: v.float() for k, v in weights.items()},
                                frozen={}, moments=None, steps={}, hypers={}, loss_scale=None)
    if saved is None or fused or optimizer_order is None or ("fp32_groups" not in saved and not optimizer_states):
        return module_weights  # (with torch's optimizer, fp32, the module's weights are the masters)
    try:
        return _positional(saved, weights, world_size, optimizer_states=optimizer_states,
                           optimizer_order=optimizer_order)
    except LayoutError as err:
        if optimizer_states:
            raise
        logger.warning("the fp32 masters of a ZeRO stage 0 checkpoint are kept by position and do not fit this run's "
                       "optimizer (%s): its weights are taken from the module (in the dtype it computed in)", err)
        return module_weights


def _positional(saved: dict[str, Any], weights: dict[str, torch.Tensor], world_size: int, *, optimizer_states: bool,
                optimizer_order: Sequence[str]) -> Partitions:
    """Stage 0's optimizer states, position i named by ``optimizer_order[i]``."""
    torch_state = saved if "param_groups" in saved else saved["optimizer_state_dict"]
    groups = torch_state["param_groups"]
    indices = [i for group in groups for i in group["params"]]  # torch's state keys, in position order
    if len(indices) != len(optimizer_order):
        raise LayoutError(f"its optimizer holds {len(indices)} parameters by position, and this run's optimizer "
                          f"{len(optimizer_order)}")
    fp32 = [t for group in saved["fp32_groups"] for t in group] if "fp32_groups" in saved else None
    masters, moments, steps, hypers = {}, {m: {} for m in MOMENTS}, {}, {}
    position_group = [group for group in groups for _ in group["params"]]
    for position, name in enumerate(optimizer_order):
        if name not in weights:
            raise LayoutError(f"its module has no parameter {name}, which this run's optimizer holds")
        masters[name] = (fp32[position] if fp32 is not None else weights[name]).float()
        if masters[name].shape != weights[name].shape:
            raise LayoutError(f"position {position} of its optimizer holds a tensor of shape "
                              f"{tuple(masters[name].shape)}, and {name} has {tuple(weights[name].shape)}: the "
                              "script gave the optimizer its parameters in another order")
        hypers[name] = _hypers(position_group[position])
        if optimizer_states:
            state = torch_state["state"].get(indices[position])
            for field, value in _moments_of(state, f"its optimizer's position {position} ({name})").items():
                moments[field][name] = value
            steps[name] = _step(state)
    loss_scale = _loss_scale(saved) if fp32 is not None else None
    return Partitions(stage=0, world_size=world_size, masters=masters, frozen={},
                      moments=moments if optimizer_states else None, steps=steps, hypers=hypers, loss_scale=loss_scale)
