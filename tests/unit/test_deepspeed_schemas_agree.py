"""DeepSpeed's sections are written twice; these tests hold the two writings together, key by key.

``angelptm.config.edge`` parses the user's JSON (strict: unknown keys, booleans for numbers and NaN are refused
before pydantic sees them); ``angelptm.runtime.precision_config`` and ``angelptm.runtime.zero.config`` are the
public ``deepspeed.runtime`` models that scripts and libraries build and read. Both must read a DeepSpeed config
alike: every key of one is a key of the other, with the same type (an enum is the literal of its values), the same
default and the same bounds, unless :data:`EDGE_RUNTIME_DIFFERENCES` says why not. The runtime models are held to
the installed DeepSpeed's the same way (:data:`RUNTIME_DEEPSPEED_DIFFERENCES`).
"""

from __future__ import annotations

import enum
import importlib
import types
import typing
from typing import Any, Literal

import annotated_types
import pydantic
import pytest

from angelptm.config import edge
from angelptm.runtime import precision_config, zero
from angelptm.runtime.zero.config import DeepSpeedZeroOffloadParamConfig

SECTIONS = {
    "fp16": (edge.FP16Section, precision_config.DeepSpeedFP16Config),
    "bf16": (edge.BF16Section, precision_config.DeepSpeedBF16Config),
    "zero_optimization": (edge.ZeroSection, zero.config.DeepSpeedZeroConfig),
}
"""Section -> (the edge's model, the public runtime model); nested sections (the offloads) are paired by key."""

EDGE_RUNTIME_DIFFERENCES = {
    # "auto" is ours: bf16 where the device computes it natively, else fp32 (angelptm.config.precision).
    "bf16.enabled": "type",
    # The edge passes the path on as the string zero_cache.nvme_path takes; DeepSpeed's model makes it a Path.
    "zero_optimization.offload_param.nvme_path": "type",
    "zero_optimization.offload_optimizer.nvme_path": "type",
    # The runtime model keeps DeepSpeed's nested ZenFlow and leaf-module sections as the dicts given (no script
    # reads their fields here); the edge validates their keys and bounds (both have no effect here).
    "zero_optimization.zenflow": "type",
    "zero_optimization.leaf_module": "type default",
}
"""``section.key`` -> the aspects ("key", "type", "default", "bounds") in which the edge and the runtime model may
differ, each with its reason. Anything else that differs fails :func:`test_edge_and_runtime_models_agree`."""

RUNTIME_DEEPSPEED_DIFFERENCES = {
    # Removed in DeepSpeed 0.19.8 (which refuses them); accepted so that configs of earlier versions load.
    "zero_optimization.mics_shard_size": "key",
    "zero_optimization.mics_hierarchical_params_gather": "key",
    "zero_optimization.zeropp_loco_param": "key",
    # As above: dicts here, DeepSpeed's ZenFlowConfig / DeepSpeedZeroLeafModuleConfig there.
    "zero_optimization.zenflow": "type",
    "zero_optimization.leaf_module": "type default",
}
"""As :data:`EDGE_RUNTIME_DIFFERENCES`, between the runtime models and the installed DeepSpeed's."""


