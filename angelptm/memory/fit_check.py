"""Fits or explains before allocating: ZeRO-Cache's plan asked before a model is built.

A model too large for its tier budgets used to be built first (a 9.7B GPT grew to 23 GB of host
memory and was killed by the machine's OOM killer after 122 s) and only then planned. Here the plan
that ``attach`` would make is asked of :func:`zero_cache.dry_run` from the parameters' shapes alone:

* :func:`check_config_fits`: from a meta-device twin of the config's GPT, before ``pretrain.py`` builds it
  (the same plan as ``pretrain.py --plan``, nothing allocated), and the build's own bytes against the host's
  available memory;
* :class:`BuildWatch`: inside ``angelptm.zero.Init``, where the model is not known until it is built, the
  parameters built so far are planned each time their bytes double; a model whose first part does not
  fit cannot fit whole, so the build stops after at most one more parameter than the plan allowed.

Both raise :class:`~angelptm.errors.ConfigError` carrying the planner's message (the tier, "short by N
bytes" and the settings that help). "auto" budgets are measured now, with the bytes of parameters
already resident added back, as ``attach`` does: their storage is released into the chunks.
"""

from __future__ import annotations

import os
from typing import Any

import psutil
import torch
from torch import nn

import zero_cache
from angelptm.config import EngineConfig
from angelptm.errors import ConfigError
from angelptm.memory.model_states import (
    check_sizes_by_arithmetic,
    check_states_fit,
    state_bytes_per_param,  # noqa: F401  (re-exported to callers)
)
from zero_cache import check_explicit_budgets

BUILD_SHARE_OF_AVAILABLE = 0.9
"""``pretrain.py`` refuses a model whose build takes more than this share of the host's available memory."""
FIRST_CHECK_BYTES = 64 << 20
""":class:`BuildWatch` plans the first time this many parameter bytes exist, then at every doubling."""


def check_config_fits(cfg: EngineConfig, *, world_size: int = 1, ranks_per_host: int | None = None,
                      device: torch.device | None = None) -> None:
    """Plan the config's GPT from a meta-device twin; refuse before anything is built if it does not fit.

    Also refuses a model whose build alone (every parameter in host memory, in the default dtype) exceeds the
    host's available memory, with or without ZeRO-Cache.

    Args:
        cfg: the loaded config; the plan is made when ``zero_cache`` is enabled.
        world_size, ranks_per_host: the data-parallel ranks (every rank is planned) and how many share a host.
        device: the compute device (default: CUDA if present, else CPU).

    Raises:
        ConfigError: the model states do not fit (the plan's shortfall per tier), or the NVMe tier is unusable.
    """
    from angelptm.pretraining.models import build_model  # the model package is heavier than this module needs at import

    device = device or _default_device()
    per_host = min(ranks_per_host or cfg.zero_cache.ranks_per_host or _env_int("LOCAL_WORLD_SIZE", world_size),
                   world_size)
    # Before even a meta model: building one of 2^62 layers never ends.
    check_sizes_by_arithmetic(cfg, device, world_size, per_host)
    if cfg.zero_cache.enabled:
        try:
            check_explicit_budgets(cfg.zero_cache, device, per_host)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    with torch.device("meta"):
        model = build_model(cfg.model, moe=cfg.moe)
    numel = sum(p.numel() for p in model.parameters())
    what = f"model {cfg.model.flavour} of {numel / 1e6:.1f} M parameters"
    if cfg.zero_cache.enabled:  # first: its budgets are what the user set, and its message says what to change
        shapes = [(name, tuple(p.shape)) for name, p in model.named_parameters() if p.requires_grad]
        check_shapes_fit(shapes, cfg, world_size=world_size, ranks_per_host=ranks_per_host, device=device, what=what)
    _check_build_fits(model, what)  # the build comes first, and with a 16-bit dtype may not fit where states do
    if not cfg.zero_cache.enabled:
        check_states_fit(cfg, numel, device, per_host, what)


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _check_build_fits(twin: nn.Module, what: str) -> None:
    """The build itself: ``build_model`` materialises every parameter and buffer in host memory, in the default
    dtype, before ``initialize`` casts and places them; more than the host has available wakes the OOM killer."""
    build_bytes = sum(t.numel() * t.element_size() for t in (*twin.parameters(), *twin.buffers()))
    available = psutil.virtual_memory().available
    if build_bytes > available * BUILD_SHARE_OF_AVAILABLE:
        raise ConfigError(f"{what} is built in host memory first ({zero_cache.format_bytes(build_bytes)} in "
                          f"{str(torch.get_default_dtype()).removeprefix('torch.')}, before it is cast), but this "
                          f"machine has {zero_cache.format_bytes(available)} available: the OOM killer would end the "
                          "run. Use a smaller model (model.*) or a machine with more memory")


