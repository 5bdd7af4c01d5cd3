"""DeepSpeed 0.19.8's low-precision optimizer modes and ``torch_autocast``, checked and resolved as DeepSpeed does.

What the modes are in DeepSpeed 0.19.8 (``runtime/precision_config.py``, ``runtime/config.py``'s ``_do_error_check``,
``runtime/base_optimizer.py``'s ``_configure_master_weights``, ``runtime/zero/stage_1_and_2.py`` and ``stage3.py``):

* ``bf16.bf16_master_weights_and_grads``: the ZeRO optimizer's master partition is a bf16 copy of the bf16
  parameters (``master_weights_and_grads_dtype = torch.bfloat16``), and the gradients it steps with stay bf16 (they
  are not upcast into an fp32 partition). Only with ZeRO stage 1, 2 or 3 (config assert). Without
  ``bf16_optimizer_states`` it also needs ``offload_optimizer`` with DeepSpeedCPUAdam ("Master weights feature
  requires ZeRO Offload with DeepSpeedCPUAdam"): the CPU Adam steps the bf16 masters and keeps its moments fp32.
* ``bf16.bf16_optimizer_states``: Adam's exp_avg and exp_avg_sq in bf16 too (the optimizer's states follow the bf16
  masters; with offload DeepSpeed builds DeepSpeedCPUAdam with ``fp32_optimizer_states=False``). Only with ZeRO stage
  1-3, and only together with ``bf16_master_weights_and_grads`` ("bf16_optimizer_states requires
  bf16_master_weights_and_grads to be enabled"). Then no offload is needed: FusedAdam steps the bf16 masters.
  Measured on a CPU: DeepSpeed's losses are the same with and without offload in this mode, and they differ from
  masters-only (fp32 moments) from the third step on.
* ``torch_autocast``: the module keeps fp32 parameters and the forward runs under ``torch.autocast(device,
  dtype)`` (``runtime/torch_autocast.py``, ``engine.forward``); ``dtype`` absent is torch's default for the device
  (bf16 on a CPU, fp16 on CUDA). Gradients are fp32, the optimizer steps fp32 parameters. The parameters of the
  ``lower_precision_safe_modules`` (default: Linear and Conv1d/2d/3d; names are imported, a failed import is an
  error) get ``comm_dtype`` = the autocast dtype: ZeRO (stage 1-3) all-reduces their gradients in it. Without ZeRO
  and with dtype fp16, a ``torch.amp.GradScaler`` scales the loss.

What this engine does with them:

* bf16 masters and moments (both keys) without ZeRO-Cache: the module's bf16 parameters are the masters (DeepSpeed's
  bf16 master copy holds the same values, so stepping the parameter itself is the same arithmetic), the flat gradient
  buffer is bf16, Adam's moments bf16 (:class:`~angelptm.engine.mixed_precision.MixedPrecisionOptimizer`; on a CPU
  DeepSpeed's own C++ Adam steps them, as its FusedAdam does there).
* bf16 masters alone, with ``offload_optimizer`` at stage 1 or 2 (no ZeRO-Cache): the same with fp32 moments and the
  config's optimizer (DeepSpeed requires its DeepSpeedCPUAdam; a client optimizer is refused, as there).
* ZeRO-Cache (stage 3 with ``offload_optimizer``, or ``zero_cache.enabled``) with both keys: its chunks' masters,
  moments and gradient accumulators are bf16 in every home (``zero_cache.state_dtype`` "bf16", 6 bytes an element
  instead of 12); the host's Adam is DeepSpeed's cpu_adam on them, the device's torch's fused Adam. Masters alone
  (fp32 moments) are refused there: a chunk's states hold one dtype.
* ``torch_autocast`` with ``bf16.enabled: true`` (or ``fp16.enabled: true``): as DeepSpeed 0.19.8, which has no
  assert against it, the module is cast and trained as that section says (fp32 masters and all), and its forward runs
  under autocast besides, whose fp32 ops (softmax, norms, losses) upcast again. Its documented use is fp32
  parameters: ``bf16.enabled: "auto"`` yields to it.
"""

from __future__ import annotations

import dataclasses
import importlib

import torch

from angelptm.config import edge, typed
from angelptm.errors import ConfigError

AUTOCAST_DTYPES = {name: dtype for dtype, names in (
    (torch.float16, ("torch.float16", "fp16", "float16", "half")),
    (torch.bfloat16, ("torch.bfloat16", "bf16", "bfloat16")),
    (torch.float32, ("torch.float32", "fp32", "float32", "float"))) for name in names}
