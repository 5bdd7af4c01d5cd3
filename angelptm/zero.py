"""``angelptm.zero``: the construction helpers a DeepSpeed ZeRO-3 script uses, under the same names.

(``GatheredParameters``, at the end, reads or edits whole weights before and after ``initialize()``.)

``with deepspeed.zero.Init(...): model = Model()`` keeps working after ``import angelptm as
deepspeed``. The context builds the model in the compute dtype (bf16/fp16 from the config, or
``dtype=``), so a large model never needs a full fp32 copy, and on the device that will hold its
weights:

* on the GPU by default, where ``initialize()`` moves each parameter into its ZeRO-Cache chunk;
* in host memory when the params are to live there: ``remote_device="cpu"`` or ``"nvme"`` (DeepSpeed's
  argument), ``zero_optimization.offload_param``, or ``zero_cache.param_home: "host"``. The GPU then
  never holds the model; ``initialize()`` copies each parameter into its shard's pinned home and releases
  it, so host memory peaks at the compute-dtype model on top of the homes, never at an fp32 copy.

What runs where when the model is built in host memory and a GPU is there: the parameters are allocated,
and non-random initialisation (``zeros_``, ``ones_``, ``mul_``) runs, on the CPU; the random fills
(``normal_`` and ``uniform_``, which ``nn.init``'s ``normal_``, ``uniform_``, ``trunc_normal_``,
``kaiming_*`` and ``xavier_*`` come down to) of each tensor of 1M elements or more are drawn on the GPU, at
most 256 MiB at a time, and copied back (``angelptm.engine.init_on_device.RandomFillsOnDevice``). Why: torch
draws random numbers on the CPU on one thread, so an 8.5B GPT took 280 s to build on a 16-core H200 host,
while DeepSpeed's ``zero.Init``, which initialises on the GPU, built 4.4B in 15 s; with the fills on the
GPU an 8.2B GPT builds in 15.4 s on the H100 machine (0.94B: 45.1 s with CPU fills, 1.9 s). The values
then come from the GPU's generator (``torch.manual_seed`` seeds it too: the same seed gives the same
weights) rather than the CPU's. Without a GPU nothing changes: the fills run on the CPU.

With ZeRO-Cache enabled in the config, the build is planned as it goes (``angelptm.memory.fit_check.BuildWatch``):
the parameters built so far are planned each time their bytes double, and a build whose first part already
does not fit the tier budgets stops with the planner's "short by" message instead of growing until the
machine's OOM killer ends it.

(Materialising each parameter straight into its chunk, without the transient compute-dtype copy, needs
the chunk layout before the model exists, and is not built.)
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from angelptm.config import load_config
from angelptm.config.loader import read_config_source
from angelptm.engine import gathered_params
from angelptm.engine.init_on_device import RandomFillsOnDevice
from angelptm.errors import ConfigError
from angelptm.launch.distributed import launcher_world_size
from angelptm.memory.fit_check import BuildWatch
from zero_cache import AUTO, home_costs

REMOTE_DEVICES = (None, "none", "cuda", "cpu", "nvme")


def _homes_off_device(param_home: str) -> bool:
    """Whether ``zero_cache.param_home`` names a home off the device for every shard (host, NVMe)."""
    return param_home != AUTO and home_costs(param_home).streams


_PRECISION_SECTIONS = ("fp16", "bf16", "bfloat16")
_CONSTRUCTION_SECTIONS = (*_PRECISION_SECTIONS, "zero_optimization", "zero_cache")
"""What building the model needs from a config: the compute dtype, and where the params will live."""


def fp32_unless_enabled(config: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed trains in fp32 when neither fp16 nor bf16 is enabled (the Trainer casts inputs to match):
    say so explicitly, or the engine would pick its own default for the device. Changes ``config``."""
    if "bfloat16" not in config and not any((config.get(section) or {}).get("enabled") is True
                                            for section in ("fp16", "bf16")):
        config.setdefault("bf16", {})["enabled"] = False
    return config


def construction_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The parts of a DeepSpeed config that building a model reads, as a new dict.

    Why: transformers and accelerate pass ``zero.Init`` their whole config before they have filled its
    ``"auto"`` values (bucket sizes, learning rates, step counts are known only once the model and the
    loaders exist); none of those matter for building the model, so they are left out. ``zero_cache``'s
    own ``"auto"`` values are this engine's to resolve and stay.
    """
    config = {key: copy.deepcopy(raw[key]) for key in _CONSTRUCTION_SECTIONS if key in raw}
    config["train_micro_batch_size_per_gpu"] = 1  # the loader wants a batch size; building a model reads none
    for key in _CONSTRUCTION_SECTIONS[:-1]:
        if isinstance(config.get(key), dict):
            config[key] = _without_autos(config[key])
    return fp32_unless_enabled(config)


def _readable(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` itself, checked whole, unless ``"auto"`` values outside ``zero_cache`` wait for a library to fill
    them later (transformers, accelerate): then only its :func:`construction_config`."""
    autos = _has_auto({key: value for key, value in raw.items() if key != "zero_cache"})
    return construction_config(raw) if autos else raw


def _has_auto(value: Any) -> bool:
    if isinstance(value, dict):
        return any(_has_auto(item) for item in value.values())
    return value == "auto"


def _without_autos(section: dict[str, Any]) -> dict[str, Any]:
    return {key: _without_autos(value) if isinstance(value, dict) else value
            for key, value in section.items() if value != "auto"}


