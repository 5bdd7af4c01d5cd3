"""``deepspeed.runtime.config``: ``DeepSpeedConfig``, DeepSpeed's parsed view of a config, for scripts that read it.

DeepSpeed's engine keeps one of these; scripts and libraries build one to read a config the way DeepSpeed
reads it (batch sizes resolved against the world size, the ZeRO and precision sections as models, the
optimizer's and scheduler's names and params). This engine trains from :func:`angelptm.config.load_config`'s
typed tree instead, which is stricter (unknown keys are errors there); this class is DeepSpeed's lenient
reader, with DeepSpeed's errors: ``AssertionError`` for inconsistent batch sizes, ``ValueError`` for a
duplicate key, an unreadable source or a bad ``gradient_allreduce_op``.

A config is a dict, a path to a JSON or hjson file (hjson: comments, unquoted keys, trailing commas), or the
base64 of one (DeepSpeed's launcher passes configs that way).
"""

from __future__ import annotations

import base64
import json
import os
from typing import Any

import torch.distributed as dist

from angelptm.config.loader import parse_config_text
from angelptm.runtime.precision_config import get_bfloat16_config, get_float16_config
from angelptm.runtime.zero.config import ZeroStageEnum, get_zero_config

ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER = "adagrad", "adam", "adamw"
LAMB_OPTIMIZER, ONEBIT_ADAM_OPTIMIZER, ZERO_ONE_ADAM_OPTIMIZER = "lamb", "onebitadam", "zerooneadam"
ONEBIT_LAMB_OPTIMIZER, LION_OPTIMIZER, MUADAM_OPTIMIZER = "onebitlamb", "lion", "muadam"
MUADAMW_OPTIMIZER, MUSGD_OPTIMIZER, MUON_OPTIMIZER = "muadamw", "musgd", "muon"
TORCH_ADAM_PARAM, ADAM_W_MODE, ADAM_W_MODE_DEFAULT = "torch_adam", "adam_w_mode", True
DEEPSPEED_OPTIMIZERS = [ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER, ONEBIT_ADAM_OPTIMIZER,
                        ONEBIT_LAMB_OPTIMIZER, ZERO_ONE_ADAM_OPTIMIZER, LION_OPTIMIZER, MUADAM_OPTIMIZER,
                        MUADAMW_OPTIMIZER, MUSGD_OPTIMIZER, MUON_OPTIMIZER]
GRADIENT_ALLREDUCE_OP, GRADIENT_ALLREDUCE_OPS = "gradient_allreduce_op", ("mean", "sum")


def read_config(config: str | dict) -> dict[str, Any]:
    """The raw dict of a config given as a dict, a file path (JSON or hjson) or base64 text, as DeepSpeed reads it.

    Raises:
        ValueError: a key given twice in a file, or a string that is neither an existing path nor base64.
    """
    if isinstance(config, dict):
        return config
    if os.path.exists(config):
        with open(config) as handle:
            text = handle.read()
        return _parse_text(text)
    try:
        return _parse_text(base64.urlsafe_b64decode(config).decode("utf-8"))
    except (UnicodeDecodeError, AttributeError, ValueError):
        raise ValueError(f"expected a path to an existing DeepSpeed config, a dict, or base64 of one; got "
                         f"{config!r}") from None


def _parse_text(text: str) -> dict[str, Any]:
    """JSON, else hjson; both refuse duplicate keys (``ValueError``, as DeepSpeed)."""
    return parse_config_text(text)