def check_shapes_fit(shapes: list[tuple[str, tuple[int, ...]]], cfg: EngineConfig, *, world_size: int = 1,
                     ranks_per_host: int | None = None, device: torch.device | None = None,
                     resident_bytes: dict[str, int] | None = None, what: str = "the model") -> None:
    """Raise :class:`ConfigError` unless ZeRO-Cache's plan for these trainable parameter shapes fits.

    Args:
        shapes: (name, shape) of the trainable parameters in model order.
        resident_bytes: bytes of those parameters already stored, by device type ("cuda", "cpu"): added to
            the "auto" budgets measured now, as ``attach`` adds them (they move into the chunks).
        what: names the model in the message.
    """
    device = device or _default_device()
    per_host = ranks_per_host or cfg.zero_cache.ranks_per_host or _env_int("LOCAL_WORLD_SIZE", world_size)
    per_host = min(per_host, world_size)
    try:
        resident = resident_bytes or {}
        zero_cache.dry_run(shapes, cfg.zero_cache, compute_dtype=cfg.precision.dtype, device=device,
                           accumulation_steps=cfg.batch.gradient_accumulation_steps, world_size=world_size,
                           ranks_per_host=per_host, moving_device_bytes=resident.get(device.type, 0),
                           moving_host_bytes=resident.get("cpu", 0))
    except zero_cache.PlanError as err:
        raise ConfigError(f"{what} does not fit, refused before building or moving it: {err}") from None
    except zero_cache.NvmeSetupError as err:
        raise ConfigError(f"cannot use the NVMe tier: {err}") from None
    except ValueError as err:  # the layout refused the config (e.g. a chunk_size below the largest parameter)
        raise ConfigError(str(err)) from None


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() and int(value) > 0 else default


class BuildWatch:
    """While active, plans the parameters built so far each time their bytes double; refuses when they do not fit.

    Args:
        cfg: the config ``zero.Init`` was given (ZeRO-Cache enabled).
        world_size: the data-parallel ranks.

    Attributes:
        checks: how many plans were made (tests read it).
    """

    def __init__(self, cfg: EngineConfig, world_size: int) -> None:
        self.cfg = cfg
        self.world_size = world_size
        self.checks = 0
        self._shapes: list[tuple[str, tuple[int, ...]]] = []
        self._resident: dict[str, int] = {}
        self._built_bytes = 0
        self._next_check_bytes = FIRST_CHECK_BYTES
        self._handle: Any = None

    def __enter__(self) -> "BuildWatch":
        self._handle = nn.modules.module.register_module_parameter_registration_hook(self._registered)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._handle.remove()

    def _registered(self, module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is None or not param.requires_grad or param.is_meta:
            return
        self._shapes.append((f"{type(module).__name__}.{name}#{len(self._shapes)}", tuple(param.shape)))
        size = param.numel() * param.element_size()
        self._resident[param.device.type] = self._resident.get(param.device.type, 0) + size
        self._built_bytes += size
        if self._built_bytes < self._next_check_bytes:
            return
        self._next_check_bytes = 2 * self._built_bytes
        self.checks += 1
        check_shapes_fit(self._shapes, self.cfg, world_size=self.world_size, resident_bytes=self._resident,
                         what=f"the model built under zero.Init (its first {len(self._shapes)} parameters, "
                              f"{zero_cache.format_bytes(self._built_bytes)}, already)")
