"""Load a DeepSpeed JSON config (path or dict) into the typed :class:`EngineConfig`.

The edge is strict on purpose: a typo such as ``"gradient_acumulation_steps"`` must stop the run
with a message naming the key and the closest valid one, not silently train with defaults.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import os
import types
import typing
from pathlib import Path
from typing import Any

import pydantic
import torch

from angelptm.config import edge, precision, precision_modes, typed
from angelptm.errors import ArgumentTypeError, ConfigError
from zero_cache import ZeroCacheConfig

logger = logging.getLogger(__name__)


def load_config(config: str | os.PathLike | dict | None, *, world_size: int = 1,
                device_type: str | None = None) -> typed.EngineConfig:
    """Parse a DeepSpeed-style config into the typed tree.

    Args:
        config: a path to a JSON file, or the already-loaded dict.
        world_size: data-parallel ranks, needed to resolve the batch-size triple.
        device_type: "cuda" or "cpu", the device the run computes on, which settles a precision the
            config leaves open (:mod:`angelptm.config.precision`); default: CUDA where available, as
            ``init_distributed`` picks.

    Returns:
        The typed config.

    Raises:
        ConfigError: unreadable file, unknown key, wrong type or inconsistent values; the message
            lists every problem found, each with its key path.
    """
    raw = read_config_source(config)
    try:
        for warning in edge.upgrade_deprecated_keys(raw):
            logger.warning("%s", warning)
        edge.rewrite_field_names(raw)
    except ValueError as err:
        raise ConfigError(f"invalid config:\n  {err}") from None
    problems = _unknown_key_problems(raw, edge.EdgeConfig, "") or edge.type_problems(raw)
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))
    ignored = {key: raw.pop(key) for key in list(raw) if key in edge.ACCEPTED_NOT_ACTED}
    try:
        parsed = edge.EdgeConfig.model_validate(raw)
        problems = _unsupported_values(parsed, ignored)
        if problems:
            raise ConfigError("invalid config:\n  " + "\n  ".join(problems))
        scheduler = _scheduler(parsed.scheduler)
        if device_type is None:
            device_type = "cuda" if torch.cuda.is_available() else "cpu"
        return _to_typed(parsed, scheduler, tuple(sorted(ignored)) + _not_acted_sections(parsed, raw), world_size,
                         device_type)
    except pydantic.ValidationError as err:
        raise ConfigError("invalid config:\n  " + "\n  ".join(_describe(err, raw))) from None
    except ConfigError:
        raise
    except ValueError as err:  # a typed dataclass's __post_init__ check
        raise ConfigError(f"invalid config:\n  {err}") from None


def _unsupported_values(parsed: edge.EdgeConfig, ignored: dict[str, Any]) -> list[str]:
    """DeepSpeed keys this engine reads but whose value asks for what it does not do, each with what to do instead
    (``ignored``: the raw sections accepted without acting on them, some of which ask for more ranks)."""
    problems = precision_modes.low_precision_problems(parsed, _zero_cache_on(parsed))
    problems += precision_modes.autocast_problems(parsed)
    for problem in (precision_modes.fp32_optimizer_states_problem(parsed), precision_modes.state_dtype_problem(parsed)):
        if problem:
            problems.append(problem)
    if not parsed.managed_gradient_accumulation:
        problems.append("managed_gradient_accumulation: false (every step() applies an update, the script owning the "
                        "accumulation boundary) is not supported: the engine steps at gradient_accumulation_steps "
                        "boundaries; remove the key, with gradient_accumulation_steps 1 to update at every step()")
    if parsed.gradient_allreduce_op != "mean":
        problems.append(f"gradient_allreduce_op: {parsed.gradient_allreduce_op!r} is not supported: gradients are "
                        "averaged over the data-parallel ranks; remove the key (\"mean\" is DeepSpeed's default)")
    if parsed.sequence_parallel_size != 1:
        problems.append(f"sequence_parallel_size: {parsed.sequence_parallel_size}: sequence parallelism is not "
                        "supported (each rank takes whole sequences); remove the key or set it to 1")
    tensor_parallel = ignored.get("tensor_parallel") if isinstance(ignored.get("tensor_parallel"), dict) else {}
    sizes = {"tensor_parallel.autotp_size": tensor_parallel.get("autotp_size"),
             "tensor_parallel.tp.tp_size": (tensor_parallel.get("tp") or tensor_parallel.get("tensor_parallel")
                                            or {}).get("tp_size")}
    for key, size in sizes.items():
        if isinstance(size, (int, float)) and not isinstance(size, bool) and size > 1:
            problems.append(f"{key}: {size}: tensor parallelism is not supported (each rank holds whole layers; "
                            "ZeRO-Cache spreads their states over GPU, host and NVMe); remove the tensor_parallel "
                            "section")
    expert_parallel = ignored.get("expert_parallel")
    if isinstance(expert_parallel, dict) and expert_parallel.get("enabled") is True:
        problems.append("expert_parallel.enabled: true (DeepSpeed's AutoEP) is not supported: experts spread over "
                        "ranks through deepspeed.moe.layer.MoE's ep_size (or the moe section's ep_size for the "
                        "reference GPT); remove the section")
    return problems


def read_config_source(config: str | os.PathLike | dict | None) -> dict:
    """The raw JSON object of a config given as a path or a dict (a deep copy), before any checking.

    Raises:
        ConfigError: missing file, invalid JSON (with line and column), or not a JSON object.
        ArgumentTypeError: ``config`` is neither a path nor a dict.
    """
    if config is None:
        raise ConfigError("no config given: pass config=PATH_OR_DICT (a DeepSpeed JSON config)")
    if not isinstance(config, (str, os.PathLike, dict)):
        raise ArgumentTypeError(f"config: got {type(config).__name__} ({str(config)[:60]!r}); pass a path to a "
                                "DeepSpeed JSON config (str or os.PathLike) or a dict of it")
    if isinstance(config, dict):
        try:
            return json.loads(json.dumps(config))  # deep copy, and proves it is JSON-shaped
        except (TypeError, ValueError) as err:
            raise ConfigError(
                f"the config dict must hold only JSON values (numbers, strings, lists, dicts): {err}"
            ) from None
    path = Path(config)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        loaded = parse_config_text(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON at line {err.lineno}, column {err.colno}: {err.msg} (nor "
                          "hjson)") from None
    except ValueError as err:  # a key given twice
        raise ConfigError(f"{path}: {err}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: the top level must be a JSON object, got {type(loaded).__name__}")
    return loaded


def parse_config_text(text: str) -> Any:
    """A config file's text as DeepSpeed reads it: JSON, else hjson (comments, unquoted keys, trailing commas).

    Raises:
        json.JSONDecodeError: neither parses (the JSON error, which names line and column).
        ValueError: a key given twice in one object (DeepSpeed refuses that too; JSON would keep the last).
    """
    try:
        return json.loads(text, object_pairs_hook=refuse_duplicate_keys)
    except json.JSONDecodeError as json_error:
        try:
            import hjson
        except ImportError:  # hjson comes with deepspeed; without it only JSON is read
            raise json_error from None
        try:
            return hjson.loads(text, object_pairs_hook=refuse_duplicate_keys)
        except hjson.HjsonDecodeError:
            raise json_error from None


def refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` for the JSON and hjson readers: a dict, or ValueError naming a key given twice."""
    result = dict(pairs)
    if len(result) != len(pairs):
        keys = [key for key, _ in pairs]
        raise ValueError(f"duplicate keys in the config: {sorted({key for key in keys if keys.count(key) > 1})}")
    return result


