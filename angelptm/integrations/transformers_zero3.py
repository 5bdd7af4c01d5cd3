"""transformers' ZeRO-3 model construction on this engine: ``from_config`` / ``from_pretrained`` after a ZeRO-3
``TrainingArguments``, as ``run_clm.py`` does, with only the Trainer's import changed.

Under a ZeRO-3 config transformers builds every model inside ``deepspeed.zero.Init(config_dict_or_path=
deepspeed_config())`` (``PreTrainedModel._from_config`` and ``get_init_context``), initialises its weights
module by module inside ``deepspeed.zero.GatheredParameters(..., modifier_rank=0)`` on rank 0
(``initialize_weights_zero3``), and ``from_pretrained`` loads each module's weights inside the same context
(``_load_state_dict_into_zero3_model``). Each of those call sites does ``import deepspeed`` when it runs,
so the only place to reach them is the ``deepspeed.zero`` namespace itself. :func:`install` (run when
``angelptm.integrations.transformers`` is imported) puts two routers there:

* ``deepspeed.zero.Init`` called with transformers' own registered config (the very dict
  ``deepspeed_config()`` returns, which only those call sites pass) builds the model under
  :class:`angelptm.zero.Init` instead: whole parameters in the compute dtype, in host memory when the
  config puts params there (``offload_param``, ``zero_cache.param_home: "host"``), which
  ``initialize()`` then moves into ZeRO-Cache's chunks or homes. Any other call (a script's own
  ``deepspeed.zero.Init(...)``) gets DeepSpeed's, unchanged.
* ``deepspeed.zero.GatheredParameters`` given parameters that DeepSpeed partitioned (they carry
  ``ds_id``) is DeepSpeed's; any others get :class:`angelptm.zero.GatheredParameters` (before
  ``initialize()`` whole already; after it, edits reach the engine). DeepSpeed's own is a no-op for
  parameters it did not partition, so nothing that worked before changes meaning.

Like DeepSpeed's ``zero.Init``, the routed context joins a process group first (a world of one without
a launcher), and makes DeepSpeed's ``comm`` see it, since transformers asks ``deepspeed.comm.get_rank()``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from typing import Any, Iterator

import torch

import angelptm.comm
import angelptm.zero

_PRECISION_SECTIONS = ("fp16", "bf16", "bfloat16")
_CONSTRUCTION_SECTIONS = (*_PRECISION_SECTIONS, "zero_optimization", "zero_cache")
"""What building the model needs from the config: the compute dtype, and where the params will live."""


def fp32_unless_enabled(config: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed trains in fp32 when neither fp16 nor bf16 is enabled (the Trainer casts inputs to match):
    say so explicitly, or the engine would pick its own default for the device. Changes ``config``."""
    if "bfloat16" not in config and not any((config.get(section) or {}).get("enabled") is True
                                            for section in ("fp16", "bf16")):
        config.setdefault("bf16", {})["enabled"] = False
    return config


def construction_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The parts of the Trainer's DeepSpeed config that ``zero.Init`` reads, as a new dict.

    The Trainer fills most ``"auto"`` values only once it has the model (bucket sizes, the scheduler's
    step counts); none of those matter for building it, so they are left out. ``zero_cache``'s own
    ``"auto"`` values are this engine's to resolve and stay.
    """
    config = {key: copy.deepcopy(hf_config[key]) for key in _CONSTRUCTION_SECTIONS if key in hf_config}
    config["train_micro_batch_size_per_gpu"] = 1  # the loader wants a batch size; building a model reads none
    for key in _CONSTRUCTION_SECTIONS[:-1]:
        if isinstance(config.get(key), dict):
            config[key] = _without_autos(config[key])
    return fp32_unless_enabled(config)


def _without_autos(section: dict[str, Any]) -> dict[str, Any]:
    return {key: _without_autos(value) if isinstance(value, dict) else value
            for key, value in section.items() if value != "auto"}


def join_process_group() -> None:
    """A process group, as ``deepspeed.zero.Init`` makes one (a world of one without a launcher), that
    DeepSpeed's ``comm`` also reports (transformers calls ``deepspeed.comm.get_rank()`` under ZeRO-3)."""
    angelptm.comm.init_distributed()
    import deepspeed.comm

    if not deepspeed.comm.is_initialized():
        deepspeed.comm.init_distributed(dist_init_required=False, verbose=False)


@contextlib.contextmanager
def transformers_zero3_init(hf_config: dict[str, Any]) -> Iterator[angelptm.zero.Init]:
    """What transformers' ``deepspeed.zero.Init(config_dict_or_path=deepspeed_config())`` means here."""
    join_process_group()
    # (A fits-or-explains check of the model against the budgets belongs in angelptm.zero.Init itself.)
    with angelptm.zero.Init(config_dict_or_path=construction_config(hf_config)) as init:
        yield init


def _routed_init(real: Any) -> Any:
    @functools.wraps(real, updated=())
    def Init(*args: Any, **kwargs: Any) -> Any:  # noqa: N802  (DeepSpeed's name)
        from transformers.integrations.deepspeed import deepspeed_config

        hf_config = deepspeed_config()
        if hf_config is not None and not args and kwargs.get("config_dict_or_path") is hf_config:
            return transformers_zero3_init(hf_config)
        return real(*args, **kwargs)

    Init.routed_by_angelptm = True
    return Init


def _routed_gathered(real: Any) -> Any:
    @functools.wraps(real, updated=())
    def GatheredParameters(params: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N802  (DeepSpeed's name)
        listed = [params] if isinstance(params, torch.Tensor) else list(params or [])
        if any(hasattr(p, "ds_id") for p in listed):
            return real(listed, *args, **kwargs)
        return angelptm.zero.GatheredParameters(listed, *args, **kwargs)

    GatheredParameters.routed_by_angelptm = True
    return GatheredParameters


def install() -> None:
    """Put the routers into ``deepspeed.zero`` (once per process; see the module docstring). Without DeepSpeed
    installed transformers has no ZeRO-3 path, and there is nothing to route."""
    try:
        import deepspeed
    except ImportError:
        return
    zero = deepspeed.zero
    if not getattr(zero.Init, "routed_by_angelptm", False):
        zero.Init = _routed_init(zero.Init)
    if not getattr(zero.GatheredParameters, "routed_by_angelptm", False):
        zero.GatheredParameters = _routed_gathered(zero.GatheredParameters)
