"""A device out-of-memory inside a step, reported with the budgets in force and the settings that would help.

torch's own text ("CUDA out of memory. Tried to allocate 2.00 GiB ...") says what failed, not what to change.
The engine runs its forward, backward and optimizer step under :func:`explained_oom`, which turns
``torch.OutOfMemoryError`` into :class:`StepOutOfMemoryError`: still a ``torch.OutOfMemoryError`` (code that
catches it to retry with a smaller batch keeps working), with a message naming the phase and step, the
micro-batch, each ZeRO-Cache tier's budget and use (or that every model state sits on the device), and the
settings that lower the device's peak.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from zero_cache import format_bytes


class StepOutOfMemoryError(torch.OutOfMemoryError):
    """The device ran out of memory inside a training step; the message says what was in force and what helps."""


@contextlib.contextmanager
def explained_oom(engine: Any, phase: str) -> Iterator[None]:
    """Run a phase of ``engine``'s step; a ``torch.OutOfMemoryError`` leaves as :class:`StepOutOfMemoryError`."""
    try:
        yield
    except StepOutOfMemoryError:
        raise
    except torch.OutOfMemoryError as err:
        raise StepOutOfMemoryError(oom_message(engine, phase, err)) from err


def oom_message(engine: Any, phase: str, err: BaseException) -> str:
    """One paragraph: what ran out, the budgets in force, and the settings that would help."""
    cfg = engine.config
    torch_line = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
    head = (f"the {engine.device.type} device ran out of memory in the {phase} of step {engine.global_steps + 1} "
            f"(micro-batch {cfg.batch.micro_batch_size} x {cfg.batch.gradient_accumulation_steps} accumulation, "
            f"{str(cfg.precision.dtype).removeprefix('torch.')}; torch: {torch_line}).")
    tiers = engine.optimizer.tier_usage() if engine.optimizer is not None else None  # (empty without ZeRO-Cache)
    if tiers:
        budgets = ", ".join(f"{name} {format_bytes(used)} of {format_bytes(budget)}"
                            for name, (used, budget) in tiers.items())
        in_force = f" ZeRO-Cache tiers (used of budget): {budgets}."
        helps = [f"lower zero_cache.device_memory_budget (now {format_bytes(tiers['device'][1])}) or set "
                 "zero_cache.activation_memory, so more of the device is left to activations",
                 *_common_settings(cfg)]
    else:
        in_force = (" ZeRO-Cache is off: every parameter, gradient and optimizer state of this rank is on the "
                    "device.")
        helps = ["enable zero_cache (\"zero_cache\": {\"enabled\": true}) so the model states are planned over "
                 "device, host and NVMe; `pretrain.py --plan` shows where they would go", *_common_settings(cfg)]
    return f"{head}{in_force} What helps: " + "; ".join(helps) + "."


def _common_settings(cfg: Any) -> list[str]:
    settings = [f"a smaller train_micro_batch_size_per_gpu (now {cfg.batch.micro_batch_size}) with more "
                "gradient_accumulation_steps, which keeps the global batch"]
    if not cfg.model.activation_checkpointing:
        settings.append("activation checkpointing (model.activation_checkpointing, or the model's "
                        "gradient_checkpointing_enable())")
    settings.append("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True when torch reports much memory reserved but "
                    "unallocated (fragmentation)")
    return settings