def _allowed_keys(schema: type) -> dict[str, Any]:
    """Key name (and alias) -> annotation, for a pydantic model or a dataclass."""
    if isinstance(schema, type) and issubclass(schema, pydantic.BaseModel):
        keys = {}
        for name, info in schema.model_fields.items():
            keys[name] = info.annotation
            if info.alias:
                keys[info.alias] = info.annotation
        return keys
    return {f.name: f.type for f in dataclasses.fields(schema)}


def _nested_schema(annotation: Any) -> type | None:
    """The model/dataclass inside ``X``, ``X | None`` or ``Optional[X]``, if any."""
    if isinstance(annotation, str):
        return None
    is_union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    candidates = typing.get_args(annotation) if is_union else (annotation,)
    for candidate in candidates:
        if isinstance(candidate, type) and (issubclass(candidate, pydantic.BaseModel)
                                            or dataclasses.is_dataclass(candidate)):
            return candidate
    return None


def _unknown_key_problems(data: Any, schema: type, prefix: str) -> list[str]:
    if not isinstance(data, dict):
        return []  # a type error, reported by pydantic
    allowed = _allowed_keys(schema)
    extra_allowed = edge.ACCEPTED_NOT_ACTED if schema is edge.EdgeConfig else ()
    problems = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key in allowed:
            nested = _nested_schema(allowed[key])
            if nested is not None:
                problems += _unknown_key_problems(value, nested, f"{path}.")
        elif path in edge.RETIRED_KEYS:
            problems.append(f"{path}: {edge.RETIRED_KEYS[path]}")
        elif path in edge.REFUSED_KEYS:
            problems.append(f"{path}: {edge.REFUSED_KEYS[path]}")
        elif key not in extra_allowed:
            problems.append(_unknown_key_message(path, key, list(allowed) + list(extra_allowed)))
    return problems


