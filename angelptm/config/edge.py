"""The JSON edge: DeepSpeed's config keys (plus our own sections) as pydantic models.

Everything here mirrors DeepSpeed 0.19's key names and defaults so a DeepSpeed config loads
unchanged. Nothing past :func:`angelptm.config.load_config` sees these models: they are converted to the
typed dataclasses in ``angelptm.config.typed`` once.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from angelptm.config.typed import CommsConfig, TrainConfig
from angelptm.pretraining.data.config import DataConfig
from angelptm.pretraining.models import ModelConfig
from autopipe import AutoPipeConfig
from moe import MoEConfig
from zero_cache import ZeroCacheConfig


class Section(BaseModel):
    """Base of every DeepSpeed section: unknown keys are rejected (checked first, with suggestions)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class OptimizerParams(Section):
    lr: float = 1e-3
    """DeepSpeed's key; at most 10 (``angelptm.config.typed.MAX_LR``): beyond it the first step wrecks the weights."""
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    """DeepSpeed's key; in [1.18e-38, 1): below float32's smallest normal the fp32 Adam states hold it as 0."""
    weight_decay: float = 0.0
    adam_w_mode: bool = True
    """DeepSpeed's "Adam" is decoupled-weight-decay AdamW unless this is false."""
    amsgrad: bool = False
    torch_adam: bool = False
    fused: bool | None = None
    bias_correction: bool = True
    fp32_optimizer_states: bool = True
    """DeepSpeed's CPU Adam option: true only (the engine's Adam moments are fp32); false is refused."""
    foreach: bool | None = None
    """Passed to torch's Adam by DeepSpeed with ``torch_adam``: no effect here."""


class OptimizerSection(Section):
    type: str
    params: OptimizerParams = Field(default_factory=OptimizerParams)
    legacy_fusion: bool = False
    """DeepSpeed's FusedAdam legacy kernel switch: no effect here."""


class WarmupLRParams(Section):
    warmup_min_lr: float | list[float] = 0.0
    """One value, or one per param group (as DeepSpeed allows); in [0, 10], as ``optimizer.params.lr``."""
    warmup_max_lr: float | list[float] | None = None
    """As ``warmup_min_lr``; None is each param group's lr."""
    warmup_num_steps: int = 1000
    warmup_type: str = "log"
    """"log" or "linear"; any other value falls back to "log" with a warning, as DeepSpeed does."""
    last_batch_iteration: int = -1


class WarmupDecayLRParams(WarmupLRParams):
    warmup_max_lr: float | list[float] = 0.001
    """As in :class:`WarmupLRParams` (in [0, 10])."""
    total_num_steps: int


class WarmupCosineLRParams(Section):
    total_num_steps: int
    warmup_min_ratio: float = 0.0
    """The warm-up's first rate as a fraction of the optimizer's lr, in [0, 1]."""
    warmup_num_steps: int = 1000
    cos_min_ratio: float = 0.0001
    """The cosine's last rate as a fraction of the optimizer's lr, in [0, 1]."""
    warmup_type: str = "log"
    """As in :class:`WarmupLRParams`."""
    last_batch_iteration: int = -1


class OneCycleParams(Section):
    """DeepSpeed's OneCycle (angelptm.engine.cyclic_schedules): the lr and beta1 over one cycle, then decay."""

    cycle_min_lr: float | list[float]
    cycle_max_lr: float | list[float]
    decay_lr_rate: float = 0.0
    cycle_first_step_size: int = 2000
    cycle_second_step_size: int | None = None
    cycle_first_stair_count: int = 0
    cycle_second_stair_count: int | None = None
    decay_step_size: int = 0
    cycle_momentum: bool = True
    cycle_min_mom: float | list[float] = 0.8
    cycle_max_mom: float | list[float] = 0.9
    decay_mom_rate: float = 0.0
    last_batch_iteration: int = -1


