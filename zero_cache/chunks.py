"""Chunk storage: the param chunks on the device and each chunk's optimizer group in its planned tier.

Every parameter becomes a view into its chunk (``param.data`` is rebound), so a model state exists
exactly once. The optimizer group of a chunk (fp32 master, exp_avg, exp_avg_sq, and an fp32
gradient accumulator when micro-batches accumulate) lives in the tier the plan names; moving it
(re-planning) copies it to the other tier and frees the old one.

When every step is one micro-batch there is no gradient buffer at all: as PatrickStar does, a
parameter's gradient is written over the parameter itself once backward has produced it (the
parameter is not read again in that iteration, and the fp32 master regenerates it at the step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from zero_cache.layout import ChunkLayout, TensorSlot
from zero_cache.planner import DEVICE, Plan
from zero_cache.tiers import Tier

STATE_FIELDS = ("master", "exp_avg", "exp_avg_sq")


@dataclass(slots=True)
class OptimizerGroup:
    """One chunk's optimizer state in one tier: fp32 master, exp_avg, exp_avg_sq (and a gradient accumulator)."""

    tier: str
    states: torch.Tensor
    """3 x chunk_numel fp32: master | exp_avg | exp_avg_sq."""
    grad: torch.Tensor | None
    """chunk_numel fp32 gradient accumulator, or None when gradients are written into the param chunk."""

    def field(self, name: str) -> torch.Tensor:
        if name == "grad":
            assert self.grad is not None, "gradients live in the param chunk"
            return self.grad
        numel = self.states.numel() // len(STATE_FIELDS)
        index = STATE_FIELDS.index(name)
        return self.states[index * numel:(index + 1) * numel]


class ChunkStore:
    """Owns every chunk's storage and binds the module's parameters to views of it.

    Args:
        layout: the chunk layout of the trainable parameters.
        params: parameter objects in layout order.
        plan: where each chunk's optimizer group lives (params must be resident).
        tiers: {"device": Tier, "host": Tier}.
        compute_dtype: dtype of the param chunks.
        accumulate: keep an fp32 gradient accumulator per chunk (micro-batches accumulate); without
            it, gradients are written into the param chunks.
    """

    def __init__(self, layout: ChunkLayout, params: list[nn.Parameter], plan: Plan, tiers: dict[str, Tier],
                 compute_dtype: torch.dtype, accumulate: bool = True) -> None:
        if not plan.params_resident:
            raise NotImplementedError(
                "this plan streams param chunks from the host (the params alone exceed the device budget); only "
                "device-resident params are implemented so far: raise zero_cache.device_memory_budget")
        self.layout = layout
        self.tiers = tiers
        self.params = params
        self.slots: list[TensorSlot] = list(layout.slots)
        self.param_chunks = [tiers[DEVICE].allocate(layout.chunk_numel, compute_dtype) for _ in range(layout.num_chunks)]
        with torch.no_grad():
            for param, slot in zip(params, self.slots):
                view = self.param_view(slot)
                view.copy_(param.detach())
                param.data = view  # the original storage is released; the chunk is the only copy
        # Optimizer groups only now, so the device never holds the original params and the groups at once.
        self.grads_in_accumulators = accumulate
        self.groups = [self._allocate_group(tier) for tier in plan.optimizer_tier]
        # One fp32 chunk per tier through which the update reads compute-dtype gradients.
        self.scratch = {name: tier.allocate(layout.chunk_numel, torch.float32) for name, tier in tiers.items()}
        for group, param_chunk in zip(self.groups, self.param_chunks):
            # Masters start from the compute-dtype weights, as a mixed-precision loop's would.
            group.field("master").copy_(param_chunk)

    def _allocate_group(self, tier: str) -> OptimizerGroup:
        numel = self.layout.chunk_numel
        grad = self.tiers[tier].allocate(numel, torch.float32) if self.grads_in_accumulators else None
        return OptimizerGroup(tier=tier, states=self.tiers[tier].allocate(len(STATE_FIELDS) * numel, torch.float32),
                              grad=grad)

    def param_view(self, slot: TensorSlot) -> torch.Tensor:
        """The parameter's compute-dtype view (shaped)."""
        return self.param_chunks[slot.chunk][slot.offset:slot.offset + slot.numel].view(slot.shape)

    def state_view(self, slot: TensorSlot, field: str) -> torch.Tensor:
        """A flat view of one optimizer field (master, exp_avg, exp_avg_sq, grad) of one parameter."""
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
            new = self._allocate_group(plan.optimizer_tier[chunk])
            new.states.copy_(old.states)
            self.tiers[old.tier].free(old.states)
            if old.grad is not None:
                new.grad.copy_(old.grad)
                self.tiers[old.tier].free(old.grad)
            self.groups[chunk] = new
        return len(moves)