def _unknown_key_message(path: str, key: str, allowed: list[str]) -> str:
    close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys here: {', '.join(sorted(allowed))}"
    return f"{path}: unknown key{hint}"


def _value_at(data: Any, loc: tuple) -> Any:
    for part in loc:
        try:
            data = data[part]
        except (KeyError, IndexError, TypeError):
            return "?"
    return data


def _describe(err: pydantic.ValidationError, err_input: Any = None) -> list[str]:
    lines = []
    for item in err.errors():
        path = ".".join(str(part) for part in item["loc"]) or "(top level)"
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "value_error":
            lines.append(message)  # our own __post_init__ messages already name the key
        elif item["type"] == "missing" and isinstance(item["loc"][-1], int):  # a too-short list
            parent = ".".join(str(part) for part in item["loc"][:-1])
            lines.append(f"{parent}: expected more items; got {_value_at(err_input, item['loc'][:-1])!r}")
        elif item["type"] == "missing":
            lines.append(f"{path}: required key is missing")
        else:
            lines.append(f"{path}: {message} (got {item['input']!r}){_ALLOWED.get(path, '')}")
    return lines


_ALLOWED = {"scheduler.type": f"; use one of {', '.join(edge.SCHEDULER_PARAMS)}",
            "optimizer.type": f"; use one of {', '.join(edge.OPTIMIZER_TYPES)}"}
"""What a key whose value has the wrong type allows, where pydantic's message names only the type."""


def _scheduler(section: edge.SchedulerSection | None) -> typed.SchedulerConfig | None:
    if section is None:
        return None
    params_model = edge.SCHEDULER_PARAMS.get(section.type)
    if params_model is None:
        raise ConfigError(
            f"scheduler.type: {section.type!r} is not supported; use one of {', '.join(edge.SCHEDULER_PARAMS)}"
        )
    problems = _unknown_key_problems(section.params, params_model, "scheduler.params.")
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))
    try:
        params = params_model.model_validate(section.params)
    except pydantic.ValidationError as err:
        lines = [f"scheduler.params.{line}" for line in _describe(err, section.params)]
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines)) from None
    if getattr(params, "warmup_num_steps", 1) <= 0:  # (OneCycle and LRRangeTest have no warm-up)
        raise ConfigError(
            f"scheduler.params.warmup_num_steps: must be a positive integer, got {params.warmup_num_steps}"
        )
    _check_schedule(params)
    return typed.SchedulerConfig(type=section.type, params=params.model_dump())


SCHEDULE_RATES = ("warmup_min_lr", "warmup_max_lr", "cycle_min_lr", "cycle_max_lr", "lr_range_test_min_lr")
"""Scheduler keys that are learning rates: bounded as ``optimizer.params.lr`` is (:data:`typed.MAX_LR`)."""
SCHEDULE_RATIOS = {"warmup_min_ratio": "the warm-up's first rate as a fraction of the optimizer's lr",
                   "cos_min_ratio": "the cosine's last rate as a fraction of the optimizer's lr"}
"""WarmupCosineLR's keys that scale the optimizer's lr: fractions, in [0, 1]."""
SCHEDULE_MOMENTA = ("cycle_min_mom", "cycle_max_mom")
"""OneCycle's momentum bounds: Adam's beta1, in [0, 1) as ``optimizer.params.betas``."""