class DeepSpeedConfig:
    """DeepSpeed's reading of a config (see the module docstring).

    Args:
        config: a dict, a path to a JSON/hjson file, or base64 of one.
        mpu: a model-parallel unit whose ``get_data_parallel_world_size()`` gives the world size; None: the
            default process group's size (1 without one).
        mesh_device: accepted for DeepSpeed's signature; must be None (no device meshes here).
    """

    def __init__(self, config: str | dict, mpu: Any = None, mesh_device: Any = None) -> None:
        if mesh_device is not None:
            raise NotImplementedError("DeepSpeedConfig(mesh_device=...) (tensor/sequence parallel meshes) is not "
                                      "supported by angelptm; leave it None")
        self._param_dict = read_config(config)
        self.global_rank = dist.get_rank() if dist.is_initialized() else 0
        if mpu is not None:
            self.world_size = mpu.get_data_parallel_world_size()
        else:
            self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self._initialize_params(self._param_dict)
        self._configure_train_batch_size()
        self._do_sanity_check()

    def _initialize_params(self, params: dict[str, Any]) -> None:
        self.train_batch_size = params.get("train_batch_size")
        self.train_micro_batch_size_per_gpu = params.get("train_micro_batch_size_per_gpu")
        self.gradient_accumulation_steps = params.get("gradient_accumulation_steps")
        self.steps_per_print = params.get("steps_per_print", 10)
        self.dump_state = params.get("dump_state", False)
        self.disable_allgather = params.get("disable_allgather", False)
        self.communication_data_type = params.get("communication_data_type")
        self.seq_parallel_communication_data_type = params.get("seq_parallel_communication_data_type", "fp32")
        self.prescale_gradients = params.get("prescale_gradients", False)
        self.gradient_predivide_factor = params.get("gradient_predivide_factor", 1.0)
        self.sparse_gradients_enabled = params.get("sparse_gradients", False)
        self.gradient_allreduce_op = _allreduce_op(params.get(GRADIENT_ALLREDUCE_OP, "mean"))
        self.zero_config = get_zero_config(params)
        self.zero_optimization_stage = self.zero_config.stage
        self.zero_enabled = self.zero_optimization_stage > 0
        self.zero_allow_untested_optimizer = params.get("zero_allow_untested_optimizer", False)
        self.zero_force_ds_cpu_optimizer = params.get("zero_force_ds_cpu_optimizer", True)
        self.float16_config = get_float16_config(params)
        self.bfloat16_config = get_bfloat16_config(params)
        assert not (self.float16_config.enabled and self.bfloat16_config.enabled), \
            "bf16 and fp16 modes cannot be simultaneously enabled"
        self.fp16_enabled = self.float16_config.enabled
        self.fp16_auto_cast = self.float16_config.auto_cast
        self.bfloat16_enabled = self.bfloat16_config.enabled
        self.loss_scale = self.float16_config.loss_scale
        self.initial_dynamic_scale = self.float16_config.initial_dynamic_scale()
        self.dynamic_loss_scale_args = self.float16_config.dynamic_loss_scale_args()
        self.amp_enabled = (params.get("amp") or {}).get("enabled", False)
        self.gradient_clipping = params.get("gradient_clipping", 1.0)
        self._optimizer_and_scheduler(params)
        self.wall_clock_breakdown = params.get("wall_clock_breakdown", False) or params.get("flops_profiler", {}).get(
            "enabled", False)
        self.memory_breakdown = params.get("memory_breakdown", False)
        self.seed = params.get("seed")
        self.dataloader_drop_last = params.get("dataloader_drop_last", False)
        eigenvalue = params.get("eigenvalue") or {}
        self.eigenvalue_enabled = bool(eigenvalue.get("enabled", False))
        self.eigenvalue_verbose = bool(eigenvalue.get("verbose", False))
        self.compile_deepcompile = bool((params.get("compile") or {}).get("deepcompile", False))
        self.checkpoint_tag_validation_enabled = (params.get("checkpoint") or {}).get("tag_validation",
                                                                                      "Warn") != "Ignore"

    def _optimizer_and_scheduler(self, params: dict[str, Any]) -> None:
        optimizer = params.get("optimizer") or {}
        name = optimizer.get("type")
        # DeepSpeed lower-cases its own optimizers' names and keeps a client type's spelling.
        self.optimizer_name = name.lower() if isinstance(name, str) and name.lower() in DEEPSPEED_OPTIMIZERS else name
        self.optimizer_params = optimizer.get("params")
        self.optimizer_legacy_fusion = optimizer.get("legacy_fusion", False)
        scheduler = params.get("scheduler") or {}
        self.scheduler_name = scheduler.get("type")
        self.scheduler_params = scheduler.get("params")

    def _batch_assertion(self) -> None:
        train, micro, accumulation = (self.train_batch_size, self.train_micro_batch_size_per_gpu,
                                      self.gradient_accumulation_steps)
        assert train > 0, f"Train batch size: {train} has to be greater than 0"
        assert micro > 0, f"Micro batch size per gpu: {micro} has to be greater than 0"
        assert accumulation > 0, f"Gradient accumulation steps: {accumulation} has to be greater than 0"
        assert train == micro * accumulation * self.world_size, (
            f"Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * "
            f"gradient_acc_step * world_size {train} != {micro} * {accumulation} * {self.world_size}")

    def _configure_train_batch_size(self) -> None:
        """Fill the missing member of the batch triple as DeepSpeed does (floor division), then check the triple.

        Raises:
            AssertionError: neither batch size given, or a triple that does not multiply out.
        """
        train, micro, accumulation = (self.train_batch_size, self.train_micro_batch_size_per_gpu,
                                      self.gradient_accumulation_steps)
        world = self.world_size
        if train is not None and micro is not None and accumulation is not None:
            pass
        elif train is not None and micro is not None:
            accumulation = train // micro // world
        elif train is not None and accumulation is not None:
            micro = train // world // accumulation
        elif micro is not None and accumulation is not None:
            train = micro * accumulation * world
        elif train is not None:
            accumulation, micro = 1, train // world
        elif micro is not None:
            accumulation, train = 1, micro * world
        else:
            assert False, "Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided"
        self.train_batch_size, self.train_micro_batch_size_per_gpu = train, micro
        self.gradient_accumulation_steps = accumulation
        self._batch_assertion()

    def _do_sanity_check(self) -> None:
        assert self.train_micro_batch_size_per_gpu, "DeepSpeedConfig: train_micro_batch_size_per_gpu is not defined"
        assert self.gradient_accumulation_steps, "DeepSpeedConfig: gradient_accumulation_steps is not defined"
        if self.zero_enabled:
            assert self.zero_optimization_stage <= ZeroStageEnum.max_stage, \
                f"DeepSpeedConfig: Maximum supported ZeRO stage is {ZeroStageEnum.max_stage}"
        if self.gradient_allreduce_op == "sum":
            for refused, why in ((self.zero_optimization_stage == ZeroStageEnum.weights, "ZeRO stage 3"),
                                 (self.zero_config.zenflow is not None, "ZenFlow"),
                                 (self.compile_deepcompile, "DeepCompile")):
                if refused:
                    raise ValueError(f"{GRADIENT_ALLREDUCE_OP}='sum' is not supported with {why}")

    def print_user_config(self) -> None:
        print(json.dumps(self._param_dict, sort_keys=True, indent=4, default=str))

    def print(self, name: str) -> None:
        print(f"{name}:")
        for key in sorted(vars(self)):
            if key != "_param_dict":
                print(f"  {key} {'.' * (29 - len(key))} {getattr(self, key)}")
        self.print_user_config()


def _allreduce_op(value: Any) -> str:
    op = value.lower() if isinstance(value, str) else value
    if op not in GRADIENT_ALLREDUCE_OPS:
        raise ValueError(f"Invalid {GRADIENT_ALLREDUCE_OP} {value!r}: use one of {list(GRADIENT_ALLREDUCE_OPS)}")
    return op
