"""Write docs/configuration.md, the config reference, from the config models themselves.

Every key a JSON config may hold is a field of a pydantic section of the JSON edge
(``angelptm.config.edge.EdgeConfig``) or of a typed dataclass that a package owns (``zero_cache``, ``moe``,
``autopipe``, ``model``, ``data``, ``train``, ``comms``). This script walks that tree and writes, per section, each
key's type (as written in the source), default and description. Descriptions are the attribute docstrings under
each field (the project's style, DESIGN: "a docstring under each field"), read from the source with ``ast``; a
DeepSpeed key without one says so, and its section's note (below) says what the section does here.

Usage::

    python tools/config_reference.py            # rewrite docs/configuration.md
    python tools/config_reference.py --check    # exit 1 if docs/configuration.md is stale

The output depends only on the source: same code, same bytes (``tests/unit/test_config_reference.py`` checks
the committed file against it).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "docs" / "configuration.md"
REGENERATE = "python tools/config_reference.py"

if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

# What a section does here, where its class has no docstring that says it (moved from the README's hand-written
# config reference, which this page replaces). Keyed by the section's path in the JSON.
SECTION_NOTES: dict[str, str] = {
    "": (
        "DeepSpeed keys keep DeepSpeed's names, defaults and semantics. An unknown key is an error that names "
        "the key and the closest valid one; a DeepSpeed key that is accepted but has no effect yet is listed once "
        "in a warning (the list is at the end of this page). `train_batch_size`, `train_micro_batch_size_per_gpu` "
        "and `gradient_accumulation_steps`: any two give the third (train = micro x accumulation x ranks); "
        "inconsistent values are an error showing the arithmetic. `seed` seeds python, numpy and torch at "
        "`initialize()`, and the data order."),
    "optimizer": (
        "`Adam` (decoupled weight decay unless `adam_w_mode: false`) or `AdamW`. On a CPU it steps through "
        "DeepSpeed's own C++ Adam, as DeepSpeed's FusedAdam does there (the same weights, bit for bit); "
        "`torch_adam: true` steps torch's Adam/AdamW instead; fused torch AdamW on a GPU. "
        "Under ZeRO-Cache the engine runs its own hybrid CPU/GPU Adam from these hyperparameters."),
    "scheduler": (
        "`WarmupLR`, `WarmupDecayLR`, `WarmupCosineLR`, `OneCycle`, `LRRangeTest`, with DeepSpeed's formulas "
        "(tested against DeepSpeed's own). `params` is checked against the type's parameters, listed below."),
    "fp16": (
        "fp16 with DeepSpeed's dynamic loss scaling: an overflow skips the step, lowers the scale, and is logged. "
        "No `bf16`/`fp16` section means fp32 on every device, as in DeepSpeed."),
    "bf16": (
        "bf16 module, fp32 master weights and fp32 gradient accumulation (alias `bfloat16`). `\"auto\"` (ours): "
        "bf16 where the device computes it natively, else fp32; see [deepspeed-compatibility.md]"
        "(deepspeed-compatibility.md#precision-by-device)."),
    "zero_optimization": (
        "Parsed and validated. `reduce_bucket_size` sizes the all-reduce buckets of the replicated path. With "
        "ZeRO-Cache, `overlap_comm`, `stage3_prefetch_bucket_size` and `stage3_max_live_parameters` become "
        "`zero_cache.overlap_comm`, `gather_ahead_elements` and `max_live_elements` (a value below ZeRO-Cache's "
        "default is raised to it with a log line, since it could only slow the step; the `zero_cache` keys force a "
        "value). `offload_param`/`offload_optimizer` allow those tiers, and the plan decides: ZeRO-3 with an "
        "offload device turns ZeRO-Cache on, an `nvme` device's `nvme_path` becomes `zero_cache.nvme_path`, and "
        "`offload_param: {device: nvme}` also sets `zero_cache.nvme_param_homes`. "
        "`stage3_gather_16bit_weights_on_model_save` is `true` at either value: `save_16bit_model` always gathers "
        "and writes the whole 16-bit weights (with stage 3, `false`, where DeepSpeed writes none, is named in a "
        "start-up line). The other `stage3_*` keys are listed as having no effect."),
    "zero_optimization.offload_param": (
        "A permission for the planner, not a placement. `pin_memory`, `buffer_count`, `buffer_size` and "
        "`max_in_cpu` have no effect: the tiers are always pinned and the slots follow from the plan."),
    "zero_optimization.offload_optimizer": "A permission for the planner, not a placement.",
    "aio": (
        "The NVMe tier's IO (copied into `zero_cache.aio`); listed as having no effect when no NVMe tier is "
        "configured. `use_gds` is never used. Each key's meaning is under `zero_cache.aio` below."),
    "tensorboard": ("A metric sink (`pip install -e \".[tensorboard]\"` for TensorBoard); "
                    "events go under `output_path`."),
    "csv_monitor": "A metric sink: a CSV of the metrics under `output_path`.",
    "wandb": "Accepted so that DeepSpeed configs load; not acted on.",
    "zero_cache": (
        "See [zero-cache.md](zero-cache.md). Budgets take \"2GB\", a number of bytes or \"auto\": an \"auto\" host "
        "budget, and an \"auto\" `nvme_memory_budget` (the free space less 2%), are split between the ranks of a host. "
        "`overlap_optimizer_step` was removed (see retired keys below)."),
    "moe": "See [moe.md](moe.md).",
    "autopipe": "See [autopipe.md](autopipe.md).",
    "comms": "See [checkpoints.md](checkpoints.md#reliability) for what the heartbeat does.",
}

@dataclasses.dataclass(frozen=True)
class Key:
    name: str
    alias: str | None
    type_text: str
    default: str
    doc: str


def _is_section(annotation: Any) -> type | None:
    """The model or dataclass a field's annotation names (through ``X | None``), or None for a plain value."""
    from pydantic import BaseModel

    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    members = typing.get_args(annotation) if union else (annotation,)
    for member in members:
        if isinstance(member, type) and (issubclass(member, BaseModel) or dataclasses.is_dataclass(member)):
            return member
    return None