def _normal_type(annotation: Any) -> Any:
    """A comparable form of a field's type: unions as sets, an enum as the literal of its values (the models store
    values: ``use_enum_values``), a nested section as "section", ``dict[...]`` as dict."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        members: set[Any] = set()
        for arg in typing.get_args(annotation):
            member = _normal_type(arg)
            members |= member if isinstance(member, frozenset) else {member}
        return frozenset(members)
    if origin is Literal:
        return frozenset(("literal", value) for value in typing.get_args(annotation))
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return frozenset(("literal", member.value) for member in annotation)
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return "section"
    if origin is dict:  # a free-form section: its keys are not checked on either side
        return dict
    if origin is not None:
        return (origin, tuple(_normal_type(arg) for arg in typing.get_args(annotation)))
    return annotation


def _normal_value(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, pydantic.BaseModel):
        return value.model_dump()
    return value


def _bounds(info: Any) -> dict[str, Any]:
    kinds = (annotated_types.Gt, annotated_types.Ge, annotated_types.Lt, annotated_types.Le)
    return {type(item).__name__: getattr(item, type(item).__name__.lower()) for item in info.metadata
            if isinstance(item, kinds)}


def _fields(model: type[pydantic.BaseModel]) -> dict[str, dict[str, Any]]:
    """JSON key (a field's alias where it has one: the ``stage3_*`` spelling) -> its aspects, deprecated fields left
    out (:func:`test_deprecated_keys_are_the_same` pairs those)."""
    fields = {}
    for name, info in model.model_fields.items():
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        if extra.get("deprecated"):
            continue
        fields[info.alias or name] = {
            "type": _normal_type(info.annotation),
            "default": "required" if info.is_required() else _normal_value(info.get_default(call_default_factory=True)),
            "bounds": _bounds(info),
            "nested": next((arg for arg in (info.annotation, *typing.get_args(info.annotation))
                            if isinstance(arg, type) and issubclass(arg, pydantic.BaseModel)), None),
        }
    return fields


def disagreements(path: str, ours: type[pydantic.BaseModel], theirs: type[pydantic.BaseModel],
                  allowed: dict[str, str]) -> list[str]:
    """Every aspect in which two models of one section differ and ``allowed`` does not allow, as
    ``"path.key: aspect: ours vs theirs"``; nested sections both model are compared the same way."""
    mine, other = _fields(ours), _fields(theirs)
    problems = []
    for key in sorted(set(mine) | set(other)):
        where = f"{path}.{key}"
        excused = allowed.get(where, "").split()
        if key not in mine or key not in other:
            if "key" not in excused:
                problems.append(f"{where}: key: only in {(ours if key in mine else theirs).__qualname__}")
            continue
        for aspect in ("type", "default", "bounds"):
            if mine[key][aspect] != other[key][aspect] and aspect not in excused:
                problems.append(f"{where}: {aspect}: {mine[key][aspect]!r} vs {other[key][aspect]!r}")
        if mine[key]["nested"] is not None and other[key]["nested"] is not None and "type" not in excused:
            problems += disagreements(where, mine[key]["nested"], other[key]["nested"], allowed)
    return problems


def test_edge_and_runtime_models_agree() -> None:
    problems = [problem for path, (ours, runtime) in SECTIONS.items()
                for problem in disagreements(path, ours, runtime, EDGE_RUNTIME_DIFFERENCES)]
    assert not problems, "the JSON edge and the deepspeed.runtime models disagree:\n  " + "\n  ".join(problems)


def test_a_disagreement_fails() -> None:
    """The comparison sees a changed default, a changed type, a changed bound and a missing key, and recurses into
    the offload sections."""

    class Changed(edge.OffloadParamSection):
        buffer_count: int = pydantic.Field(6, ge=1)
        pin_memory: bool | None = True
        extra_key: int = 0

    class Zero(edge.ZeroSection):
        offload_param: Changed | None = None

    problems = disagreements("zero_optimization", Zero, zero.config.DeepSpeedZeroConfig, EDGE_RUNTIME_DIFFERENCES)
    assert sorted(problems) == sorted([
        "zero_optimization.offload_param.buffer_count: default: 6 vs 5",
        "zero_optimization.offload_param.buffer_count: bounds: {'Ge': 1} vs {'Ge': 0}",
        "zero_optimization.offload_param.extra_key: key: only in "
        "test_a_disagreement_fails.<locals>.Changed",
        f"zero_optimization.offload_param.pin_memory: type: {frozenset({bool, type(None)})!r} vs {bool!r}",
    ]), problems


def test_every_allowed_difference_is_still_one() -> None:
    """An allow-list entry whose difference went away is removed, so the list says only what is true."""
    for path, aspects in EDGE_RUNTIME_DIFFERENCES.items():
        section, *keys = path.split(".")
        ours, runtime = SECTIONS[section]
        for key in keys[:-1]:
            ours, runtime = _fields(ours)[key]["nested"], _fields(runtime)[key]["nested"]
        for aspect in aspects.split():
            assert _fields(ours)[keys[-1]][aspect] != _fields(runtime)[keys[-1]][aspect], (path, aspect)


def test_deprecated_keys_are_the_same() -> None:
    """The runtime model's deprecated fields are the keys the edge upgrades (:data:`edge.DEPRECATED_KEYS`), each
    moved to the same key, or to none where DeepSpeed drops the value."""
    spelled = edge.FIELD_NAME_SPELLINGS["zero_optimization"]
    runtime = {}
    for name, info in zero.config.DeepSpeedZeroConfig.model_fields.items():
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        if extra.get("deprecated"):
            runtime[f"zero_optimization.{name}"] = (spelled.get(extra["new_param"], extra["new_param"])
                                                    if extra.get("set_new_param", True) else None)
    at_edge = {key.path: key.new_key if key.new_value is not None else None for key in edge.DEPRECATED_KEYS}
    assert runtime == at_edge


def test_stage3_spellings_are_the_runtime_models_aliases() -> None:
    """The edge reads ``prefetch_bucket_size`` as ``stage3_prefetch_bucket_size`` exactly where DeepSpeed's model
    has that alias (it reads a field by either name)."""
    aliases = {name: info.alias for name, info in zero.config.DeepSpeedZeroConfig.model_fields.items() if info.alias}
    assert edge.FIELD_NAME_SPELLINGS["zero_optimization"] == aliases


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_runtime_models_agree_with_the_installed_deepspeeds(section: str) -> None:
    pytest.importorskip("deepspeed")
    module, name = {"fp16": ("deepspeed.runtime.precision_config", "DeepSpeedFP16Config"),
                    "bf16": ("deepspeed.runtime.precision_config", "DeepSpeedBF16Config"),
                    "zero_optimization": ("deepspeed.runtime.zero.config", "DeepSpeedZeroConfig")}[section]
    theirs = getattr(importlib.import_module(module), name)
    problems = disagreements(section, SECTIONS[section][1], theirs, RUNTIME_DEEPSPEED_DIFFERENCES)
    assert not problems, "the deepspeed.runtime models and DeepSpeed's disagree:\n  " + "\n  ".join(problems)


def test_the_three_defaults_that_differed_are_deepspeeds() -> None:
    """``fp16.min_loss_scale`` (an integer), the offloads' ``pin_memory`` (true) and ``buffer_count`` (5 for params,
    4 for the optimizer), read from a loaded config's models as from the public ones."""
    parsed = edge.EdgeConfig.model_validate({"zero_optimization": {"offload_param": {}, "offload_optimizer": {}}})
    public = zero.config.get_zero_config({"zero_optimization": {"offload_param": {}, "offload_optimizer": {}}})
    assert parsed.fp16.min_loss_scale == precision_config.get_float16_config({}).min_loss_scale == 1
    assert type(parsed.fp16.min_loss_scale) is int
    for section in ("offload_param", "offload_optimizer"):
        ours, theirs = getattr(parsed.zero_optimization, section), getattr(public, section)
        assert (ours.pin_memory, ours.buffer_count) == (theirs.pin_memory, theirs.buffer_count)
    assert (parsed.zero_optimization.offload_param.buffer_count,
            parsed.zero_optimization.offload_optimizer.buffer_count) == (5, 4)
    assert isinstance(public.offload_param, DeepSpeedZeroOffloadParamConfig)