class LRRangeTestParams(Section):
    """DeepSpeed's LRRangeTest: the lr grows from lr_range_test_min_lr by step_rate every step_size steps."""

    lr_range_test_min_lr: float | list[float] = 0.001
    lr_range_test_step_size: int = 2000
    lr_range_test_step_rate: float = 1.0
    lr_range_test_staircase: bool = False
    last_batch_iteration: int = -1


SCHEDULER_PARAMS: dict[str, type[Section]] = {
    "WarmupLR": WarmupLRParams,
    "WarmupDecayLR": WarmupDecayLRParams,
    "WarmupCosineLR": WarmupCosineLRParams,
    "OneCycle": OneCycleParams,
    "LRRangeTest": LRRangeTestParams,
}
OPTIMIZER_TYPES = ("Adam", "AdamW")


class SchedulerSection(Section):
    type: str
    params: dict[str, Any] = Field(default_factory=dict)
    """Validated against SCHEDULER_PARAMS[type] in the loader, once the type is known."""


class FP16Section(Section):
    enabled: bool = False
    auto_cast: bool = False
    loss_scale: float = 0.0
    """0 selects dynamic loss scaling; any other value is a static scale."""
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: int = 1
    """DeepSpeed's key, an integer as DeepSpeed's model types it (a fraction is refused there and here)."""
    fp16_master_weights_and_grads: bool = False


class BF16Section(Section):
    enabled: bool | Literal["auto"] = False
    """"auto" (ours): bf16 where the device computes it natively, else fp32 (angelptm.config.precision)."""

    @field_validator("enabled", mode="wrap")
    @classmethod
    def _bool_or_auto(cls, value: Any, handler: Any) -> bool | str:
        try:
            return handler(value)
        except ValidationError:  # one message, not one per member of the union
            raise ValueError(f"bf16.enabled: expected true, false or \"auto\" (got {value!r})") from None
    immediate_grad_update: bool = False
    check_grad_overflow: bool = True
    bf16_master_weights_and_grads: bool = False
    """DeepSpeed 0.19.8's bf16 master weights and gradients (ZeRO stage 1-3; without bf16_optimizer_states only with
    offload_optimizer): the optimizer steps the bf16 parameters with bf16 gradients
    (:mod:`angelptm.config.precision_modes`)."""
    bf16_optimizer_states: bool = False
    """DeepSpeed 0.19.8's bf16 Adam moments; requires bf16_master_weights_and_grads."""


class OffloadParamSection(Section):
    """DeepSpeed's ``zero_optimization.offload_param``: the keys, defaults and bounds of its
    ``DeepSpeedZeroOffloadParamConfig``."""

    device: Literal["none", "cpu", "nvme"] = "none"
    nvme_path: str | None = None
    buffer_count: int = Field(5, ge=0)
    buffer_size: int = Field(100_000_000, ge=0)
    max_in_cpu: int = Field(1_000_000_000, ge=0)
    pin_memory: bool = True


class OffloadOptimizerSection(Section):
    """DeepSpeed's ``zero_optimization.offload_optimizer``: the keys, defaults and bounds of its
    ``DeepSpeedZeroOffloadOptimizerConfig``."""

    device: Literal["none", "cpu", "nvme"] = "none"
    nvme_path: str | None = None
    buffer_count: int = Field(4, ge=0)
    pin_memory: bool = True
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False
    ratio: float = Field(1.0, ge=0.0, le=1.0)
    super_offload: bool = False
    """DeepSpeed 0.19.8's SuperOffload: accepted as permission to overlap the host optimizer step with compute, which
    ZeRO-Cache does exactly (``zero_cache.update_in_backward``); logged once."""
    cpuadam_cores_perc: float = Field(0.8, ge=0.0, le=1.0)
    """SuperOffload's share of CPU cores for CPU Adam: no effect here (ZeRO-Cache sizes its own host threads)."""