"""``torch_autocast.dtype`` spellings DeepSpeed's DtypeEnum takes (int8 aside, which autocast does not run)."""

DEFAULT_SAFE_MODULES = ("torch.nn.modules.linear.Linear", "torch.nn.modules.conv.Conv1d",
                        "torch.nn.modules.conv.Conv2d", "torch.nn.modules.conv.Conv3d")
"""DeepSpeed's ``LOWER_PRECISION_SAFE_MODULES``, by qualified name."""

GRAD_SCALER = typed.LossScaleConfig(initial_scale_power=16, window=2000, hysteresis=1, min_scale=2.0**-24)
"""fp16 autocast without ZeRO: DeepSpeed scales the loss with ``torch.amp.GradScaler``'s defaults (2**16, halved at
an overflow, whose step is skipped, doubled after 2000 clean steps); the engine's dynamic scaler with those values."""


def low_precision_problems(parsed: edge.EdgeConfig, zero_cache_on: bool) -> list[str]:
    """The bf16 optimizer keys' checks: DeepSpeed's asserts first, then what this engine does not do.

    Args:
        parsed: the validated edge config.
        zero_cache_on: ZeRO-Cache holds the optimizer states (stage 3 with offload_optimizer, or zero_cache.enabled).

    Returns:
        One message per problem, each naming the key, its value and what to do.
    """
    bf16, stage = parsed.bf16, parsed.zero_optimization.stage
    masters, states = bf16.bf16_master_weights_and_grads, bf16.bf16_optimizer_states
    problems = []
    if states and not masters:
        problems.append("bf16.bf16_optimizer_states: true requires bf16.bf16_master_weights_and_grads: true (bf16 "
                        "Adam moments step bf16 masters; DeepSpeed asserts the same): set both, or remove "
                        "bf16_optimizer_states")
    for key, value in (("bf16_master_weights_and_grads", masters), ("bf16_optimizer_states", states)):
        if value and stage not in (1, 2, 3):
            problems.append(f"bf16.{key}: true is only supported with zero_optimization.stage 1, 2 or 3 (got stage "
                            f"{stage}), as in DeepSpeed: set zero_optimization.stage to 1, 2 or 3, or remove the key")
    if problems or not masters:
        return problems
    if parsed.fp16.enabled or parsed.bf16.enabled is False:
        problems.append("bf16.bf16_master_weights_and_grads: true keeps bf16 copies of bf16 parameters, but the "
                        f"config computes in {'fp16' if parsed.fp16.enabled else 'fp32'}: set bf16.enabled to true")
    if zero_cache_on and not states:
        problems.append("bf16.bf16_master_weights_and_grads: true without bf16.bf16_optimizer_states (bf16 masters, "
                        "fp32 Adam moments) is not implemented under ZeRO-Cache (zero_optimization.stage 3 with "
                        "offload_optimizer, or zero_cache.enabled): its chunks hold one dtype for masters and moments. "
                        "Add bf16.bf16_optimizer_states: true (bf16 masters and moments: 6 bytes an element instead of "
                        "12), or remove bf16_master_weights_and_grads (fp32 states), or train at stage 1 or 2 with "
                        "offload_optimizer for bf16 masters with fp32 moments")
        return problems
    if zero_cache_on:
        return problems  # (bf16 masters and moments in ZeRO-Cache's chunks: zero_cache_state_dtype)
    offloaded = parsed.zero_optimization.offload_optimizer
    if not states and (offloaded is None or offloaded.device == "none"):
        problems.append("bf16.bf16_master_weights_and_grads: true without bf16.bf16_optimizer_states needs "
                        "zero_optimization.offload_optimizer (DeepSpeed: \"Master weights feature requires ZeRO "
                        "Offload with DeepSpeedCPUAdam\"): add bf16_optimizer_states: true as well (bf16 masters and "
                        "Adam moments, no offload needed), or offload the optimizer")
    return problems


def zero_cache_state_dtype(parsed: edge.EdgeConfig) -> str:
    """ZeRO-Cache's ``state_dtype`` for the config: "bf16" under both bf16 keys (its chunks then hold bf16 masters,
    moments and gradient accumulators), else "fp32"."""
    bf16 = parsed.bf16
    return "bf16" if bf16.bf16_master_weights_and_grads and bf16.bf16_optimizer_states else "fp32"


