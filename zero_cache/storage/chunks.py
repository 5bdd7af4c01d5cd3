"""Chunk storage: the param chunks on the device and each chunk's optimizer group in its planned tier.

Every parameter becomes a view into its chunk (``param.data`` is rebound), so a model state exists
exactly once. With gathered params (``shard_params``) a rank stores only its own chunk of each
collective group (its shard; on one rank, each chunk) and the parameters are placeholders except
while their group is gathered. Each shard has a **home** (:mod:`zero_cache.storage.param_homes.registry`): the device,
or pinned host memory or NVMe, from which it is copied in on use and into which its gradients are
written back (the plan's ``param_home``), so the model's weights need not fit on the device.

The optimizer group of a chunk (master, exp_avg, exp_avg_sq, and a gradient accumulator when micro-batches
accumulate, all fp32, or all bf16 under DeepSpeed's ``bf16_master_weights_and_grads`` + ``bf16_optimizer_states``)
lives in a **state home** (:mod:`zero_cache.storage.state_homes.registry`) of the tier
the plan names, which allocates it, makes it usable and says which Adam updates it; moving it (re-planning)
copies it to the new home and frees the old one.

When every step is one micro-batch there is no gradient buffer at all: as PatrickStar does, a
parameter's gradient is written over the parameter itself once backward has produced it (the
parameter is not read again in that iteration, and the fp32 master regenerates it at the step).
Sharded params reduce from gradient buckets into the shard instead, with the same effect.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch
from torch import nn

from zero_cache.base.sharding import Sharding
from zero_cache.plan.layout import ChunkLayout, TensorSlot
from zero_cache.plan.moves import Move, fits, next_move
from zero_cache.plan.planner import Plan
from zero_cache.plan.state_costs import STATE_FILL_ORDER
from zero_cache.plan.tier_names import DEVICE, HOST, BudgetedTier
from zero_cache.storage.param_homes.registry import ParamHome, home_class
from zero_cache.storage.state_homes.home import (  # noqa: F401  (re-exported)
    STATE_FIELDS,
    OptimizerGroup,
    StateHome,
    state_field,
)
from zero_cache.storage.state_homes.registry import state_homes


class ChunkStore:
    """Owns every chunk's storage and binds the module's parameters to views of it.

    Args:
        layout: the chunk layout of the trainable parameters.
        params: parameter objects in layout order.
        plan: where each chunk's optimizer group lives, and (gathered params) each shard's home.
        tiers: {"device": Tier, "host": Tier} and, when the plan uses disk, "nvme": NvmeTier.
        compute_dtype: dtype of the param chunks.
        accumulate: keep a gradient accumulator per chunk (micro-batches accumulate); without
            it, gradients are written into the param chunks.
        state_dtype: the optimizer groups' dtype (fp32, or bf16), of their states, accumulators and the scratch.
        sharding: which chunks' optimizer groups this rank owns; param chunks are allocated a
            collective group (one chunk per rank) at a time, in one buffer each.
        shard_params: keep only this rank's chunk of each group (its *shard*) in its planned home; groups
            are gathered while in use (:mod:`zero_cache.runtime.gathered`) and the parameters are placeholders
            meanwhile.
    """

    def __init__(self, layout: ChunkLayout, params: list[nn.Parameter], plan: Plan, tiers: dict[str, BudgetedTier],
                 compute_dtype: torch.dtype, accumulate: bool = True, sharding: Sharding = Sharding(),
                 shard_params: bool = False, state_dtype: torch.dtype = torch.float32) -> None:
        assert shard_params == plan.params_sharded, "gathered params and the plan disagree"
        self.layout = layout
        self.tiers = tiers
        self.params = params
        self.plan = plan
        """The plan in force (the re-plan after warm-up replaces it): its placement and predicted step cost."""
        self._spare_kept: list[torch.Tensor] = []  # kept gradients a trial plan dropped, for the next to reuse
        self.slots: list[TensorSlot] = list(layout.slots)
        self._slots_of_chunk: dict[int, list[int]] = {c: [] for c in range(layout.num_chunks)}
        for index, slot in enumerate(self.slots):
            self._slots_of_chunk[slot.chunk].append(index)
        self.sharding = sharding
        self.compute_dtype = compute_dtype
        self.state_dtype = state_dtype
        self.shard_params = shard_params
        num_groups = sharding.num_groups(layout.num_chunks)
        self.group_buffers: list[torch.Tensor] = []
        """Replicated params: one buffer per collective group; param chunk c is slice c % W of buffer c // W
        (zero padding)."""
        self.shards: list[torch.Tensor] = []
        """Sharded params: this rank's chunk of each group (zeros where its slot is padding)."""
        self.param_home: list[str] = list(plan.param_home)
        """Gathered params: the tier name of each group's home (this rank's shard)."""
        self.homes: dict[str, ParamHome] = {}
        """The homes in use by tier name (:mod:`zero_cache.storage.param_homes.registry`); replicated params are at home
        on the device."""
        self._home_named(DEVICE)
        self.param_chunks: list[torch.Tensor | None] = []
        if shard_params:
            # (None where the home is not memory: a shard on NVMe)
            self.shards = [self._home_named(home).allocate(g) for g, home in enumerate(self.param_home)]
            self._index_param_chunks()
        else:
            self.group_buffers = [tiers[DEVICE].allocate(sharding.world_size * layout.chunk_numel, compute_dtype)
                                  for _ in range(num_groups)]
            self.param_chunks = [chunk for buffer in self.group_buffers
                                 for chunk in buffer.view(sharding.world_size, -1).unbind()][:layout.num_chunks]
        # NaN: a placeholder read by mistake (a weight used outside its module's forward) shows in the loss.
        self._placeholder = torch.full((1,), float("nan"), dtype=compute_dtype, device=tiers[DEVICE].device)
        with torch.no_grad():
            for chunk, indices in self._slots_of_chunk.items():
                with self.open_params(chunk, fresh=True, write_back=True) as values:
                    for index in indices:
                        slot, param = self.slots[index], params[index]
                        if values is not None:
                            values[slot.offset:slot.offset + slot.numel].view(slot.shape).copy_(param.detach())
                        # The original storage is released: the chunk (or, sharded, the owner's shard) is the only
                        # copy.
                        param.data = self.placeholder(slot) if shard_params else self.param_view(slot)
        # One chunk per memory tier, in the state dtype, through which the update reads gradients of another dtype.
        self.scratch = {name: tiers[name].allocate(layout.chunk_numel, state_dtype) for name in (DEVICE, HOST)}
        # Optimizer groups only now, so the device never holds the original params and the groups at once.
        self.grads_in_accumulators = accumulate
        self.state_homes: dict[str, StateHome] = state_homes(tiers, layout.chunk_numel, accumulate,
                                                                   state_dtype)
        """The optimizer groups' homes by tier name (:mod:`zero_cache.storage.state_homes.registry`), those the tiers
        can hold."""
        self.groups: list[OptimizerGroup] = []
        for chunk, tier in enumerate(plan.optimizer_tier):
            self.groups.append(self.state_homes[tier].allocate())
            if not self.groups[chunk].home.owned:
                continue
            if chunk in plan.kept_gradients:
                self.groups[chunk].kept = self._allocate_kept()
            with self.open_states(chunk, write_back=True, fresh=True) as states, self.open_params(chunk) as values:
                # Masters start from the compute-dtype weights, as a mixed-precision loop's would.
                state_field(states, "master").copy_(values)

    def _index_param_chunks(self) -> None:
        """Gathered params: this rank's param chunks are its shards (the others are None)."""
        self.param_chunks = [self.shards[self.sharding.group_of(c)] if self.sharding.owns(c) else None
                             for c in range(self.layout.num_chunks)]

    def home_of(self, chunk: int) -> str:
        """Where ``chunk``'s params live between uses (DEVICE unless gathered params put its shard elsewhere)."""
        return self.param_home[self.sharding.group_of(chunk)] if self.shard_params else DEVICE

    def home(self, chunk: int) -> ParamHome:
        """The home of ``chunk``'s params (:mod:`zero_cache.storage.param_homes.registry`)."""
        return self.homes[self.home_of(chunk)]

    def group_home(self, group: int) -> ParamHome:
        """The home of this rank's shard of ``group`` (gathered params)."""
        return self.homes[self.param_home[group]]

    def _home_named(self, name: str, plan: Plan | None = None) -> ParamHome:
        """The home of that name, made at its first use (sized for ``plan``'s shards there, or the plan in force)."""
        if name not in self.homes:
            self.homes[name] = home_class(name)(self.tiers, self.layout.chunk_numel, self.compute_dtype,
                                                num_shards=(plan or self.plan).param_home.count(name))
        return self.homes[name]

    @contextlib.contextmanager
    def open_params(self, chunk: int, *, fresh: bool = False, write_back: bool = False
                    ) -> Iterator[torch.Tensor | None]:
        """``chunk``'s params in memory for the block (None: another rank's shard); synchronous, for setup, moves
        and checkpoints. ``fresh``: the old values are not needed; ``write_back``: changes go home at the end."""
        if not self.shard_params:
            yield self.param_chunks[chunk]
        elif not self.sharding.owns(chunk):
            yield None
        else:
            group = self.sharding.group_of(chunk)
            with self.group_home(group).open(group, self.shards[group], fresh=fresh, write_back=write_back) as values:
                yield values

    def _move_shard(self, group: int, plan: Plan) -> None:
        """Collective group ``group``'s shard to the home ``plan`` names."""
        old, new = self.group_home(group), self._home_named(plan.param_home[group], plan)
        shard = new.allocate(group)
        with old.open(group, self.shards[group]) as values, \
                new.open(group, shard, fresh=True, write_back=True) as destination:
            destination.copy_(values)
        old.free(group, self.shards[group])
        self.shards[group], self.param_home[group] = shard, plan.param_home[group]

    def _move_group(self, chunk: int, plan: Plan) -> None:
        """``chunk``'s optimizer group (states, accumulator, kept gradient) to the tier ``plan`` names."""
        old = self.groups[chunk]
        with self.open_states(chunk) as states:
            new = self.state_homes[plan.optimizer_tier[chunk]].allocate()
            self.groups[chunk] = new
            with self.open_states(chunk, write_back=True, fresh=True) as destination:
                destination.copy_(states)
        if old.grad is not None:
            new.grad.copy_(old.grad)
        new.kept, old.kept = old.kept, None  # (host memory either way)
        self._free_group(old)

    @property
    def spare_kept(self) -> int:
        """Kept gradients a trial plan dropped, there for the next to take (:meth:`apply_plan`)."""
        return len(self._spare_kept)

    def release_kept(self, chunks: Iterable[int], *, spare: bool) -> None:
        """Let go of the kept gradients :meth:`apply_plan` retained for ``chunks`` (no host work reads them now): to
        the spares while counts are tried, else freed."""
        for chunk in chunks:
            group = self.groups[chunk]
            if group.kept is None or chunk in self.plan.kept_gradients:
                continue
            if spare:
                self._spare_kept.append(group.kept)
            else:
                self.tiers[HOST].free(group.kept)
            group.kept = None

    def _allocate_kept(self) -> torch.Tensor:
        """A kept gradient (:attr:`OptimizerGroup.kept`): one param chunk in the compute dtype, on the host."""
        return self.tiers[HOST].allocate(self.layout.chunk_numel, self.compute_dtype, zero=False)

    def _free_group(self, group: OptimizerGroup) -> None:
        group.home.free(group)
        if group.kept is not None:
            self.tiers[HOST].free(group.kept)

    def slots_of(self, chunk: int) -> list[TensorSlot]:
        """The tensors packed into ``chunk``."""
        return [self.slots[index] for index in self._slots_of_chunk[chunk]]

    def param_view(self, slot: TensorSlot) -> torch.Tensor:
        """The parameter's compute-dtype view (shaped) in its param chunk (sharded params: owned chunks only)."""
        chunk = self.param_chunks[slot.chunk]
        assert chunk is not None, f"{slot.name} is in a chunk another rank holds"
        return chunk[slot.offset:slot.offset + slot.numel].view(slot.shape)

    def placeholder(self, slot: TensorSlot) -> torch.Tensor:
        """What a sharded parameter holds while its group is not gathered: its shape, one element of memory."""
        return self._placeholder.expand(slot.shape)

    def bind_group(self, group: int, buffer: torch.Tensor) -> None:
        """Sharded params: point the parameters of ``group`` at a gathered ``buffer`` of the whole group."""
        chunks = buffer.view(self.sharding.world_size, -1)
        for chunk in self.sharding.group_chunks(group, self.layout.num_chunks):
            whole = chunks[chunk % self.sharding.world_size]
            for index in self._slots_of_chunk[chunk]:
                slot = self.slots[index]
                self.params[index].data = whole[slot.offset:slot.offset + slot.numel].view(slot.shape)

    def unbind_group(self, group: int) -> None:
        """Sharded params: turn the parameters of ``group`` back into placeholders."""
        for chunk in self.sharding.group_chunks(group, self.layout.num_chunks):
            for index in self._slots_of_chunk[chunk]:
                self.params[index].data = self.placeholder(self.slots[index])

    def state_view(self, slot: TensorSlot, field: str, states: torch.Tensor | None = None) -> torch.Tensor:
        """A flat view of one optimizer field (master, exp_avg, exp_avg_sq, grad) of one parameter.

        ``states`` are the chunk's states when they are not resident (an NVMe group read into a buffer).
        """
        whole = (self.groups[slot.chunk].field(field) if states is None or field == "grad"
                 else state_field(states, field))
        return whole[slot.offset:slot.offset + slot.numel]

    def state_home(self, chunk: int) -> StateHome:
        """The home of ``chunk``'s optimizer group (:mod:`zero_cache.storage.state_homes.registry`): which Adam updates
        it, and how its states are reached."""
        return self.groups[chunk].home

    @contextlib.contextmanager
    def lent_bounce_buffer(self) -> Iterator[torch.Tensor | None]:
        """A free pinned buffer of the bounce buffers the optimizer states pass through to and from their home (NVMe),
        lent for the block where a group of this store lives in such a home (so the buffer is in the host's plan);
        None where no group does, or none is free now. For a probe of the disk through the step's own buffers."""
        pool = next((group.home.bounce_buffers for group in self.groups if group.home.bounce_buffers is not None),
                    None)
        buffer = pool.try_acquire() if pool is not None else None
        try:
            yield buffer
        finally:
            if buffer is not None:
                pool.release(buffer)

    @contextlib.contextmanager
    def open_states(self, chunk: int, *, write_back: bool = False, fresh: bool = False) -> Iterator[torch.Tensor]:
        """The chunk's fp32 states, readable (and writable) in memory for the duration of the block
        (:meth:`StateHome.open <zero_cache.storage.state_homes.home.StateHome.open>`): resident groups as they are, an
        NVMe group through a bounce buffer (zeroed instead when ``fresh``: a new group has no states yet), written back
        with ``write_back``. Synchronous: for checkpoints, initialisation and re-planning, never on the training path.
        """
        group = self.groups[chunk]
        with group.home.open(group, write_back=write_back, fresh=fresh) as states:
            yield states

    def all_homes(self) -> list[StateHome | ParamHome]:
        """The optimizer-state homes, then the param homes: what owns tier memory, files and disk traffic."""
        return [*self.state_homes.values(), *self.homes.values()]

    def flush(self) -> None:
        """Wait for the state homes' writes in flight, the param homes' too (raises a failed write's error)."""
        for home in self.all_homes():
            home.flush()

    def close(self) -> None:
        """Free the optimizer states, the buffers, the shards at home off the device, the homes' and the NVMe
        tier's swap files (:mod:`zero_cache.optim.release`). Replicated param chunks stay the storage of the module's
        parameters, which view them. The store cannot be used again, so nothing is given back to the tiers' budgets
        one by one: dropping the tensors frees them (pinned pages are unpinned with their last view)."""
        self.flush()
        for home in [*self.homes.values(), *self.state_homes.values()]:
            home.close()
        self.groups, self.scratch, self.shards, self.param_chunks, self.group_buffers = [], {}, [], [], []
        self.state_homes, self.homes, self._spare_kept = {}, {}, []

    def apply_plan(self, plan: Plan, *, keep_spare_gradients: bool = False, retain: frozenset = frozenset()) -> int:
        """Move shards and optimizer groups whose tier changed; returns the number moved.

        Each move goes when its new tier has room for it, and of those that could go, the one after which the most
        others fit goes first (:mod:`zero_cache.plan.moves`): a group leaving the device for a full host waits for one
        leaving the host for the disk, and a shard leaving the device for the host waits for groups going the other
        way. Among equals, shards leaving the device go first, then groups leaving the device, the host, the disk.
        Kept gradients the plan drops are freed before anything moves. Where nothing can go, the first move raises
        with the tier that is short.

        ``keep_spare_gradients``: a trial of the device-step count (:mod:`zero_cache.plan.tuning`), which moves nothing:
        the kept gradients it drops stay allocated for the next trial to take, so a switch registers no pinned
        memory (at 10B on the H100 each switch's step took 2-3 times the settled one). The next plan applied
        without it frees what is left over.

        ``retain``: chunks whose kept gradient the plan drops but whose host work may still read it: they keep it
        until :meth:`release_kept` (a count switch does not wait for the host's queue).
        """
        for chunk, group in enumerate(self.groups):  # between steps, no other kept gradient is in use
            if group.kept is not None and chunk not in plan.kept_gradients and chunk not in retain:
                self._spare_kept.append(group.kept)
                group.kept = None
        for chunk in plan.kept_gradients:  # (a moved group takes its kept gradient along)
            if self.groups[chunk].kept is None and self._spare_kept:
                self.groups[chunk].kept = self._spare_kept.pop()
        if not keep_spare_gradients:
            for kept in self._spare_kept:
                self.tiers[HOST].free(kept)
            self._spare_kept = []
        homes = sorted((g for g, home in enumerate(plan.param_home) if home != self.param_home[g]),
                       key=lambda g: self.group_home(g).streams)
        groups = sorted((c for c, tier in enumerate(plan.optimizer_tier) if self.groups[c].tier != tier),
                        key=lambda c: STATE_FILL_ORDER.index(self.groups[c].tier))
        pending = [Move("shard", g, needs=self._home_named(plan.param_home[g], plan).held_bytes(),
                        frees=self.group_home(g).held_bytes()) for g in homes]
        pending += [Move("group", c, needs=self.state_homes[plan.optimizer_tier[c]].held_bytes(),
                         frees=self.state_home(c).held_bytes()) for c in groups]
        while pending:
            free = {name: tier.free_bytes for name, tier in self.tiers.items()}
            move = next_move(pending, free, lambda move: fits(move.needs, free) if move.kind == "group"
                             else self._home_named(plan.param_home[move.index], plan).has_room())
            pending.remove(move)
            (self._move_shard if move.kind == "shard" else self._move_group)(move.index, plan)
        if homes:
            self._index_param_chunks()
        for chunk in plan.kept_gradients:
            if self.groups[chunk].kept is None:
                self.groups[chunk].kept = self._allocate_kept()
        if groups or homes:  # a home left without groups or shards gives back its pinned buffers, as the plan counts
            for home in self.all_homes():
                home.trim()
        self.plan = plan
        return len(groups) + len(homes)
