"""One Adam step over a chunk's slots, from its gradient in any dtype: the arithmetic the device's update
(:mod:`zero_cache.optim.optimizer`) and the host worker's (:mod:`zero_cache.optim.host_update`) share."""

from __future__ import annotations

from typing import Any, Callable

import torch

from zero_cache.plan.layout import TensorSlot
from zero_cache.storage.chunks import STATE_FIELDS, ChunkStore


def state_gradient(source: torch.Tensor, scratch: torch.Tensor, grad_factor: float, *,
                   in_place: bool = True) -> torch.Tensor:
    """``source`` in the states' dtype, the ``scratch``'s (in place when it is in that dtype and ``in_place``, else
    through ``scratch``), times ``grad_factor``: fp32, or bf16 with bf16 states, whose gradient DeepSpeed scales in
    bf16 too (``bf16_master_weights_and_grads``)."""
    grads = source if source.dtype == scratch.dtype and (in_place or grad_factor == 1.0) else scratch.copy_(source)
    if grad_factor != 1.0:
        grads.mul_(grad_factor)
    return grads


def adam_step(store: ChunkStore, slots: list[TensorSlot], grads: torch.Tensor, hyper: dict[str, Any], step: int,
              kernel: Callable[..., None], states: torch.Tensor | None = None) -> None:
    """One Adam step over ``slots`` (of one chunk and one param group); ``grads`` is the chunk's gradient in the
    states' dtype,
    ``states`` the chunk's states when they are not resident (read from NVMe)."""
    views = {f: [store.state_view(s, f, states) for s in slots] for f in STATE_FIELDS}
    grad_views = [grads[s.offset:s.offset + s.numel] for s in slots]
    kernel(views["master"], grad_views, views["exp_avg"], views["exp_avg_sq"], step=step, **hyper)