class ZenFlowSection(Section):
    """DeepSpeed 0.19.8's ``zero_optimization.zenflow``, with its keys and bounds. Accepted as permission to overlap
    the optimizer step with compute: the engine runs its own exact overlapped update (logged once); ZenFlow's
    stale top-k updates are not copied, so these keys change nothing."""

    topk_ratio: float = Field(0.1, gt=0.0, lt=1.0)
    select_strategy: Literal["auto", "step", "epoch"] = "auto"
    select_interval: Literal["auto"] | int = "auto"
    update_interval: Literal["auto"] | int = "auto"
    overlap_step: bool = False
    offload: bool = False
    auto_ratio: float = Field(0.99, ge=0.0, le=1.0)
    full_warm_up_rounds: int = 0
    pt_reserved_cores_perc: float = Field(0.5, ge=0.0, le=1.0)
    steps_per_epoch: int | None = None


class LeafModuleSection(Section):
    """DeepSpeed's ``zero_optimization.leaf_module`` (modules ZeRO-3 gathers whole): no effect here, where
    ZeRO-Cache gathers by chunk."""

    classes: list[str] = Field(default_factory=list)
    names: list[str] = Field(default_factory=list)
    name_suffixes: list[str] = Field(default_factory=list)


class ZeroSection(Section):
    stage: Literal[0, 1, 2, 3] = 0

    @field_validator("stage", mode="before")
    @classmethod
    def _numeric_string_stage(cls, value: Any) -> Any:
        """``"2"`` is stage 2, as DeepSpeed's ``ZeroStageEnum`` reads it (a boolean is refused before this)."""
        return int(value) if isinstance(value, str) and value.strip().isdigit() else value

    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: int = Field(500_000_000, gt=0)
    allgather_partitions: bool = True
    allgather_bucket_size: int = Field(500_000_000, ge=0)
    overlap_comm: bool | None = None
    round_robin_gradients: bool = False
    offload_param: OffloadParamSection | None = None
    offload_optimizer: OffloadOptimizerSection | None = None
    sub_group_size: int = Field(1_000_000_000, ge=0)
    stage3_max_live_parameters: int = Field(1_000_000_000, ge=0)
    stage3_max_reuse_distance: int = Field(1_000_000_000, ge=0)
    stage3_prefetch_bucket_size: int = Field(50_000_000, ge=0)
    stage3_param_persistence_threshold: int = Field(100_000, ge=0)
    stage3_gather_16bit_weights_on_model_save: bool = False
    elastic_checkpoint: bool = False
    ignore_unused_parameters: bool = True
    load_from_fp32_weights: bool = True
    memory_efficient_linear: bool = True
    zero_hpz_partition_size: int = Field(1, ge=0)
    zero_quantized_weights: bool = False
    zero_quantized_gradients: bool = False
    mics_shard_size: int = -1
    mics_hierarchical_params_gather: bool = False
    zeropp_loco_param: dict[str, Any] | None = None
    """(These three were removed in DeepSpeed 0.19.8, which refuses them; accepted here, with no effect, so that
    configs of earlier DeepSpeed versions load.)"""
    use_multi_rank_bucket_allreduce: bool = True
    stage3_module_granularity_threshold: int = 0
    log_trace_cache_warnings: bool = False
    # DeepSpeed 0.19.8's keys beside those (docs/deepspeed-compatibility.md says what each does here).
    compute_grad_norm: bool = True
    zenflow: ZenFlowSection | None = None
    stage3_model_persistence_threshold: int = Field(2**63 - 1, ge=0)
    stage3_use_all_reduce_for_fetch_params: bool = False
    stage3_allgather_sequential: bool = False
    legacy_stage1: bool = False
    parameter_alignment: bool = False
    zero_quantized_nontrainable_weights: bool = False
    pipeline_loading_checkpoint: bool = False
    override_module_apply: bool = True
    enable_sanity_checks: bool = False
    save_muon_momentum_buffer_in_memory: bool = False
    leaf_module: LeafModuleSection = Field(default_factory=LeafModuleSection)