def _check_schedule(params: Any) -> None:
    """Rates below zero (gradient ascent) or above the optimizer's bound, ratios outside [0, 1], momenta outside
    [0, 1), and a decay that ends before its warm-up does."""
    for key in (*SCHEDULE_RATES, *SCHEDULE_RATIOS):
        value = getattr(params, key, None)
        values = [v for v in (value if isinstance(value, list) else [value]) if v is not None]
        if any(v < 0 for v in values):
            raise ConfigError(f"scheduler.params.{key}: must be >= 0 (a negative learning rate climbs the loss), "
                              f"got {value}")
        if key in SCHEDULE_RATES and any(v > typed.MAX_LR for v in values):
            raise ConfigError(f"scheduler.params.{key}: {value!r} is above {typed.MAX_LR:g}, the bound of "
                              f"optimizer.params.lr (Adam moves each weight by about the lr: the first step at this "
                              "rate wrecks the weights); lower it (typical peak rates are 1e-5 to 1e-2)")
        if key in SCHEDULE_RATIOS and any(v > 1 for v in values):
            raise ConfigError(f"scheduler.params.{key}: {value!r} is outside [0, 1]: it is {SCHEDULE_RATIOS[key]}; "
                              "use e.g. 0.1")
    if getattr(params, "cycle_momentum", False):
        for key in SCHEDULE_MOMENTA:
            value = getattr(params, key)
            if any(not 0 <= v < 1 for v in (value if isinstance(value, list) else [value])):
                raise ConfigError(f"scheduler.params.{key}: {value!r} is outside [0, 1): it is Adam's beta1 "
                                  "(optimizer.params.betas[0]); use e.g. 0.85 and 0.95, or set cycle_momentum false")
    total, warmup = getattr(params, "total_num_steps", None), getattr(params, "warmup_num_steps", 0)
    if total is not None and total < max(1, warmup):
        raise ConfigError(f"scheduler.params.total_num_steps: must be >= warmup_num_steps ({warmup}) and >= 1, "
                          f"got {total}; set it to the run's steps (train.steps) or lower warmup_num_steps")


def resolve_batch_sizes(
    train_batch_size: int | None, micro_batch_size: int | None, accumulation_steps: int | None, world_size: int
) -> typed.BatchConfig:
    """Fill in the missing member of (train_batch_size, micro batch, accumulation) like DeepSpeed.

    Any two determine the third through train = micro * accumulation * world_size; all three must
    agree; train alone means accumulation 1; micro alone means accumulation 1.

    Raises:
        ConfigError: inconsistent or non-divisible values, with the arithmetic shown.
    """
    for name, value in (("train_batch_size", train_batch_size), ("train_micro_batch_size_per_gpu", micro_batch_size),
                        ("gradient_accumulation_steps", accumulation_steps)):
        if value is not None and value < 1:
            raise ConfigError(f"{name}: must be >= 1, got {value}")
    train, micro, accum, world = train_batch_size, micro_batch_size, accumulation_steps, world_size
    if train is None and micro is None:
        raise ConfigError("set train_batch_size or train_micro_batch_size_per_gpu (or both)")
    if micro is None:
        accum = accum or 1
        micro = _exact_div(train, accum * world, f"train_batch_size {train} / (gradient_accumulation_steps {accum} "
                           f"* world_size {world})", "train_micro_batch_size_per_gpu")
    elif train is None:
        accum = accum or 1
        train = micro * accum * world
    elif accum is None:
        accum = _exact_div(train, micro * world, f"train_batch_size {train} / (train_micro_batch_size_per_gpu {micro} "
                           f"* world_size {world})", "gradient_accumulation_steps")
    if micro * accum * world != train:
        raise ConfigError(
            f"inconsistent batch sizes: train_batch_size {train} != train_micro_batch_size_per_gpu {micro} "
            f"* gradient_accumulation_steps {accum} * world_size {world} = {micro * accum * world}"
        )
    return typed.BatchConfig(train_batch_size=train, micro_batch_size=micro, gradient_accumulation_steps=accum,
                             world_size=world)


def _exact_div(numerator: int, denominator: int, arithmetic: str, derived: str) -> int:
    if numerator % denominator:
        raise ConfigError(f"cannot derive {derived}: {arithmetic} = {numerator / denominator:g} is not a whole number")
    return numerator // denominator


def _uses_nvme(parsed: edge.EdgeConfig) -> bool:
    """Whether the config puts ZeRO-Cache states on NVMe (our nvme_path, or a DeepSpeed nvme offload)."""
    zero = parsed.zero_optimization
    offloads = [offload for offload in (zero.offload_param, zero.offload_optimizer) if offload is not None]
    return bool(parsed.zero_cache.nvme_path) or any(offload.device == "nvme" for offload in offloads)


