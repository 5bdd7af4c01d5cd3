"""docs/deepspeed-compatibility.md's "Every DeepSpeed 0.19.8 config key" names every key of the installed DeepSpeed.

The keys are read from DeepSpeed at test time: its pydantic config models, walked recursively (a field's name and
its alias are both keys: DeepSpeed reads either), the key constants of the sections it parses without a model, and
its own lists of removed keys. A DeepSpeed upgrade that adds a key fails here until the table says what the key
does. Each model key also loads here at DeepSpeed's default value: none is refused as unknown.
"""

from __future__ import annotations

import enum
import importlib
import logging
import pathlib
import re
import types
import typing
from pathlib import Path
from typing import Any, Iterator

import pydantic
import pytest
import torch

from angelptm.config import load_config

deepspeed_config = pytest.importorskip("deepspeed.runtime.config")

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "deepspeed-compatibility.md"
HEADING = "## Every DeepSpeed 0.19.8 config key"

MODELS = {
    "zero_optimization": ("deepspeed.runtime.zero.config", "DeepSpeedZeroConfig"),
    "fp16": ("deepspeed.runtime.precision_config", "DeepSpeedFP16Config"),
    "bf16": ("deepspeed.runtime.precision_config", "DeepSpeedBF16Config"),
    "tensorboard": ("deepspeed.monitor.config", "TensorBoardConfig"),
    "wandb": ("deepspeed.monitor.config", "WandbConfig"),
    "csv_monitor": ("deepspeed.monitor.config", "CSVConfig"),
    "comet": ("deepspeed.monitor.config", "CometConfig"),
    "comms_logger": ("deepspeed.comm.config", "CommsLoggerConfig"),
    "compile": ("deepspeed.compile.config", "CompileConfig"),
    "tensor_parallel": ("deepspeed.runtime.tensor_parallel.config", "TPTrainingConfig"),
    "hybrid_engine": ("deepspeed.runtime.config", "HybridEngineConfig"),
    "weight_quantization": ("deepspeed.inference.config", "WeightQuantConfig"),
}
"""Top-level key -> DeepSpeed's pydantic model of that section (``DeepSpeedConfig._initialize_params`` and
``__init__`` build each from ``param_dict[key]``)."""

CONSTANTS = {
    "deepspeed.runtime.constants": (
        "TRAIN_BATCH_SIZE", "TRAIN_MICRO_BATCH_SIZE_PER_GPU", "GRADIENT_ACCUMULATION_STEPS",
        "MANAGED_GRADIENT_ACCUMULATION", "STEPS_PER_PRINT", "DUMP_STATE", "DISABLE_PYTHON_GC", "DISABLE_ALLGATHER",
        "COMMUNICATION_DATA_TYPE", "SEQ_PARALLEL_COMMUNICATION_DATA_TYPE", "PRESCALE_GRADIENTS",
        "GRADIENT_PREDIVIDE_FACTOR", "GRADIENT_ALLREDUCE_OP", "GRADIENT_CLIPPING", "OPTIMIZER", "SCHEDULER",
        "ZERO_ALLOW_UNTESTED_OPTIMIZER", "ZERO_FORCE_DS_CPU_OPTIMIZER", "WALL_CLOCK_BREAKDOWN", "MEMORY_BREAKDOWN",
        "USE_DATA_BEFORE_EXPERT_PARALLEL", "CHECKPOINT", "DATA_TYPES", "DATALOADER_DROP_LAST", "LOG_LEVEL",
        "VOCABULARY_SIZE", "BFLOAT16", "BFLOAT16_OLD", "FP16", "TORCH_AUTOCAST"),
    "deepspeed.runtime.zero.config": ("ZERO_OPTIMIZATION",),
    "deepspeed.runtime.activation_checkpointing.config": ("ACT_CHKPT",),
    "deepspeed.profiling.constants": ("FLOPS_PROFILER",),
    "deepspeed.autotuning.constants": ("AUTOTUNING",),
    "deepspeed.runtime.data_pipeline.constants": ("DATA_EFFICIENCY",),
    "deepspeed.runtime.swap_tensor.constants": ("AIO",),
    "deepspeed.utils.config": ("TIMERS",),
    "deepspeed.datastates.config": ("DATASTATES_CHECKPOINTING",),
    "deepspeed.runtime.config": ("EXPERT_PARALLEL",),
    "deepspeed.comm.constants": ("COMMS_LOGGER",),
}
"""Module -> the names of its top-level key constants, for the keys DeepSpeed reads without a model."""

