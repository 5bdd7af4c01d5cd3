"""``angelptm.checkpointing``: DeepSpeed's activation-checkpointing API over ``torch.utils.checkpoint``.

``checkpoint(fn, *args)`` is torch's reentrant checkpoint (DeepSpeed's default) and
``non_reentrant_checkpoint`` torch's non-reentrant one. ``configure`` accepts DeepSpeed's
``activation_checkpointing`` options; those that need model parallelism or DeepSpeed's own buffers
(``partition_activations``, ``contiguous_memory_optimization``, ``cpu_checkpointing``) raise with the way
out instead of being silently ignored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

_UNSUPPORTED = {
    "partition_activations": "it splits checkpoints over tensor-parallel ranks, which angelptm does not have",
    "contiguous_memory_optimization": "it copies checkpoints into DeepSpeed's own buffers",
    "cpu_checkpointing": "wrap the forward in torch.autograd.graph.save_on_cpu() to keep activations in host memory",
}


class _Settings:
    """What :func:`configure` was told (one object per module import; :func:`reset` restores it)."""

    def __init__(self) -> None:
        self.configured = False
        self.synchronize = False
        self.num_checkpoints: int | None = None


_settings = _Settings()


def configure(mpu_: Any = None, deepspeed_config: str | dict | None = None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None, profile: bool | None = None
              ) -> None:
    """Configure activation checkpointing, like ``deepspeed.checkpointing.configure``.

    Args:
        mpu_: a model-parallel unit; must be None (no tensor parallelism here).
        deepspeed_config: a DeepSpeed config (path or dict); its ``activation_checkpointing`` section is read,
            then the arguments below override it.
        partition_activations, contiguous_checkpointing, checkpoint_in_cpu: must be false (see the module
            docstring for why and what to use).
        num_checkpoints: recorded (DeepSpeed sizes its contiguous buffers with it).
        synchronize: synchronise the device at each checkpoint boundary.
        profile: must be false (DeepSpeed's checkpoint timers are not built).

    Raises:
        NotImplementedError: an option that cannot be honoured is on.
    """
    if mpu_ is not None:
        raise NotImplementedError("checkpointing.configure(mpu_=...): tensor/model parallelism is not supported; "
                                  "pass None")
    section = _config_section(deepspeed_config)
    options = {"partition_activations": partition_activations, "cpu_checkpointing": checkpoint_in_cpu,
               "contiguous_memory_optimization": contiguous_checkpointing, "profile": profile}
    for key, value in options.items():
        value = section.get(key, False) if value is None else value
        if value and key in _UNSUPPORTED:
            raise NotImplementedError(f"activation checkpointing option {key}=True is not supported: "
                                      f"{_UNSUPPORTED[key]}")
        if value and key == "profile":
            raise NotImplementedError("activation checkpointing profile=True: DeepSpeed's checkpoint timers are not "
                                      "built; use torch.profiler")
    _settings.num_checkpoints = num_checkpoints if num_checkpoints is not None else section.get("number_checkpoints")
    _settings.synchronize = bool(synchronize if synchronize is not None
                                 else section.get("synchronize_checkpoint_boundary", False))
    _settings.configured = True


def _config_section(config: str | dict | None) -> dict:
    if config is None:
        return {}
    raw = config if isinstance(config, dict) else json.loads(Path(config).read_text())
    return dict(raw.get("activation_checkpointing") or {})


def is_configured() -> bool:
    """Whether :func:`configure` has been called."""
    return _settings.configured


def reset() -> None:
    """Forget :func:`configure`'s settings (DeepSpeed frees its buffers here; torch keeps none)."""
    _settings.__init__()


def _synchronize() -> None:
    if _settings.synchronize and torch.cuda.is_available():
        torch.cuda.synchronize()


def checkpoint(function: Callable, *args: Any) -> Any:
    """Run ``function(*args)`` without keeping its activations; recompute them in backward.

    Args:
        function: the forward to checkpoint.
        *args: its inputs (tensors and other values).

    Returns:
        ``function(*args)``.
    """
    _synchronize()
    output = _torch_checkpoint(function, *args, use_reentrant=True)
    _synchronize()
    return output


def non_reentrant_checkpoint(function: Callable, *args: Any) -> Any:
    """:func:`checkpoint` with torch's non-reentrant implementation (works when no input requires grad)."""
    _synchronize()
    output = _torch_checkpoint(function, *args, use_reentrant=False)
    _synchronize()
    return output


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Megatron's tensor-parallel RNG set-up: not supported (no tensor parallelism).

    Raises:
        NotImplementedError: always; seed with ``torch.manual_seed`` / ``get_accelerator().manual_seed``.
    """
    raise NotImplementedError("model_parallel_cuda_manual_seed needs tensor parallelism, which angelptm does not have; "
                              "seed with torch.manual_seed(seed) instead")


def get_cuda_rng_tracker() -> Any:
    """Megatron's tensor-parallel RNG tracker: not supported.

    Raises:
        NotImplementedError: always; use ``torch.random.fork_rng()`` for a private RNG stream.
    """
    raise NotImplementedError("get_cuda_rng_tracker is Megatron's tensor-parallel RNG tracker, which angelptm does not "
                              "have; use torch.random.fork_rng() for a private RNG stream")
