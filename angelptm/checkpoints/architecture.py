"""What a checkpoint records about the model's architecture, so offline tools can rebuild the model.

``python -m angelptm.checkpoints.export --hf`` writes a Hugging Face directory from the checkpoint files alone,
and ``config.json`` needs more than the weights: the architecture. :func:`describe` turns the
trained module into plain JSON text inside a dict, because checkpoint files are read with
``weights_only=True`` (``angelptm.checkpoints.safe_pickle``) and a config object would need unsafe unpickling.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from torch import nn

TRANSFORMERS = "transformers"
"""``library`` of a ``transformers.PreTrainedModel``: ``config_json`` is its ``config.to_json_string()``."""

ANGELPTM_GPT = "angelptm.gpt"
"""``library`` of our reference :class:`angelptm.pretraining.models.GPT`: ``config_json`` is its ``ModelConfig``
fields."""


def describe(module: nn.Module) -> dict[str, Any] | None:
    """The architecture of ``module`` as JSON-safe values, or None when it is neither kind above.

    Returns:
        ``{"library", "class_name", "config_json", "moe_enabled"}``: strings and a bool only.
    """
    from angelptm.pretraining.models import GPT  # a sibling package; imported here to keep this module's import light

    if isinstance(module, GPT):
        return gpt_record(module.config, moe_enabled=module.moe_config is not None, class_name=type(module).__name__)
    config = getattr(module, "config", None)
    # Duck-typed so that saving a checkpoint never imports transformers.
    if config is not None and callable(getattr(config, "to_json_string", None)) and _is_pretrained_model(module):
        return {"library": TRANSFORMERS, "class_name": type(module).__name__,
                "config_json": config.to_json_string(use_diff=False), "moe_enabled": False}
    return None


def gpt_record(config: Any, *, moe_enabled: bool = False, class_name: str = "GPT") -> dict[str, Any]:
    """The record :func:`describe` makes of our GPT, from its ``ModelConfig`` alone (AutoPipe saves stages, not the
    model)."""
    return {"library": ANGELPTM_GPT, "class_name": class_name,
            "config_json": json.dumps(dataclasses.asdict(config), sort_keys=True), "moe_enabled": moe_enabled}


def _is_pretrained_model(module: nn.Module) -> bool:
    """Whether ``module`` subclasses ``transformers.PreTrainedModel`` (read from its MRO, without importing it)."""
    return any(cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers.")
               for cls in type(module).__mro__)


GPT_TRAINING_ONLY = frozenset({"dropout", "activation_checkpointing", "init_std"})
"""``ModelConfig`` fields that change how the GPT trains, not what its weights mean: they may change on resume."""


def differences(saved: dict[str, Any] | None, current: dict[str, Any] | None) -> list[str]:
    """The architecture keys whose values differ between a checkpoint's record and the model now.

    Args:
        saved: the checkpoint's ``architecture`` entry (None: not recorded, nothing to compare).
        current: :func:`describe` of the model being loaded into (None: not a known kind).

    Returns:
        ``"key: saved X, now Y"`` for each differing key, sorted; empty when they agree or either is unknown.
        Settings that do not change what the weights mean (dropout, activation checkpointing, a transformers
        config's runtime flags) are not compared.
    """
    if not saved or not current:
        return []
    changed = [f"{key}: saved {saved.get(key)!r}, now {current.get(key)!r}"
               for key in ("library", "class_name", "moe_enabled") if saved.get(key) != current.get(key)]
    if changed:  # another kind of model: its config fields mean other things
        return changed
    was, now = _architecture_fields(saved), _architecture_fields(current)
    return [f"{key}: saved {was.get(key, '(absent)')!r}, now {now.get(key, '(absent)')!r}"
            for key in sorted(was.keys() | now.keys()) if was.get(key) != now.get(key)]


def _architecture_fields(record: dict[str, Any]) -> dict[str, Any]:
    """The config fields of a record that decide the weights' shapes and meaning."""
    try:
        fields = json.loads(record["config_json"])
    except (KeyError, TypeError, ValueError):
        return {}
    if record["library"] == ANGELPTM_GPT:
        if fields.get("position") != "learned":
            fields.pop("max_seq_len", None)  # rotary positions: no weights depend on it (a longer context is fine)
        return {key: value for key, value in fields.items() if key not in GPT_TRAINING_ONLY}
    return {key: value for key, value in fields.items() if not _transformers_runtime_key(key)}


def _transformers_runtime_key(key: str) -> bool:
    """A transformers config key that is a runtime or bookkeeping flag, not architecture."""
    return (key.startswith("_") or "dropout" in key or "pdrop" in key or key in {
        "transformers_version", "torch_dtype", "dtype", "use_cache", "output_attentions", "output_hidden_states",
        "return_dict", "gradient_checkpointing", "architectures", "initializer_range", "name_or_path",
        "attn_implementation", "use_return_dict", "pruned_heads", "problem_type"})
