"""The accumulation window's bookkeeping: what one window's backwards have written, and what is still to come.

A window runs from one step (or ``zero_grad()``) to the next. The gradient intake
(:mod:`zero_cache.optim.optimizer_gradients`) fills it as autograd hands over gradients, the sharded side
(:mod:`zero_cache.optim.optimizer_sharded`) as reductions land, and the step reads it and starts it again. Kept in
one object so that those three share it by name rather than through a dozen attributes of the optimizer.
"""

from __future__ import annotations

from typing import Callable

import torch

from zero_cache.optim.revision import SpeculationWindow
from zero_cache.plan.layout import TensorSlot


class AccumulationWindow:
    """What the current accumulation window has received, per slot, chunk and collective group.

    Args:
        members_of_chunk: chunk -> its (param-group index, slot) members (chunks of trainable parameters only).
        num_chunks: chunks in the layout (padding chunks included).
        group_of: chunk -> its collective group (:meth:`Sharding.group_of
            <zero_cache.base.sharding.Sharding.group_of>`).
        num_groups: collective groups.
        device: where the per-chunk squared norms are summed (pinned staging beside them on CUDA).
    """

    def __init__(self, members_of_chunk: dict[int, list[tuple[int, TensorSlot]]], *, num_chunks: int,
                 group_of: Callable[[int], int], num_groups: int, device: torch.device) -> None:
        self.members_of_chunk = members_of_chunk
        self.group_of = group_of
        # Squared gradient norms: per chunk on the device (in-param gradients), per host slot from
        # the worker (host accumulators); both summed once per step.
        self.chunk_squares = torch.zeros(num_chunks, dtype=torch.float32, device=device)
        self.squares_pinned = torch.zeros(num_chunks, dtype=torch.float32, pin_memory=device.type == "cuda")
        self.host_squares: list[float] = []
        self.completed_order: list[TensorSlot] = []  # slots in the order the window's last backward wrote them
        self.written: set[str] = set()  # slots that received a gradient in this accumulation window
        self.group_missing: list[int] = [0] * num_groups  # gradients still to come per collective group
        self.accumulated: set[int] = set()  # sharded, accumulating: owned chunks that received a reduced slice
        self.micro_step_open = False  # sharded, accumulating: this micro-step wrote a gradient bucket
        self.missing: dict[int, int] = {}  # gradients still to come per chunk, this window
        self.speculation: SpeculationWindow | None = None  # this window's speculation (zero_cache.optim.revision)

    def reset(self) -> None:
        """Start a new window, but for the group counts (:meth:`reset_group_counts`, which a micro-step resets too)."""
        self.written.clear()
        self.speculation = None
        self.accumulated.clear()
        self.host_squares.clear()
        self.completed_order.clear()
        self.chunk_squares.zero_()
        self.missing = {chunk: len(members) for chunk, members in self.members_of_chunk.items()}

    def reset_group_counts(self) -> None:
        """Gradients to come per collective group in the next backward."""
        self.group_missing = [0] * len(self.group_missing)
        for chunk, members in self.members_of_chunk.items():
            self.group_missing[self.group_of(chunk)] += len(members)
