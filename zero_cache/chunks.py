"""Chunk storage: the param chunks on the device and each chunk's optimizer group in its planned tier.

Every parameter becomes a view into its chunk (``param.data`` is rebound), so a model state exists
exactly once. The optimizer group of a chunk (fp32 master, exp_avg, exp_avg_sq, and the gradient)
lives in the tier the plan names; moving it (re-planning) copies it to the other tier and frees
the old one.
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
    """One chunk's optimizer state in one tier: fp32 master, exp_avg, exp_avg_sq, and the gradient.

    The gradient is kept in the compute dtype when every window is a single micro-batch (the
    update reads it through an fp32 scratch chunk), and in fp32 when micro-batches accumulate.
    """

    tier: str
    states: torch.Tensor
    """3 x chunk_numel fp32: master | exp_avg | exp_avg_sq."""
    grad: torch.Tensor
    """chunk_numel gradient (compute dtype or fp32)."""

    def field(self, name: str) -> torch.Tensor:
        if name == "grad":
            return self.grad
        numel = self.grad.numel()
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
        grad_dtype: dtype of the gradient chunks (see :class:`OptimizerGroup`).
    """

    def __init__(self, layout: ChunkLayout, params: list[nn.Parameter], plan: Plan, tiers: dict[str, Tier],
                 compute_dtype: torch.dtype, grad_dtype: torch.dtype = torch.float32) -> None:
        if not plan.params_resident:
            raise NotImplementedError(
                "this plan streams param chunks from the host (the params alone exceed the device budget); only "
                "device-resident params are implemented so far: raise zero_cache.device_memory_budget")
        self.layout = layout
        self.tiers = tiers
        self.params = params
        self.slots: list[TensorSlot] = list(layout.slots)
        self.param_chunks = [tiers[DEVICE].allocate(layout.chunk_numel, compute_dtype) for _ in range(layout.num_chunks)]
        self.grad_dtype = grad_dtype
        self.groups = [self._allocate_group(tier) for tier in plan.optimizer_tier]
        # One fp32 chunk per tier through which the update reads low-precision gradients.
        self.scratch = {name: tier.allocate(layout.chunk_numel, torch.float32) for name, tier in tiers.items()}
        with torch.no_grad():
            for param, slot in zip(params, self.slots):
                view = self.param_view(slot)
                view.copy_(param.detach())
                # Masters start from the compute-dtype weights, as a mixed-precision loop's would.
                self.state_view(slot, "master").copy_(view.reshape(-1))
                param.data = view  # the original storage is released; the chunk is the only copy

    def _allocate_group(self, tier: str) -> OptimizerGroup:
        numel = self.layout.chunk_numel
        return OptimizerGroup(tier=tier, states=self.tiers[tier].allocate(len(STATE_FIELDS) * numel, torch.float32),
                              grad=self.tiers[tier].allocate(numel, self.grad_dtype))

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
            new.grad.copy_(old.grad)
            self.tiers[old.tier].free(old.states)
            self.tiers[old.tier].free(old.grad)
            self.groups[chunk] = new
        return len(moves)
