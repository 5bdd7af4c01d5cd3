"""Where a chunk's optimizer group lives: its **state home**, one class per kind (device, host, another rank here;
NVMe in :mod:`zero_cache.storage.state_homes.nvme`), registered by tier name in
:mod:`zero_cache.storage.state_homes.registry`.

The store and the step ask a group's home, never its tier's name:

* ``allocate`` / ``free``: room for a group's states (and its fp32 gradient accumulator), and giving it back;
  ``held_bytes``: what that takes in the tiers' budgets (a re-plan orders its moves by it);
* ``open``: the states readable (and writable) in memory for a block: setup, moves, checkpoints;
* ``fetch`` / ``write_back`` / ``give_back``: the states made usable for one update by the host worker, put back
  after it (or given back unused);
* ``route`` (from ``costs``): which Adam updates the group (:class:`~zero_cache.plan.state_costs.Route`).

What a home costs the plan is in :mod:`zero_cache.plan.state_costs` (``costs``), the one place it is written.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ClassVar, Iterator

import torch

from zero_cache.plan.state_costs import STATE_COSTS, Route, StateCosts
from zero_cache.plan.tier_names import DEVICE, HOST, REMOTE, TierName

STATE_FIELDS = ("master", "exp_avg", "exp_avg_sq")
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""``ZeroCacheConfig.state_dtype`` -> the torch dtype of a group's states and gradient accumulator."""
_COST_FLAGS = ("name", "route", "resident", "device_steppable", "owned")


def state_field(states: torch.Tensor, field: str) -> torch.Tensor:
    """One field (master, exp_avg or exp_avg_sq) of a group's flat states (fp32, or bf16: the home's ``dtype``)."""
    numel = states.numel() // len(STATE_FIELDS)
    index = STATE_FIELDS.index(field)
    return states[index * numel:(index + 1) * numel]


@dataclass(slots=True)
class OptimizerGroup:
    """One chunk's optimizer state: master, exp_avg, exp_avg_sq in one home (and a gradient accumulator), all in the
    home's state dtype (fp32, or bf16)."""

    home: StateHome
    """Where the states live (:mod:`zero_cache.storage.state_homes.registry`); the store and the step ask it."""
    states: torch.Tensor | None
    """3 x chunk_numel in the state dtype: master | exp_avg | exp_avg_sq; None where the home keeps them out of
    memory (a swap slot) or another rank holds them."""
    grad: torch.Tensor | None
    """chunk_numel gradient accumulator in the state dtype (on the host for NVMe groups), or None when gradients
    are written into the param chunk."""
    swap_offset: int | None = None
    """Byte offset of the states' slot in the swap file (NVMe groups)."""
    kept: torch.Tensor | None = None
    """chunk_numel in the compute dtype, on the host: the gradient a during-backward update used, kept until the
    step knows the global norm (:mod:`zero_cache.optim.revision`); None for chunks updated after backward."""

    @property
    def tier(self) -> str:
        """The name of its home's tier (what the plan's ``optimizer_tier`` says)."""
        return self.home.name

    def field(self, name: str) -> torch.Tensor:
        if name == "grad":
            assert self.grad is not None, "gradients live in the param chunk"
            return self.grad
        assert self.states is not None, "an NVMe group's states are read through ChunkStore.open_states"
        return state_field(self.states, name)


@dataclass(slots=True)
class FetchedStates:
    """A group's states made usable for one update (:meth:`StateHome.fetch`)."""

    home: StateHome
    """The home that fetched them, which takes them back (:meth:`StateHome.write_back`, :meth:`StateHome.give_back`)."""
    states: torch.Tensor
    """The states (master | exp_avg | exp_avg_sq, in the state dtype), valid once ``ready`` is done."""
    ready: Any = None
    """What to wait for before reading them (a disk read), or None."""
    buffer: torch.Tensor | None = None
    """The home's buffer holding them, which :meth:`StateHome.write_back` or :meth:`StateHome.give_back` returns."""


