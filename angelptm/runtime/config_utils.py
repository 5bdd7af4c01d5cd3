"""``deepspeed.runtime.config_utils``: ``DeepSpeedConfigModel``, the pydantic base of DeepSpeed's config sections.

Its behaviour, which DeepSpeed's config classes and scripts' own subclasses rely on:

* unknown keys are refused (``extra="forbid"``), assignments are validated, enums keep their values;
* a field may be given by its name or its alias (``stage3_prefetch_bucket_size`` for ``prefetch_bucket_size``);
* ``"auto"`` given for a field means its default (DeepSpeed leaves "auto" for HF integrations to fill; a
  model built with ``strict=True`` keeps them and fails validation instead);
* a field marked ``json_schema_extra={"deprecated": True, "new_param": "x", "new_param_fn": f}`` that is set
  is moved onto ``x`` as ``f(value)`` with a warning; setting both is an ``AssertionError``
  (``"set_new_param": False`` drops the value instead).
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict

from angelptm.config.loader import refuse_duplicate_keys

logger = logging.getLogger(__name__)

AUTO = "auto"


class DeepSpeedConfigModel(BaseModel):
    """Base of DeepSpeed's config sections (see the module docstring)."""

    model_config = ConfigDict(validate_default=True, validate_assignment=True, use_enum_values=True,
                              populate_by_name=True, extra="forbid", arbitrary_types_allowed=True,
                              protected_namespaces=())

    def __init__(self, strict: bool = False, **data: Any) -> None:
        if not strict:  # "auto": the field's default (a library fills the real value later)
            data = {key: value for key, value in data.items() if not (isinstance(value, str) and value == AUTO)}
        super().__init__(**data)
        self._move_deprecated_fields()

    def _move_deprecated_fields(self) -> None:
        for name, info in type(self).model_fields.items():
            extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
            if extra.get("deprecated") and name in self.model_fields_set:
                self._move_one(name, extra)

    def _move_one(self, name: str, extra: dict[str, Any]) -> None:
        new_name = extra.get("new_param", "")
        message = extra.get("deprecated_msg", "")
        logger.warning("config parameter %s is deprecated%s%s", name, f", use {new_name} instead" if new_name else "",
                       f". {message}" if message else "")
        if not new_name or not extra.get("set_new_param", True):
            return
        assert new_name not in self.model_fields_set, (
            f"cannot provide deprecated parameter '{name}' and replacing parameter '{new_name}' together")
        convert = extra.get("new_param_fn", lambda value: value)
        target, attribute = self, new_name
        for part in new_name.split(".")[:-1]:  # "section.field" reaches a nested model
            target = getattr(target, part)
            attribute = new_name.split(".")[-1]
        setattr(target, attribute, convert(getattr(self, name)))

    def __repr__(self) -> str:
        return self.model_dump_json(indent=2)


def get_scalar_param(param_dict: dict, param_name: str, param_default_value: Any) -> Any:
    """``param_dict[param_name]``, or the default (DeepSpeed's helper)."""
    return param_dict.get(param_name, param_default_value)


def get_list_param(param_dict: dict, param_name: str, param_default_value: Any) -> Any:
    return param_dict.get(param_name, param_default_value)


def get_dict_param(param_dict: dict, param_name: str, param_default_value: Any) -> Any:
    return param_dict.get(param_name, param_default_value)


def dict_raise_error_on_duplicate_keys(ordered_pairs: list[tuple[str, Any]]) -> dict:
    """``json.load``'s ``object_pairs_hook`` that refuses a key given twice (DeepSpeed's name for it)."""
    return refuse_duplicate_keys(ordered_pairs)