class TorchAutocastSection(Section):
    """DeepSpeed's ``torch_autocast``: the forward under ``torch.autocast(device, dtype)`` with fp32 parameters
    (:mod:`angelptm.config.precision_modes`); ``enabled: false`` is DeepSpeed's default and changes nothing."""

    enabled: bool = False
    dtype: str | None = None
    lower_precision_safe_modules: list[str] | None = None


class AioSection(Section):
    block_size: int = 1_048_576
    queue_depth: int = 8
    intra_op_parallelism: int = Field(default=1, alias="thread_count")
    single_submit: bool = False
    overlap_events: bool = True
    use_gds: bool = False


class MonitorSection(Section):
    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class WandbSection(Section):
    enabled: bool = False
    group: str | None = None
    team: str | None = None
    project: str = "deepspeed"


@dataclass(frozen=True, slots=True)
class DeprecatedKey:
    """A key DeepSpeed 0.19's config models still accept (``deprecated=True``), and the key that replaced it."""

    path: str
    """Where it is written, e.g. "zero_optimization.cpu_offload"."""
    new_key: str
    """The key to write instead, in the same section."""
    new_value: Callable[[Any], Any] | None
    """The deprecated value -> the new key's value, as DeepSpeed's ``new_param_fn``; None where DeepSpeed sets
    nothing (``set_new_param=False``: the value is dropped). A result of None leaves the new key unset."""


DEPRECATED_KEYS = (
    # deepspeed/runtime/zero/config.py, DeepSpeedZeroConfig: cpu_offload_param, cpu_offload_use_pin_memory,
    # cpu_offload and stage3_gather_fp16_weights_on_model_save are its deprecated fields.
    DeprecatedKey("zero_optimization.cpu_offload", "offload_optimizer",
                  lambda on: {"device": "cpu"} if on else None),
    DeprecatedKey("zero_optimization.cpu_offload_param", "offload_param",
                  lambda on: {"device": "cpu"} if on else None),
    DeprecatedKey("zero_optimization.cpu_offload_use_pin_memory", "offload_param.pin_memory or "
                  "offload_optimizer.pin_memory", None),
    DeprecatedKey("zero_optimization.stage3_gather_fp16_weights_on_model_save",
                  "stage3_gather_16bit_weights_on_model_save", lambda on: on),
)
"""DeepSpeed's deprecated config keys: read with DeepSpeed's meaning, with a warning naming the new key."""


def upgrade_deprecated_keys(raw: dict[str, Any]) -> list[str]:
    """Rewrite DeepSpeed's deprecated keys in ``raw`` (in place) as DeepSpeed 0.19 reads them.

    Also the pre-0.3 form ``"zero_optimization": true/false`` (stage 1 with the top-level ``allgather_size`` as
    its bucket, or stage 0), which DeepSpeed's ``get_zero_config`` still reads.

    Returns:
        One warning per deprecated key found, naming the key to write instead.

    Raises:
        ValueError: a deprecated key and the key replacing it are both set (DeepSpeed refuses that too).
    """
    warnings = []
    if isinstance(raw.get("zero_optimization"), bool):
        stage = 1 if raw["zero_optimization"] else 0
        section: dict[str, Any] = {"stage": stage}
        if stage:
            section["allgather_bucket_size"] = _legacy_bucket_size(raw.pop("allgather_size", 500_000_000))
        raw["zero_optimization"] = section
        warnings.append(f"\"zero_optimization\": {str(bool(stage)).lower()} is DeepSpeed's deprecated form; read as "
                        f"{json.dumps(section)}. Write the section instead")
    for key in DEPRECATED_KEYS:
        section_name, name = key.path.split(".")
        section = raw.get(section_name)
        if not isinstance(section, dict) or name not in section:
            continue
        value = section.pop(name)
        if key.new_value is None:
            warnings.append(f"{key.path} is deprecated (DeepSpeed ignores its value too): set {section_name}."
                            f"{key.new_key} instead")
            continue
        if key.new_key in section:
            raise ValueError(f"{key.path} (deprecated) and {section_name}.{key.new_key}, which replaces it, are both "
                             f"set; keep {section_name}.{key.new_key} only")
        new_value = key.new_value(value)
        if new_value is None:
            warnings.append(f"{key.path} is deprecated: {json.dumps(value)} means no {section_name}.{key.new_key} "
                            f"(as DeepSpeed reads it); delete the key")
            continue
        section[key.new_key] = new_value
        warnings.append(f"{key.path} is deprecated: read as {section_name}.{key.new_key} = {json.dumps(new_value)}. "
                        f"Write that instead")
    return warnings