def state_dtype_problem(parsed: edge.EdgeConfig) -> str | None:
    """``zero_cache.state_dtype`` written against what the bf16 keys say (they set it: one door)."""
    written, wanted = parsed.zero_cache.state_dtype, zero_cache_state_dtype(parsed)
    if written == wanted or written == "fp32":
        return None
    return (f"zero_cache.state_dtype: {written!r} is set by bf16.bf16_master_weights_and_grads: true with "
            "bf16.bf16_optimizer_states: true (and bf16.enabled: true); write those keys and leave state_dtype out")


def fp32_optimizer_states_problem(parsed: edge.EdgeConfig) -> str | None:
    """``optimizer.params.fp32_optimizer_states: false`` asks DeepSpeedCPUAdam for moments in the parameters' dtype:
    what ``bf16.bf16_optimizer_states`` does (DeepSpeed sets it false there), refused elsewhere."""
    if parsed.optimizer is None or parsed.optimizer.params.fp32_optimizer_states or parsed.bf16.bf16_optimizer_states:
        return None
    return ("optimizer.params.fp32_optimizer_states: false (Adam moments in the parameters' dtype) is implemented "
            "only as bf16.bf16_optimizer_states: true (with bf16_master_weights_and_grads: true); write those, or "
            "remove the key: the engine's Adam moments are fp32")


def autocast_problems(parsed: edge.EdgeConfig) -> list[str]:
    """``torch_autocast``'s checks: a dtype DeepSpeed takes, importable safe-module names."""
    section = parsed.torch_autocast
    if not section.enabled:
        return []
    problems = []
    if section.dtype is not None and section.dtype not in AUTOCAST_DTYPES:
        problems.append(f"torch_autocast.dtype: {section.dtype!r} is not a dtype autocast runs in; use one of "
                        f"{', '.join(repr(name) for name in AUTOCAST_DTYPES)}, or leave it out for the device's "
                        "default (bfloat16 on a CPU, float16 on CUDA)")
    for name in section.lower_precision_safe_modules or ():
        try:
            module_class(name)
        except ValueError as err:
            problems.append(f"torch_autocast.lower_precision_safe_modules: {err}")
    return problems


def module_class(name: str) -> type:
    """The class a qualified name such as ``"torch.nn.modules.linear.Linear"`` names (imported as DeepSpeed does).

    Raises:
        ValueError: the name is not ``package.Class`` or does not import.
    """
    package, _, class_name = name.rpartition(".")
    try:
        return getattr(importlib.import_module(package), class_name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"{name!r} does not import ({type(err).__name__}: {err}); give qualified class names "
                         "such as \"torch.nn.modules.linear.Linear\"") from None


def apply_modes(config: typed.PrecisionConfig, parsed: edge.EdgeConfig, device_type: str) -> typed.PrecisionConfig:
    """``config`` with the master, moment and autocast dtypes the checked config asks for."""
    bf16, section = parsed.bf16, parsed.torch_autocast
    changes: dict = {}
    if bf16.bf16_master_weights_and_grads:
        changes["master_dtype"] = torch.bfloat16
        if bf16.bf16_optimizer_states:
            changes["optimizer_state_dtype"] = torch.bfloat16
    if section.enabled:
        default = torch.bfloat16 if device_type == "cpu" else torch.float16
        dtype = AUTOCAST_DTYPES[section.dtype] if section.dtype is not None else default
        modules = section.lower_precision_safe_modules
        changes.update(autocast_dtype=dtype,
                       autocast_safe_modules=tuple(DEFAULT_SAFE_MODULES if modules is None else modules))
        if not (bf16.enabled is True or parsed.fp16.enabled):  # else the module is cast as that section says
            changes.update(dtype=torch.float32,
                           loss_scale=GRAD_SCALER if dtype == torch.float16 and parsed.zero_optimization.stage == 0
                           else None,
                           reason=f"torch_autocast.enabled is true: fp32 parameters, the forward under "
                                  f"torch.autocast in {str(dtype).removeprefix('torch.')}")
    if not changes:
        return config
    if config.dtype != torch.float32 and "autocast_dtype" in changes:
        changes["slow_bf16"] = False  # (bf16 "auto" resolved to bf16 yields to autocast's fp32 parameters)
    return dataclasses.replace(config, **changes)


def check(problems: list[str]) -> None:
    """Raise the problems found, if any, as one :class:`ConfigError`."""
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))
