"""``deepspeed.runtime.zero.config``: the ``zero_optimization`` section as DeepSpeed's pydantic models.

Field names, aliases, defaults and bounds are DeepSpeed 0.19's, so configs and scripts that build or read these
models behave alike. What this engine *does* with them is decided by :mod:`angelptm.config` (ZeRO-Cache places
states by its plan; DeepSpeed's placement keys are permissions, not placements).
"""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from typing import Any, Optional

from pydantic import Field, model_validator

from angelptm.runtime.config_utils import DeepSpeedConfigModel

ZERO_OPTIMIZATION = "zero_optimization"


class ZeroStageEnum(int, Enum):
    """ZeRO's stages: what is partitioned over data-parallel ranks."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


class OffloadDeviceEnum(str, Enum):
    """Where offloaded states may go."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class DeepSpeedZeroOffloadParamConfig(DeepSpeedConfigModel):
    """``zero_optimization.offload_param``."""

    device: OffloadDeviceEnum = "none"
    nvme_path: Optional[Path] = None
    buffer_count: int = Field(5, ge=0)
    buffer_size: int = Field(100_000_000, ge=0)
    max_in_cpu: int = Field(1_000_000_000, ge=0)
    pin_memory: bool = True


class DeepSpeedZeroOffloadOptimizerConfig(DeepSpeedConfigModel):
    """``zero_optimization.offload_optimizer``; its attribute ``pipeline`` (not a key, as in DeepSpeed) is true
    when either pipelined direction is."""

    device: OffloadDeviceEnum = "none"
    nvme_path: Optional[Path] = None
    buffer_count: int = Field(4, ge=0)
    pin_memory: bool = True
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False
    ratio: float = Field(1.0, ge=0.0, le=1.0)
    super_offload: bool = False
    cpuadam_cores_perc: float = Field(0.8, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _pipeline_from_directions(self) -> "DeepSpeedZeroOffloadOptimizerConfig":
        self.__dict__["pipeline"] = self.pipeline_read or self.pipeline_write
        return self


def _deprecated(new_param: str, new_param_fn: Any = None, set_new_param: bool = True) -> dict[str, Any]:
    extra: dict[str, Any] = {"deprecated": True, "new_param": new_param, "set_new_param": set_new_param}
    if new_param_fn is not None:
        extra["new_param_fn"] = new_param_fn
    return extra


class DeepSpeedZeroConfig(DeepSpeedConfigModel):
    """``zero_optimization``: DeepSpeed 0.19's keys (``stage3_*`` names are aliases of the short ones)."""

    stage: ZeroStageEnum = 0
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: int = Field(500_000_000, gt=0)
    use_multi_rank_bucket_allreduce: bool = True
    allgather_partitions: bool = True
    allgather_bucket_size: int = Field(500_000_000, ge=0)
    overlap_comm: Optional[bool] = None
    """None: True for stage 3, False below it (DeepSpeed's dynamic default)."""
    compute_grad_norm: bool = True
    load_from_fp32_weights: bool = True
    elastic_checkpoint: bool = False
    offload_param: Optional[DeepSpeedZeroOffloadParamConfig] = None
    offload_optimizer: Optional[DeepSpeedZeroOffloadOptimizerConfig] = None
    sub_group_size: int = Field(1_000_000_000, ge=0)
    cpu_offload_param: Optional[bool] = Field(None, json_schema_extra=_deprecated(
        "offload_param", lambda on: DeepSpeedZeroOffloadParamConfig(device=OffloadDeviceEnum.cpu) if on else None))
    cpu_offload_use_pin_memory: Optional[bool] = Field(None, json_schema_extra=_deprecated(
        "offload_param or offload_optimizer", set_new_param=False))
    cpu_offload: Optional[bool] = Field(None, json_schema_extra=_deprecated(
        "offload_optimizer",
        lambda on: DeepSpeedZeroOffloadOptimizerConfig(device=OffloadDeviceEnum.cpu) if on else None))
    prefetch_bucket_size: int = Field(50_000_000, ge=0, alias="stage3_prefetch_bucket_size")
    param_persistence_threshold: int = Field(100_000, ge=0, alias="stage3_param_persistence_threshold")
    model_persistence_threshold: int = Field(sys.maxsize, ge=0, alias="stage3_model_persistence_threshold")
    max_live_parameters: int = Field(1_000_000_000, ge=0, alias="stage3_max_live_parameters")
    max_reuse_distance: int = Field(1_000_000_000, ge=0, alias="stage3_max_reuse_distance")
    gather_16bit_weights_on_model_save: bool = Field(False, alias="stage3_gather_16bit_weights_on_model_save")
    module_granularity_threshold: int = Field(0, alias="stage3_module_granularity_threshold")
    use_all_reduce_for_fetch_params: bool = Field(False, alias="stage3_use_all_reduce_for_fetch_params")
    allgather_sequential: bool = Field(False, alias="stage3_allgather_sequential")
    stage3_gather_fp16_weights_on_model_save: bool = Field(False, json_schema_extra=_deprecated(
        "gather_16bit_weights_on_model_save"))
    ignore_unused_parameters: bool = True
    legacy_stage1: bool = False
    round_robin_gradients: bool = False
    parameter_alignment: bool = False
    zero_hpz_partition_size: int = Field(1, ge=0)
    zero_quantized_weights: bool = False
    zero_quantized_nontrainable_weights: bool = False
    zero_quantized_gradients: bool = False
    memory_efficient_linear: bool = True
    pipeline_loading_checkpoint: bool = False
    override_module_apply: bool = True
    log_trace_cache_warnings: bool = False
    enable_sanity_checks: bool = False
    save_muon_momentum_buffer_in_memory: bool = False
    mics_shard_size: int = -1
    mics_hierarchical_params_gather: bool = False
    zeropp_loco_param: Optional[dict] = None
    """(These three were removed in DeepSpeed 0.19.8, which refuses them; accepted, with no effect, as the JSON edge
    accepts them, so that configs of earlier DeepSpeed versions load.)"""
    zenflow: Optional[dict] = None
    leaf_module: Optional[dict] = None

    @model_validator(mode="after")
    def _overlap_comm_default(self) -> "DeepSpeedZeroConfig":
        if self.overlap_comm is None:
            object.__setattr__(self, "overlap_comm", self.stage == ZeroStageEnum.weights)
        return self


def read_zero_config_deprecated(param_dict: dict) -> dict[str, Any]:
    """The pre-0.3 form ``"zero_optimization": true`` as a section: stage 1 with ``allgather_size`` as its bucket."""
    section: dict[str, Any] = {"stage": 1 if param_dict[ZERO_OPTIMIZATION] else 0}
    if section["stage"]:
        section["allgather_bucket_size"] = param_dict.get("allgather_size", 500_000_000)
    return section


def get_zero_config(param_dict: dict) -> DeepSpeedZeroConfig:
    """The ``zero_optimization`` section of a config dict as a model (an absent section is stage 0)."""
    section = param_dict.get(ZERO_OPTIMIZATION, {})
    if isinstance(section, bool):
        section = read_zero_config_deprecated(param_dict)
    return DeepSpeedZeroConfig(**section)