def _not_acted_sections(parsed: edge.EdgeConfig, raw: dict) -> tuple[str, ...]:
    """Validated keys that are stored but change nothing here: the keys written (``model_fields_set``; ``raw`` for
    the sections read by name below), judged by their validated values (``"stage": "3"`` is stage 3)."""
    # (zenflow, a permission, and the 16-bit gather, done at either value, are reported on their own by
    # angelptm.engine.builders.report_config)
    acted = {"stage", "reduce_bucket_size", "offload_param", "offload_optimizer", "zenflow",
             "stage3_gather_16bit_weights_on_model_save"}
    zero = parsed.zero_optimization
    offloads = {name: getattr(zero, name) for name in ("offload_param", "offload_optimizer")
                if getattr(zero, name) is not None}
    offloaded = any(offload.device != "none" for offload in offloads.values())
    if parsed.zero_cache.enabled or (zero.stage == 3 and offloaded):
        acted |= {"overlap_comm", "stage3_prefetch_bucket_size", "stage3_max_live_parameters"}  # sharded ZeRO-Cache
    keys = tuple(f"zero_optimization.{key}" for key in sorted(zero.model_fields_set) if key not in acted)
    for section, offload in offloads.items():  # ZeRO-Cache sizes its own buffers and pins its tiers
        keys += tuple(f"zero_optimization.{section}.{key}" for key in sorted(offload.model_fields_set)
                      if key not in ("device", "nvme_path") and not (key == "super_offload" and offload.super_offload))
    if "aio" in parsed.model_fields_set and not _uses_nvme(parsed):
        keys += ("aio",)  # it drives only the NVMe tier
    elif parsed.aio.use_gds:
        keys += ("aio.use_gds",)
    # Keys inside acted-on sections that still change nothing here.
    quiet = {"fp16": ("fp16_master_weights_and_grads",), "bf16": ("immediate_grad_update", "check_grad_overflow"),
             "bfloat16": ("immediate_grad_update", "check_grad_overflow"),
             "optimizer": ("legacy_fusion",)}
    for section, names in quiet.items():
        keys += tuple(f"{section}.{name}" for name in names if name in (raw.get(section) or {}))
    params = (raw.get("optimizer") or {}).get("params") or {}
    # (torch_adam: sets AdamW's default weight decay; fp32_optimizer_states: true is what the engine does)
    keys += tuple(f"optimizer.params.{name}" for name in ("fused", "foreach") if name in params)
    return keys


def _zero_cache_on(parsed: edge.EdgeConfig) -> bool:
    """Whether ZeRO-Cache will hold the optimizer states (:func:`_zero_cache_section`'s rule)."""
    zero = parsed.zero_optimization
    offloaded = any(o is not None and o.device != "none" for o in (zero.offload_param, zero.offload_optimizer))
    return bool(parsed.zero_cache.enabled) or (zero.stage == 3 and offloaded)


def _precision(parsed: edge.EdgeConfig, device_type: str) -> typed.PrecisionConfig:
    """The compute dtype (:mod:`angelptm.config.precision`), then the master, moment and autocast dtypes
    (:mod:`angelptm.config.precision_modes`)."""
    return precision_modes.apply_modes(_compute_precision(parsed, device_type), parsed, device_type)


def _compute_precision(parsed: edge.EdgeConfig, device_type: str) -> typed.PrecisionConfig:
    if parsed.fp16.enabled and parsed.bf16.enabled is True:
        raise ConfigError("fp16.enabled and bf16.enabled are both true; enable at most one")
    # A bf16 or fp16 section with enabled false is fp32 as written; only a config naming neither is left open.
    named = bool({"bf16", "fp16"} & parsed.model_fields_set)
    bf16 = parsed.bf16.enabled if named else None
    choice = precision.choose_dtype(bf16=bf16, fp16=parsed.fp16.enabled, device_type=device_type)
    if not parsed.fp16.enabled:
        return typed.PrecisionConfig(dtype=choice.dtype, reason=choice.reason, slow_bf16=choice.slow_bf16)
    fp16 = parsed.fp16
    scale = typed.LossScaleConfig(
        static_scale=fp16.loss_scale or None, initial_scale_power=fp16.initial_scale_power,
        window=fp16.loss_scale_window, hysteresis=fp16.hysteresis,
        consecutive_hysteresis=fp16.consecutive_hysteresis, min_scale=float(fp16.min_loss_scale),
    )
    return typed.PrecisionConfig(dtype=torch.float16, loss_scale=scale, cast_inputs=fp16.auto_cast,
                                 reason=choice.reason)