def _legacy_bucket_size(value: Any) -> int:
    """The top-level ``allgather_size`` that ``"zero_optimization": true`` reads as its bucket: a number, refused as
    :func:`type_problems` refuses one elsewhere (a JSON boolean is not 1 or 0)."""
    problem = f"allgather_size: expected a number, got {json.dumps(value)}"
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{problem}; write the number (a JSON boolean is not read as 1 or 0 here)")
    try:
        return int(value)
    except (ValueError, OverflowError):
        raise ValueError(f"{problem}; write a whole number of elements") from None


FIELD_NAME_SPELLINGS = {
    "zero_optimization": {name: f"stage3_{name}" for name in (
        "prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold", "max_live_parameters",
        "max_reuse_distance", "gather_16bit_weights_on_model_save", "module_granularity_threshold",
        "use_all_reduce_for_fetch_params", "allgather_sequential")},
}
"""Section -> DeepSpeed's field name -> the ``stage3_`` alias written here. DeepSpeed's models read a field by its
name or its alias (``populate_by_name``), so ``prefetch_bucket_size`` is ``stage3_prefetch_bucket_size``."""


def rewrite_field_names(raw: dict[str, Any]) -> None:
    """Rename the keys of :data:`FIELD_NAME_SPELLINGS` in ``raw`` (in place) to the names this edge reads.

    Raises:
        ValueError: a key is given under both names.
    """
    for section_name, spellings in FIELD_NAME_SPELLINGS.items():
        section = raw.get(section_name)
        if not isinstance(section, dict):
            continue
        for name, alias in spellings.items():
            if name not in section:
                continue
            if alias in section:
                raise ValueError(f"{section_name}.{name} and {section_name}.{alias} are the same key given twice "
                                 f"(DeepSpeed reads either name); keep {section_name}.{alias}")
            section[alias] = section.pop(name)


# DeepSpeed keys we accept so that configs load unchanged, but do not act on (yet). Setting one
# is reported once as a warning that lists them, so nobody believes they took effect.
RETIRED_KEYS = {
    "zero_cache.overlap_optimizer_step": (
        "removed. It was to be AngelPTM's one-step-late host update, whose forward reads weights one step "
        "stale; zero_cache.update_in_backward now overlaps the host update with backward exactly, clipping "
        "and loss scaling included (README: ZeRO-Cache). Delete the key"),
}
"""Keys that once existed, with why they went and what to do instead."""

REFUSED_KEYS = {
    "optimizer.params.max_grad_norm": (
        "not an optimizer parameter (DeepSpeed refuses it too): set the top-level gradient_clipping instead"),
}
"""DeepSpeed keys refused whatever their value, with why and what to write instead."""