@functools.lru_cache(maxsize=None)
def _class_source(cls: type) -> tuple[dict[str, str], dict[str, str]]:
    """(field name -> annotation text, field name -> attribute docstring) of the class body itself."""
    tree = ast.parse(Path(inspect.getsourcefile(cls)).read_text())
    node = next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__), None)
    types_: dict[str, str] = {}
    docs: dict[str, str] = {}
    if node is None:
        return types_, docs
    body = node.body
    for i, stmt in enumerate(body):
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            name = stmt.target.id
            types_[name] = ast.unparse(stmt.annotation)
            following = body[i + 1] if i + 1 < len(body) else None
            if (isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)):
                docs[name] = inspect.cleandoc(following.value.value)
    return types_, docs


def _source_of(cls: type, name: str) -> tuple[str, str]:
    """The annotation text and docstring of ``name``, from the first class in the MRO that declares it."""
    for klass in cls.__mro__:
        if klass is object:
            continue
        try:
            types_, docs = _class_source(klass)
        except (TypeError, OSError):
            continue
        if name in types_:
            return types_[name], docs.get(name, "")
    return "", ""


def _value(value: Any) -> str:
    """A default as it would be written in the JSON."""
    if isinstance(value, tuple):
        value = list(value)
    try:
        return json.dumps(value)
    except TypeError:
        return str(value)


def _default_of_factory(factory: Any) -> str:
    if isinstance(factory, type) and _is_section(factory):
        return "(section)"
    value = factory()
    return "{}" if value == {} else _value(value)


def _keys(cls: type) -> Iterator[tuple[Key, type | None]]:
    """Each key of a section in declaration order, with the section class it opens (if any)."""
    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined

    if issubclass(cls, BaseModel):
        hints = typing.get_type_hints(cls)
        for name, info in cls.model_fields.items():
            type_text, doc = _source_of(cls, name)
            if info.default is not PydanticUndefined:
                default = _value(info.default)
            elif info.default_factory is not None:
                default = _default_of_factory(info.default_factory)
            else:
                default = "required"
            yield Key(name, info.alias, type_text, default, doc or info.description or ""), _is_section(hints.get(name))
        return
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        type_text, doc = _source_of(cls, field.name)
        if field.default is not dataclasses.MISSING:
            default = _value(field.default)
        elif field.default_factory is not dataclasses.MISSING:
            default = _default_of_factory(field.default_factory)
        else:
            default = "required"
        yield Key(field.name, None, type_text, default, doc), _is_section(hints.get(field.name))