def _optimizer(section: edge.OptimizerSection | None) -> typed.OptimizerConfig | None:
    if section is None:
        return None
    kind = {name.lower(): name for name in edge.OPTIMIZER_TYPES}.get(section.type.lower())
    if kind is None:
        raise ConfigError(
            f"optimizer.type: {section.type!r} is not supported; use one of {', '.join(edge.OPTIMIZER_TYPES)}"
        )
    params = section.params
    if not params.bias_correction:
        raise ConfigError("optimizer.params.bias_correction: false is not supported; remove the key or set it to true")
    decoupled = True if kind == "AdamW" else params.adam_w_mode
    weight_decay = params.weight_decay
    if params.torch_adam and decoupled and "weight_decay" not in params.model_fields_set:
        weight_decay = 0.01  # DeepSpeed builds torch.optim.AdamW from the params as given: torch's default applies
    return typed.OptimizerConfig(lr=params.lr, betas=params.betas, eps=params.eps, weight_decay=weight_decay,
                                 decoupled_weight_decay=decoupled, amsgrad=params.amsgrad, torch_adam=params.torch_adam)


def _to_typed(parsed: edge.EdgeConfig, scheduler: typed.SchedulerConfig | None, ignored: tuple[str, ...],
              world_size: int, device_type: str) -> typed.EngineConfig:
    zero = parsed.zero_optimization
    monitor = typed.MonitorConfig(
        steps_per_print=parsed.steps_per_print,
        wall_clock_breakdown=parsed.wall_clock_breakdown,
        tensorboard_dir=_monitor_dir(parsed.tensorboard),
        csv_dir=_monitor_dir(parsed.csv_monitor),
        log_level=parsed.log_level,
    )
    if parsed.wandb.enabled:
        ignored = ignored + ("wandb",)
    if parsed.gradient_clipping < 0:
        raise ConfigError(f"gradient_clipping: must be >= 0 (0 = off), got {parsed.gradient_clipping}")
    if parsed.data.seq_len is not None and parsed.data.seq_len > parsed.model.max_seq_len:
        raise ConfigError(f"data.seq_len: {parsed.data.seq_len} is longer than the model takes (model.max_seq_len "
                          f"{parsed.model.max_seq_len}); use at most {parsed.model.max_seq_len}, or raise "
                          "model.max_seq_len")
    if parsed.moe.enabled:
        model = parsed.model
        parsed.moe.check_expert_numel(num_layers=model.num_layers, hidden_size=model.hidden_size,
                                      ffn_hidden_size=model.ffn_hidden_size, gated=model.mlp == "swiglu")
    return typed.EngineConfig(
        batch=resolve_batch_sizes(parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu,
                                  parsed.gradient_accumulation_steps, _data_parallel_ranks(parsed, world_size)),
        precision=_precision(parsed, device_type),
        optimizer=_optimizer(parsed.optimizer),
        scheduler=scheduler,
        gradient_clipping=parsed.gradient_clipping,
        zero=typed.ZeroConfig(
            stage=zero.stage, reduce_bucket_size=zero.reduce_bucket_size,
            offload_param_device=zero.offload_param.device if zero.offload_param else "none",
            overlap_permissions=_overlap_permissions(zero),
            gather_16bit_weights_on_model_save=zero.stage3_gather_16bit_weights_on_model_save
            if "stage3_gather_16bit_weights_on_model_save" in zero.model_fields_set else None,
        ),
        zero_cache=_zero_cache_section(parsed), monitor=monitor, seed=parsed.seed, model=parsed.model, data=parsed.data,
        train=parsed.train, moe=parsed.moe, autopipe=parsed.autopipe, comms=parsed.comms, accepted_not_acted=ignored,
    )


def _overlap_permissions(zero: edge.ZeroSection) -> tuple[str, ...]:
    """DeepSpeed 0.19.8's keys that ask for an optimizer step overlapped with compute (ZenFlow, SuperOffload)."""
    keys = ("zero_optimization.zenflow",) if zero.zenflow is not None else ()
    if zero.offload_optimizer is not None and zero.offload_optimizer.super_offload:
        keys += ("zero_optimization.offload_optimizer.super_offload",)
    return keys