SUBKEYS = (
    ("torch_autocast", "deepspeed.runtime.constants", ("TORCH_AUTOCAST_ENABLED", "TORCH_AUTOCAST_DTYPE",
                                                       "TORCH_AUTOCAST_LOWER_PRECISION_SAFE_MODULES")),
    ("optimizer", "deepspeed.runtime.constants", ("TYPE", "OPTIMIZER_PARAMS", "LEGACY_FUSION")),
    ("optimizer.params", "deepspeed.runtime.constants", ("MAX_GRAD_NORM",)),
    ("optimizer.params", "deepspeed.runtime.config", ("TORCH_ADAM_PARAM", "ADAM_W_MODE")),
    ("scheduler", "deepspeed.runtime.constants", ("TYPE", "SCHEDULER_PARAMS")),
    ("aio", "deepspeed.runtime.swap_tensor.constants", ("AIO_BLOCK_SIZE", "AIO_QUEUE_DEPTH", "AIO_INTRA_OP_PARALLELISM",
                                                        "AIO_SINGLE_SUBMIT", "AIO_OVERLAP_EVENTS", "AIO_USE_GDS")),
)
"""(Section, module, names of the constants of the keys DeepSpeed reads inside that section without a model)."""

LITERAL_KEYS = ("pipeline", "sequence_parallel_size", "optimizer.params.fp32_optimizer_states")
"""Keys DeepSpeed reads by a string literal, not a constant (``get_pipeline_config``, ``DeepSpeedConfig.__init__``,
``get_optimizer_configuration``)."""


def _nested_model(annotation: Any) -> type[pydantic.BaseModel] | None:
    members = (typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType)
               else (annotation,))
    return next((m for m in members if isinstance(m, type) and issubclass(m, pydantic.BaseModel)), None)


def model_keys(model: type[pydantic.BaseModel], prefix: str) -> Iterator[tuple[str, pydantic.fields.FieldInfo]]:
    """Every key of ``model``, recursively: the field's alias and its name (DeepSpeed reads either)."""
    for name, info in model.model_fields.items():
        spellings = dict.fromkeys([info.alias or name, name])
        for spelled in spellings:
            yield f"{prefix}{spelled}", info
            nested = _nested_model(info.annotation)
            if nested is not None:
                yield from model_keys(nested, f"{prefix}{spelled}.")


def pydantic_keys() -> list[tuple[str, pydantic.fields.FieldInfo]]:
    keys = []
    for section, (module, name) in MODELS.items():
        keys += list(model_keys(getattr(importlib.import_module(module), name), f"{section}."))
    return keys


def deepspeed_keys() -> set[str]:
    """Every key of the installed DeepSpeed's config, as a dotted path."""
    keys = {key for key, _ in pydantic_keys()} | set(MODELS) | set(LITERAL_KEYS)
    for module, names in CONSTANTS.items():
        keys |= {getattr(importlib.import_module(module), name) for name in names}
    for section, module, names in SUBKEYS:
        keys |= {f"{section}.{getattr(importlib.import_module(module), name)}" for name in names}
    keys |= set(deepspeed_config._REMOVED_TOP_LEVEL_CONFIG_KEYS)
    keys |= {f"zero_optimization.{key}" for key in deepspeed_config._REMOVED_ZERO_CONFIG_KEYS}
    return keys


def table_keys() -> set[str]:
    """The keys named in the first column of the page's table."""
    text = PAGE.read_text()
    assert HEADING in text, f"{PAGE.name} has no section {HEADING!r}"
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return {key for row in rows for key in re.findall(r"`([^`]+)`", row.split(" | ", 1)[0])}


def test_every_deepspeed_key_is_in_the_table():
    missing = sorted(deepspeed_keys() - table_keys())
    assert not missing, (f"DeepSpeed keys that {PAGE.name} ({HEADING!r}) does not name: {missing}; add each with "
                         "what it does here (acted on, mapped, no effect, or refused with the reason)")


def test_the_table_names_no_key_deepspeed_lacks():
    extra = sorted(table_keys() - deepspeed_keys())
    assert not extra, f"{PAGE.name} names keys the installed DeepSpeed does not have: {extra}"


def _json_default(info: pydantic.fields.FieldInfo) -> Any:
    value = info.get_default(call_default_factory=True)
    if isinstance(value, pydantic.BaseModel):
        return {}
    if isinstance(value, enum.Enum):
        return value.value if isinstance(value.value, (int, str)) else value.name
    if isinstance(value, (pathlib.Path, torch.dtype)):
        return str(value)
    return value


@pytest.fixture
def quiet():
    logging.disable(logging.WARNING)  # the deprecated keys' and "no effect" warnings
    yield
    logging.disable(logging.NOTSET)


def test_every_deepspeed_model_key_loads_at_deepspeeds_default(quiet):
    """One key at a time, as a config would set it: none is refused as unknown (or at DeepSpeed's own default)."""
    failures = []
    for key, info in pydantic_keys():
        config: dict[str, Any] = {"train_batch_size": 1}
        node = config
        *sections, last = key.split(".")
        for section in sections:
            node = node.setdefault(section, {})
        node[last] = _json_default(info)
        try:
            load_config(config, device_type="cpu")
        except ValueError as err:
            failures.append(f"{key} = {node[last]!r}: {str(err).splitlines()[-1].strip()}")
    assert not failures, "\n".join(failures)
