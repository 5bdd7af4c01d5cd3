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
import functools
from typing import Any, Iterator

import torch

import angelptm.comm
import angelptm.zero

# Moved to angelptm.zero (its Init reads any config that way); kept here under their old names.
construction_config = angelptm.zero.construction_config
fp32_unless_enabled = angelptm.zero.fp32_unless_enabled


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
