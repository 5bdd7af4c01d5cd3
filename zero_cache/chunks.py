"""Chunk storage: the param chunks on the device and each chunk's optimizer group in its planned tier.

Every parameter becomes a view into its chunk (``param.data`` is rebound), so a model state exists
exactly once. The optimizer group of a chunk (fp32 master, exp_avg, exp_avg_sq, fp32 gradient
accumulator) is one allocation of 4 x chunk_numel fp32 in the tier the plan names; moving it
(re-planning) copies it to the other tier and frees the old one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from zero_cache.layout import ChunkLayout, TensorSlot
from zero_cache.planner import DEVICE, Plan
from zero_cache.tiers import Tier

OPTIMIZER_FIELDS = ("master", "exp_avg", "exp_avg_sq", "grad")


@dataclass(slots=True)
class OptimizerGroup:
    """One chunk's fp32 optimizer state: four views into one flat buffer in one tier."""

    tier: str
    buffer: torch.Tensor
    """4 x chunk_numel fp32: master | exp_avg | exp_avg_sq | grad."""

    def field(self, name: str) -> torch.Tensor:
        numel = self.buffer.numel() // len(OPTIMIZER_FIELDS)
        index = OPTIMIZER_FIELDS.index(name)
        return self.buffer[index * numel:(index + 1) * numel]


class ChunkStore:
    """Owns every chunk's storage and binds the module's parameters to views of it.

    Args:
        layout: the chunk layout of the trainable parameters.
        params: parameter objects in layout order.
        plan: where each chunk's optimizer group lives (params must be resident).
        tiers: {"device": Tier, "host": Tier}.
        compute_dtype: dtype of the param chunks.
    """

    def __init__(self, layout: ChunkLayout, params: list[nn.Parameter], plan: Plan, tiers: dict[str, Tier],
                 compute_dtype: torch.dtype) -> None:
        if not plan.params_resident:
            raise NotImplementedError(
                "this plan streams param chunks from the host (the params alone exceed the device budget); only "
                "device-resident params are implemented so far: raise zero_cache.device_memory_budget")
        self.layout = layout
        self.tiers = tiers
        self.params = params
        self.slots: list[TensorSlot] = list(layout.slots)
        self.param_chunks = [tiers[DEVICE].allocate(layout.chunk_numel, compute_dtype) for _ in range(layout.num_chunks)]
        self.groups: list[OptimizerGroup] = []
        for chunk, tier in enumerate(plan.optimizer_tier):
            buffer = tiers[tier].allocate(len(OPTIMIZER_FIELDS) * layout.chunk_numel, torch.float32)
            self.groups.append(OptimizerGroup(tier=tier, buffer=buffer))
        with torch.no_grad():
            for param, slot in zip(params, self.slots):
                view = self.param_view(slot)
                view.copy_(param.detach())
                # Masters start from the compute-dtype weights, as a mixed-precision loop's would.
                self.state_view(slot, "master").copy_(view.reshape(-1))
                param.data = view  # the original storage is released; the chunk is the only copy

    def param_view(self, slot: TensorSlot) -> torch.Tensor:
        """The parameter's compute-dtype view (shaped)."""
        return self.param_chunks[slot.chunk][slot.offset:slot.offset + slot.numel].view(slot.shape)

    def state_view(self, slot: TensorSlot, field: str) -> torch.Tensor:
        """A flat fp32 view of one optimizer field of one parameter."""
        return self.groups[slot.chunk].field(field)[slot.offset:slot.offset + slot.numel]

    def tier_of(self, slot: TensorSlot) -> str:
        return self.groups[slot.chunk].tier

    def apply_plan(self, plan: Plan) -> int:
        """Move optimizer groups whose tier changed; returns the number moved.

        Groups leaving a tier are moved first, so a swap never needs both copies in one tier.
        """
        moves = [c for c, tier in enumerate(plan.optimizer_tier) if self.groups[c].tier != tier]
        moves.sort(key=lambda c: plan.optimizer_tier[c] == DEVICE)  # device->host first frees device room
        for chunk in moves:
            old = self.groups[chunk]
            target = plan.optimizer_tier[chunk]
            buffer = self.tiers[target].allocate(old.buffer.numel(), torch.float32)
            buffer.copy_(old.buffer)
            self.tiers[old.tier].free(old.buffer)
            self.groups[chunk] = OptimizerGroup(tier=target, buffer=buffer)
        return len(moves)

    def tier_bytes(self) -> dict[str, int]:
        """Bytes in use per tier."""
        return {name: tier.used_bytes for name, tier in self.tiers.items()}