def _data_parallel_ranks(parsed: edge.EdgeConfig, world_size: int) -> int:
    """Ranks that split the batch: with an AutoPipe pipeline, world_size / autopipe.num_stages replicas."""
    autopipe = parsed.autopipe
    if not autopipe.enabled:
        return world_size
    if world_size % autopipe.num_stages:
        raise ConfigError(f"autopipe.num_stages={autopipe.num_stages}: must divide the number of ranks {world_size} "
                          f"(use one of {[d for d in range(1, world_size + 1) if world_size % d == 0]}, or start "
                          f"{autopipe.num_stages} x k ranks)")
    return world_size // autopipe.num_stages


def _zero_cache_section(parsed: edge.EdgeConfig) -> ZeroCacheConfig:
    """ZeRO-3 with an offload device means "ZeRO-Cache on"; its nvme_path and the ``aio`` block carry over."""
    zero, section = parsed.zero_optimization, parsed.zero_cache
    # DeepSpeed's block drives the IO; zero_cache.aio.backend still picks the backend
    if "aio" in parsed.model_fields_set:
        aio = parsed.aio
        section = dataclasses.replace(section, aio=dataclasses.replace(
            section.aio, block_size=aio.block_size, queue_depth=aio.queue_depth, thread_count=aio.intra_op_parallelism,
            single_submit=aio.single_submit, overlap_events=aio.overlap_events))
    section = dataclasses.replace(section, **_carried_tuning(zero, section),
                                  state_dtype=precision_modes.zero_cache_state_dtype(parsed))
    offloads = [o for o in (zero.offload_param, zero.offload_optimizer) if o is not None and o.device != "none"]
    if zero.offload_param is not None and zero.offload_param.device != "none" and section.param_home == "auto":
        # A permission, not a placement: the plan may stream params from the host (and the disk, for nvme), and
        # keeps on the device and in host memory those that fit and pay (the plan's log line says which);
        # zero_cache.param_home "host" or "nvme" forces them all there.
        device = zero.offload_param.device
        if device == "nvme":
            section = dataclasses.replace(section, nvme_param_homes=True,
                                          nvme_path=section.nvme_path or zero.offload_param.nvme_path)
        logger.info("zero_optimization.offload_param.device is %s: params may live %s; the plan keeps on the device "
                    "and in host memory those that fit and pay (set zero_cache.param_home to \"%s\" to force every "
                    "one there)", device, "in host memory or on NVMe" if device == "nvme" else "in host memory",
                    device if device == "nvme" else "host")
    if section.enabled or zero.stage != 3 or not offloads:
        return section
    nvme = next((o.nvme_path for o in offloads if o.device == "nvme"), None)
    return dataclasses.replace(section, enabled=True, nvme_path=section.nvme_path or nvme)


TUNING_KEYS = {"stage3_prefetch_bucket_size": "gather_ahead_elements",
               "stage3_max_live_parameters": "max_live_elements"}
"""DeepSpeed's ZeRO-3 knobs that size the same things for sharded chunks -> the ``zero_cache`` field they set."""


def _carried_tuning(zero: edge.ZeroSection, section: ZeroCacheConfig) -> dict[str, Any]:
    """DeepSpeed's overlap and prefetch knobs, carried over to ``section``'s fields where the ``zero_cache`` section
    leaves them at their defaults. A tuning value below ZeRO-Cache's default would only make the step slower
    (fewer elements gathered ahead or live than the plan's own choice, which fits them in its budget anyway),
    so it is raised to the default with a log line naming the ``zero_cache`` key that forces it."""
    defaults = ZeroCacheConfig()
    carried: dict[str, Any] = {}
    if zero.overlap_comm is not None:
        carried["overlap_comm"] = zero.overlap_comm
    for key, field_name in TUNING_KEYS.items():
        if key not in zero.model_fields_set or getattr(section, field_name) != getattr(defaults, field_name):
            continue  # unset, or the zero_cache section sets the field itself
        value, default = getattr(zero, key), getattr(defaults, field_name)
        if value < default:
            logger.info("zero_optimization.%s %s is below ZeRO-Cache's %s and would only slow the step; using %s "
                        "(set zero_cache.%s to force a value)", key, f"{value:,}", f"{default:,}", f"{default:,}",
                        field_name)
            value = default
        carried[field_name] = value
    return carried


def _monitor_dir(section: edge.MonitorSection) -> str | None:
    if not section.enabled:
        return None
    return str(Path(section.output_path or "runs") / section.job_name)