class Init:
    """Context manager compatible with ``deepspeed.zero.Init``.

    Args:
        config_dict_or_path: the DeepSpeed config (path or dict); its bf16/fp16 section picks the dtype.
        config: alias of ``config_dict_or_path`` (DeepSpeed accepts both).
        enabled: False makes the context a no-op.
        dtype: explicit parameter dtype (overrides the config).
        remote_device: "cpu" or "nvme" builds the model in host memory (see the module docstring); None
            or "cuda": where the config puts the params.
        **kwargs: DeepSpeed's other arguments (data_parallel_group, pin_memory, mpu, ...) are accepted; they
            concern partitioning, which ZeRO-Cache does at initialize().
    """

    def __init__(self, module: torch.nn.Module | None = None, *, config_dict_or_path: Any = None, config: Any = None,
                 enabled: bool = True, dtype: torch.dtype | None = None, remote_device: str | None = None,
                 **kwargs: Any) -> None:
        if module is not None:
            raise NotImplementedError("zero.Init(module=...) (converting an existing module) is not supported; "
                                      "build the model inside `with zero.Init(...):` instead")
        self.enabled = enabled
        if remote_device not in REMOTE_DEVICES:
            raise ConfigError(f"zero.Init(remote_device={remote_device!r}): expected one of {list(REMOTE_DEVICES)}")
        source = config_dict_or_path if config_dict_or_path is not None else config
        # The launcher's world size: a config's batch triple counts every rank.
        parsed = load_config(_readable(read_config_source(source)), world_size=launcher_world_size()) \
            if source is not None else None
        self.dtype = dtype or (parsed.precision.dtype if parsed is not None else torch.float32)
        # Where the params may live off the device (offload_param permits it, param_home "host" forces it), the
        # model is built in host memory: initialize() then moves to the device what the plan keeps there.
        on_host = remote_device in ("cpu", "nvme") or (parsed is not None and parsed.zero_cache.enabled and (
            _homes_off_device(parsed.zero_cache.param_home) or parsed.zero.offload_param_device in ("cpu", "nvme")))
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() and not on_host \
            else torch.device("cpu")
        """Where the parameters are built."""
        self.fills = RandomFillsOnDevice(torch.device("cuda", torch.cuda.current_device())) \
            if on_host and torch.cuda.is_available() else None
        """Draws the random fills of large host params on the GPU while active (None: they stay on the CPU)."""
        self.watch = BuildWatch(parsed, launcher_world_size()) if parsed is not None and parsed.zero_cache.enabled \
            else None
        """Plans the parameters built so far as they grow, and stops a build that cannot fit
        (``angelptm.memory.fit_check``): the model is not known before it is built, so no twin can be planned first."""
        self._saved_dtype: torch.dtype | None = None
        self._device_context: Any = None

    def __enter__(self) -> "Init":
        if self.enabled:
            self._saved_dtype = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
            self._device_context = torch.device(self.device)
            self._device_context.__enter__()
            if self.fills is not None:
                self.fills.__enter__()
            if self.watch is not None:
                self.watch.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            if self.watch is not None:
                self.watch.__exit__(*exc)
            if self.fills is not None:
                self.fills.__exit__(*exc)
            self._device_context.__exit__(*exc)
            torch.set_default_dtype(self._saved_dtype)


class GatheredParameters:
    """Context manager compatible with ``deepspeed.zero.GatheredParameters``: whole weights inside, edits kept.

    Inside the block each parameter is a whole tensor in the compute dtype. Before ``initialize()``
    parameters are whole already; after it they are rebound to copies of the engine's fp32 masters, and
    on exit the edits of ``modifier_rank`` reach the masters and the engine's compute copies (ZeRO-Cache
    chunks included), so the next forward and the next step use them (``angelptm.engine.gathered_params``).

    Args:
        params: one parameter or an iterable of them (None entries are skipped, as in DeepSpeed).
        modifier_rank: the rank (in the owning engine's group) whose edits are kept; every rank takes its
            values. None: read-only, edits are dropped.
        fwd_module: DeepSpeed's registration of external parameters for a forward run inside the block;
            accepted and unused (a forward inside the block is not supported: the engine rebinds its
            parameters as it runs).
        enabled: False makes the context a no-op.

    Every rank must enter the context when several ranks train (the values are broadcast, and sharded
    masters gathered).
    """

    def __init__(self, params: Any, modifier_rank: int | None = None, fwd_module: Any = None,
                 enabled: bool = True) -> None:
        self.params = gathered_params.as_param_list(params) if enabled else []
        self.modifier_rank = modifier_rank
        self._edits: list[gathered_params.EngineEdit] = []
        self._loose: list[torch.nn.Parameter] = []
        """Parameters no engine owns yet (before initialize): whole already."""

    def __enter__(self) -> "GatheredParameters":
        by_engine: dict[int, tuple[Any, list]] = {}
        for param in self.params:
            ref = gathered_params.OWNERS.get(param)
            engine = ref() if ref is not None else None
            if engine is None:
                self._loose.append(param)
            else:
                by_engine.setdefault(id(engine), (engine, []))[1].append(param)
        try:
            for engine, params in by_engine.values():
                edit = gathered_params.EngineEdit(engine, params)
                edit.enter()
                self._edits.append(edit)
        except BaseException:
            for edit in self._edits:  # bind the parameters entered so far back to the engines' storage
                edit.exit(None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        modifier = self.modifier_rank if exc[0] is None else None  # a block that raised keeps nothing
        for edit in self._edits:
            edit.exit(modifier)
        if self._loose and modifier is not None and torch.distributed.is_initialized():
            group = torch.distributed.group.WORLD
            gathered_params.broadcast_values(self._loose, self.modifier_rank, group)
