"""What a checkpoint records about the model's architecture, so offline tools can rebuild the model.

``python -m angelptm.export --hf`` writes a Hugging Face directory from the checkpoint files alone,
and ``config.json`` needs more than the weights: the architecture. :func:`describe` turns the
trained module into plain JSON text inside a dict, because checkpoint files are read with
``weights_only=True`` (``angelptm.checkpoint_pickle``) and a config object would need unsafe unpickling.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from torch import nn

TRANSFORMERS = "transformers"
"""``library`` of a ``transformers.PreTrainedModel``: ``config_json`` is its ``config.to_json_string()``."""

ANGELPTM_GPT = "angelptm.gpt"
"""``library`` of our reference :class:`angelptm.models.GPT`: ``config_json`` is its ``ModelConfig`` fields."""


def describe(module: nn.Module) -> dict[str, Any] | None:
    """The architecture of ``module`` as JSON-safe values, or None when it is neither kind above.

    Returns:
        ``{"library", "class_name", "config_json", "moe_enabled"}``: strings and a bool only.
    """
    from angelptm.models import GPT  # a sibling package; imported here to keep this module's import light

    if isinstance(module, GPT):
        return {"library": ANGELPTM_GPT, "class_name": type(module).__name__,
                "config_json": json.dumps(dataclasses.asdict(module.config), sort_keys=True),
                "moe_enabled": module.moe_config is not None}
    config = getattr(module, "config", None)
    # Duck-typed so that saving a checkpoint never imports transformers.
    if config is not None and callable(getattr(config, "to_json_string", None)) and _is_pretrained_model(module):
        return {"library": TRANSFORMERS, "class_name": type(module).__name__,
                "config_json": config.to_json_string(use_diff=False), "moe_enabled": False}
    return None


def _is_pretrained_model(module: nn.Module) -> bool:
    """Whether ``module`` subclasses ``transformers.PreTrainedModel`` (read from its MRO, without importing it)."""
    return any(cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers.")
               for cls in type(module).__mro__)