class StateHome:
    """A kind of home for optimizer groups: where their states live, how a step reaches them, and (from ``costs``)
    how they are updated. This base keeps them in the memory of the tier it is named after.

    Args:
        tiers: the store's tiers by name.
        numel: elements of one chunk.
        accumulate: groups carry a gradient accumulator (micro-batches accumulate).
        dtype: the states' and accumulator's dtype (fp32, or bf16: ``ZeroCacheConfig.state_dtype``).
    """

    costs: ClassVar[StateCosts]
    """What the planner prices a home of this kind at (:mod:`zero_cache.plan.state_costs`); the flags below are copied
    from it when the class is defined."""
    name: ClassVar[TierName]
    route: ClassVar[Route]
    """Which Adam updates its groups."""
    resident: ClassVar[bool]
    """The states stay in ``OptimizerGroup.states`` between updates (``StateCosts.resident``)."""
    device_steppable: ClassVar[bool]
    """Its groups may be stepped on the device after backward (``StateCosts.device_steppable``)."""
    owned: ClassVar[bool]
    """This rank holds and updates its groups."""
    grad_tier: ClassVar[TierName]
    """The tier holding its groups' gradient accumulators."""
    bounce_buffers: Any = None
    """The pinned buffers its states pass through on their way to and from disk, if any (the warm-up times the
    disk through one)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "costs" in cls.__dict__:
            for flag in _COST_FLAGS:
                setattr(cls, flag, getattr(cls.costs, flag))
            if "grad_tier" not in cls.__dict__:
                cls.grad_tier = cls.costs.name

    @classmethod
    def present(cls, tiers: dict[str, Any]) -> bool:
        """Whether the store's ``tiers`` can hold a home of this kind (its tier is there)."""
        return cls.name in tiers

    def __init__(self, tiers: dict[str, Any], numel: int, accumulate: bool,
                 dtype: torch.dtype = torch.float32) -> None:
        self.tiers, self.numel, self.accumulate, self.dtype = tiers, numel, accumulate, dtype

    # ------------------------------------------------------------------ room
    def allocate(self) -> OptimizerGroup:
        """A new group here, its states and accumulator zeroed."""
        states = self.tiers[self.name].allocate(len(STATE_FIELDS) * self.numel, self.dtype)
        return OptimizerGroup(home=self, states=states, grad=self._allocate_grad())

    def _allocate_grad(self) -> torch.Tensor | None:
        return self.tiers[self.grad_tier].allocate(self.numel, self.dtype) if self.accumulate else None

    def free(self, group: OptimizerGroup) -> None:
        """Give back what :meth:`allocate` took (its kept gradient is the store's)."""
        self.tiers[self.name].free(group.states)
        if group.grad is not None:
            self.tiers[self.grad_tier].free(group.grad)

    def held_bytes(self) -> dict[str, int]:
        """Tier -> bytes a group here holds in the tiers' budgets (what :meth:`allocate` takes, :meth:`free` gives
        back): its states, and its accumulator where micro-batches accumulate."""
        held = {self.name: len(STATE_FIELDS) * self.numel * self.dtype.itemsize}
        return self._with_grad_bytes(held)

    def _with_grad_bytes(self, held: dict[str, int]) -> dict[str, int]:
        if self.accumulate:
            held[self.grad_tier] = held.get(self.grad_tier, 0) + self.numel * self.dtype.itemsize
        return held

    # ------------------------------------------------------------------ the states
    @contextlib.contextmanager
    def open(self, group: OptimizerGroup, *, write_back: bool = False, fresh: bool = False
             ) -> Iterator[torch.Tensor]:
        """The group's states in memory for the block; synchronous (setup, moves, checkpoints), never on the
        training path. ``fresh``: a new group's (zeros); ``write_back``: changes go home at the end."""
        yield group.states

    def fetch(self, group: OptimizerGroup) -> FetchedStates:
        """Start making the group's states usable for the host's Adam (the worker, one update ahead)."""
        return FetchedStates(home=self, states=group.states)

    def write_back(self, group: OptimizerGroup, fetched: FetchedStates, changed: bool) -> None:
        """Put :meth:`fetch`'s states home after the update (``changed``: it wrote them) and free what held them."""

    def give_back(self, fetched: FetchedStates) -> None:
        """Free what :meth:`fetch` took without writing it home (a deferred or failed update)."""

    # ------------------------------------------------------------------ the home's own resources
    def trim(self) -> None:
        """Give back the host memory the home holds beside its groups that no group here needs now (a re-plan moved
        them all out); between steps, with the work in flight finished. Nothing by default."""

    def flush(self) -> None:
        """Wait for the writes in flight (raise a failed one's error)."""

    def close(self) -> None:
        """Free what the home holds outside the tiers' memory (a swap file)."""

    def disk_report(self) -> dict[str, int]:
        """Disk bytes read and written since the last report ("read", "write")."""
        return {}

    def use_timeline(self, timeline: Any) -> None:
        """While a step is traced, the home's disk requests go on the timeline's ``disk`` track."""


class DeviceStates(StateHome):
    """The states live in device memory and the device's fused Adam updates them in place after backward."""

    costs = STATE_COSTS[DEVICE]


class HostStates(StateHome):
    """The states live in pinned host memory: the host worker's CPU Adam updates them in place, or (the plan's first
    host groups) the device steps them after backward, copying them in and back
    (:mod:`zero_cache.optim.device_steps`)."""

    costs = STATE_COSTS[HOST]


class RemoteStates(StateHome):
    """Another data-parallel rank owns the group: this rank holds nothing of it and never updates it."""

    costs = STATE_COSTS[REMOTE]

    @classmethod
    def present(cls, tiers: dict[str, Any]) -> bool:
        return True

    def allocate(self) -> OptimizerGroup:
        return OptimizerGroup(home=self, states=None, grad=None)

    def free(self, group: OptimizerGroup) -> None:
        pass

    def held_bytes(self) -> dict[str, int]:
        return {}

    @contextlib.contextmanager
    def open(self, group: OptimizerGroup, *, write_back: bool = False, fresh: bool = False
             ) -> Iterator[torch.Tensor]:
        raise AssertionError("the optimizer group is on another rank")
        yield  # (a generator)