def _class_doc(cls: type) -> str:
    doc = cls.__dict__.get("__doc__") or ""
    if not doc or doc.startswith(cls.__name__ + "("):  # dataclasses' generated signature
        return ""
    return inspect.cleandoc(doc)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _table(rows: list[Key]) -> list[str]:
    lines = ["| key | type | default | description |", "|---|---|---|---|"]
    for key in rows:
        name = f"`{key.name}`" + (f" (alias `{key.alias}`)" if key.alias and key.alias != key.name else "")
        doc = key.doc or "DeepSpeed's key, with DeepSpeed's meaning."
        lines.append(f"| {name} | `{_cell(key.type_text)}` | `{_cell(key.default)}` | {_cell(doc)} |")
    return lines


def _section(path: str, cls: type, out: list[str]) -> None:
    """Append ``path``'s table, then its nested sections' (depth first, declaration order)."""
    scalars: list[Key] = []
    nested: list[tuple[str, type]] = []
    for key, section in _keys(cls):
        if section is not None:
            nested.append((f"{path}.{key.name}" if path else key.name, section))
        else:
            scalars.append(key)
    title = f"`{path}`" if path else "Top level"
    out += [f"{'##' if path.count('.') == 0 else '###'} {title}", ""]
    out += [f"Model: `{cls.__module__}.{cls.__qualname__}`.", ""]
    for text in (_class_doc(cls), SECTION_NOTES.get(path, "")):
        if text:
            out += [" ".join(text.split()), ""]
    if scalars:
        out += _table(scalars) + [""]
    if path == "scheduler":
        _scheduler_params(out)
    for child_path, child in nested:
        _section(child_path, child, out)


def _scheduler_params(out: list[str]) -> None:
    from angelptm.config.edge import SCHEDULER_PARAMS

    for name, params in SCHEDULER_PARAMS.items():
        out += [f"### `scheduler.params` for `\"type\": \"{name}\"`", ""]
        out += [f"Model: `{params.__module__}.{params.__qualname__}`.", ""]
        doc = _class_doc(params)
        if doc:
            out += [" ".join(doc.split()), ""]
        out += _table([key for key, _ in _keys(params)]) + [""]


def _tail(out: list[str]) -> None:
    from angelptm.config.edge import ACCEPTED_NOT_ACTED, DEPRECATED_KEYS, RETIRED_KEYS

    out += ["## Deprecated keys", "",
            "Read with DeepSpeed's meaning and a warning naming the key to write instead "
            "(`angelptm.config.edge.DEPRECATED_KEYS`). The pre-0.3 form `\"zero_optimization\": true` is read as "
            "stage 1 with the top-level `allgather_size` as its bucket.", "",
            "| deprecated key | write instead |", "|---|---|"]
    for key in DEPRECATED_KEYS:
        section = key.path.split(".")[0]
        out.append(f"| `{key.path}` | `{section}.{key.new_key}` |")
    out += ["", "## Retired keys", "", "Refused with the reason (`angelptm.config.edge.RETIRED_KEYS`).", "",
            "| key | why |", "|---|---|"]
    for path, why in sorted(RETIRED_KEYS.items()):
        out.append(f"| `{path}` | {_cell(why)} |")
    out += ["", "## Accepted without effect", "",
            "These DeepSpeed keys load, so a DeepSpeed config runs unchanged, and are listed once in a warning "
            "(`angelptm.config.edge.ACCEPTED_NOT_ACTED`):", "",
            ", ".join(f"`{name}`" for name in sorted(ACCEPTED_NOT_ACTED)), ""]


def render() -> str:
    """The whole of docs/configuration.md."""
    from angelptm.config.edge import EdgeConfig

    out = ["# Configuration reference", "",
           f"<!-- Generated by `{REGENERATE}` from the config models; do not edit by hand. -->", "",
           "One JSON file configures everything: DeepSpeed's keys and our own sections (`zero_cache`, `moe`, "
           "`autopipe`, `model`, `data`, `train`, `comms`). It is parsed once at the edge "
           "(`angelptm/config/edge.py`, pydantic, unknown keys rejected) and converted to typed dataclasses; the "
           "tables below are read from those models: each key's type as written in the source, its default as "
           "JSON, and the docstring under the field. `configs/tiny.json` is the default job.", ""]
    _section("", EdgeConfig, out)
    _tail(out)
    while out and out[-1] == "":
        out.pop()
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed file differs")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current != text:
            print(f"{args.output} is stale; run: {REGENERATE}", file=sys.stderr)
            return 1
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