ACCEPTED_NOT_ACTED = (
    "prescale_gradients", "gradient_predivide_factor", "communication_data_type", "sparse_gradients",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "amp", "activation_checkpointing",
    "flops_profiler", "comms_logger", "memory_breakdown", "dump_state", "elasticity", "autotuning",
    "data_efficiency", "compression_training", "checkpoint", "data_types", "comet", "nebula",
    "dataloader_drop_last", "disable_allgather", "sparse_attention", "pipeline", "curriculum_learning",
    "timers", "graph_harvesting", "use_data_before_expert_parallelism", "weight_quantization",
    "hybrid_engine", "eigenvalue", "progressive_layer_drop", "quantize_training",
    # DeepSpeed 0.19.8's: docs/deepspeed-compatibility.md says what each does there and why it changes nothing here.
    # tensor_parallel and expert_parallel are refused where they ask for more ranks (loader._unsupported_values).
    "disable_python_gc", "seq_parallel_communication_data_type", "datastates_ckpt", "compile", "vocabulary_size",
    "tensor_parallel", "expert_parallel",
)


class EdgeConfig(Section):
    """A whole JSON config: DeepSpeed's keys and our own sections."""

    train_batch_size: int | None = None
    train_micro_batch_size_per_gpu: int | None = None
    gradient_accumulation_steps: int | None = None
    optimizer: OptimizerSection | None = None
    scheduler: SchedulerSection | None = None
    fp16: FP16Section = Field(default_factory=FP16Section)
    bf16: BF16Section = Field(default_factory=BF16Section, alias="bfloat16")
    gradient_clipping: float = 1.0
    """Max global gradient norm; 0 turns clipping off. Left out, it is DeepSpeed 0.19's default
    (``GRADIENT_CLIPPING_DEFAULT = 1.0``), so a DeepSpeed config without the key trains the same here."""
    zero_optimization: ZeroSection = Field(default_factory=ZeroSection)
    aio: AioSection = Field(default_factory=AioSection)
    steps_per_print: int = 10
    """Log a progress line every this many steps. ``Infinity`` (accelerate always writes it: "never") is read as
    :data:`NEVER_STEPS`, as DeepSpeed's int-or-float field never reaches it."""

    @field_validator("steps_per_print", mode="before")
    @classmethod
    def _infinity_is_never(cls, value: Any) -> Any:
        return NEVER_STEPS if isinstance(value, float) and value == math.inf else value
    wall_clock_breakdown: bool = False
    log_level: Literal["debug", "info", "warning", "error", "critical"] | None = None
    """DeepSpeed's: the level of its logger (here the ``angelptm`` logger's), set at initialize()."""
    tensorboard: MonitorSection = Field(default_factory=MonitorSection)
    csv_monitor: MonitorSection = Field(default_factory=MonitorSection)
    wandb: WandbSection = Field(default_factory=WandbSection)
    managed_gradient_accumulation: bool = True
    """DeepSpeed 0.19.8's: true (the engine steps at accumulation boundaries) only; false is refused."""
    gradient_allreduce_op: Literal["mean", "sum"] = "mean"
    """DeepSpeed 0.19.8's: "mean" (what the engine does) only; "sum" is refused."""
    sequence_parallel_size: int = 1
    """DeepSpeed's Ulysses sequence parallelism: 1 only (none); more is refused."""
    torch_autocast: TorchAutocastSection = Field(default_factory=TorchAutocastSection)
    seed: int | None = None
    """Seeds python, numpy and torch at initialize() when set (:func:`angelptm.runtime.utils.set_random_seed`, any
    integer, as DeepSpeed's); otherwise the caller's RNG state is kept."""

    # Our own sections: validated by the dataclasses their packages own.
    zero_cache: ZeroCacheConfig = Field(default_factory=ZeroCacheConfig)
    moe: MoEConfig = Field(default_factory=MoEConfig)
    autopipe: AutoPipeConfig = Field(default_factory=AutoPipeConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    comms: CommsConfig = Field(default_factory=CommsConfig)


NEVER_STEPS = 2**62
"""A step count no run reaches: what ``Infinity`` means for the keys in :data:`INFINITY_MEANS_NEVER`."""
INFINITY_MEANS_NEVER = ("steps_per_print",)
"""Keys where JSON's ``Infinity`` (Python's ``float("inf")``) is a usable value: "never"."""

# Types at the edge. Like DeepSpeed's pydantic models, the edge reads numeric strings ("4", "1.0", "1e-3") as
# numbers; unlike pydantic's lax mode it refuses JSON's true/false where a number is due (true used to become a
# micro-batch of 1) and NaN/Infinity, which Python's json module reads but no setting can mean.


def type_problems(raw: dict[str, Any]) -> list[str]:
    """Booleans given for numbers and non-finite numbers in a raw config, each as ``"key.path: what to write"``."""
    return _walk(raw, EdgeConfig, "")


def _walk(data: Any, schema: type, prefix: str) -> list[str]:
    if not isinstance(data, dict):
        return []
    annotations = _annotations(schema)
    problems = []
    for key, value in data.items():
        annotation = annotations.get(key)
        if annotation is None:
            continue  # unknown keys are reported before this walk
        path = f"{prefix}{key}"
        if (schema is SchedulerSection and key == "params" and isinstance(data.get("type"), str)
                and data["type"] in SCHEDULER_PARAMS):  # a type given as a list is pydantic's to name
            problems += _walk(value, SCHEDULER_PARAMS[data["type"]], f"{path}.")
        else:
            problems += _check_value(value, annotation, path)
    return problems


def _check_value(value: Any, annotation: Any, path: str) -> list[str]:
    members = _members(annotation)
    if isinstance(value, dict):
        nested = next((m for m in members if isinstance(m, type) and (issubclass(m, BaseModel)
                                                                      or dataclasses.is_dataclass(m))), None)
        return _walk(value, nested, f"{path}.") if nested is not None else []
    if isinstance(value, list):
        items = [arg for m in members if typing.get_origin(m) in (list, tuple) for arg in typing.get_args(m)]
        items = [item for item in items if item is not Ellipsis]
        if not items:
            return []
        return [problem for i, item in enumerate(value) for problem in _check_value(item, typing.Union[tuple(items)],
                                                                                    f"{path}[{i}]")]
    numeric = any(m in (int, float) or _int_literal(m) for m in members)
    expected = "a number or a string" if str in members else "a number"
    if isinstance(value, bool) and numeric and not _admits_bool(members):
        return [f"{path}: expected {expected}, got {str(value).lower()}; write the number (a JSON boolean is not "
                "read as 1 or 0 here)"]
    if isinstance(value, float) and not math.isfinite(value) and numeric and not (path in INFINITY_MEANS_NEVER
                                                                                  and value > 0):
        name = "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
        return [f"{path}: {name} is not a usable value; expected a finite number"]
    return []


def _int_literal(member: Any) -> bool:
    """``Literal[0, 1, 2, 3]`` (ZeRO's stage): numbers, where true would be taken for 1."""
    return typing.get_origin(member) is Literal and any(type(arg) is int for arg in typing.get_args(member))


def _admits_bool(members: tuple[Any, ...]) -> bool:
    return any(m is bool or m is Any or (typing.get_origin(m) is Literal and any(isinstance(a, bool)
                                                                                 for a in typing.get_args(m)))
               for m in members)


def _members(annotation: Any) -> tuple[Any, ...]:
    """The members of a union (``X | Y``, ``Optional[X]``), or the annotation alone."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return tuple(m for arg in typing.get_args(annotation) for m in _members(arg))
    return (annotation,)


def _annotations(schema: type) -> dict[str, Any]:
    """Key (and alias) -> resolved annotation of a pydantic model's or a dataclass's fields."""
    if issubclass(schema, BaseModel):
        keys: dict[str, Any] = {}
        for name, info in schema.model_fields.items():
            keys[name] = info.annotation
            if info.alias:
                keys[info.alias] = info.annotation
        return keys
    try:
        hints = typing.get_type_hints(schema)
    except Exception:  # an annotation that does not resolve at run time: leave that section to pydantic's checks
        return {}
    return {field.name: hints.get(field.name, Any) for field in dataclasses.fields(schema)}
