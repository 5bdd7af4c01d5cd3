"""Gathered params: a chunk group's full params exist on the device only while they are in use.

Each rank keeps its own slot of every group (``ChunkStore.shards``) at its **home**: the device, pinned
host memory or NVMe (:mod:`zero_cache.storage.param_homes.registry`, which carries out each kind's gather). A group is
**live** while its gathered buffer exists: its parameters are views into it. Otherwise each parameter
is a placeholder of the right shape holding no memory (one element, expanded with zero strides), so
module code that reads ``weight.shape`` keeps working.

Where a group's buffer comes from depends on the shard's home and the ranks:

* home on the device, several ranks (ZeRO-3): all-gathered from every rank's shard;
* home on the host or NVMe (params streamed, ZeRO-Infinity's ``offload_param``): this rank's shard copied
  in on the host->device stream (from NVMe: read into a pinned buffer first, started a window further
  ahead), then, with several ranks, all-gathered in place behind that copy;
* home on the device, one rank: the shard *is* the group; it is bound in place, no copy, and never
  counts against ``max_live``.

A group is acquired

* by the forward pre-hook of a module using it (in forward, and again when activation checkpointing
  recomputes a block during backward);
* in backward, when autograd unpacks a weight saved in forward. While a module runs under
  :meth:`GatheredGroups.saving`, a saved tensor that is a view of a live buffer is packed as a
  :class:`_SavedView` (group, offset, shape, strides) instead of a reference, so saving it does not
  keep the buffer alive; unpacking acquires the group again (torch's saved-tensor hooks).

**Order.** The first iteration records the groups in the order they are acquired
(:class:`AcquisitionTrace`); later iterations follow it with a cursor, start gathering the next
``ahead`` groups while this one computes, and, with ``max_live`` groups live, evict the one Belady's rule
picks (:func:`zero_cache.plan.eviction.belady_victim`, the rule the plan prices: the group whose next use along the
trace is furthest away; during the warm-up, the least recently used one). The two groups acquired last are never
evicted, nor the groups of a module
whose forward is running (:meth:`GatheredGroups.hold`). A buffer that autograd still holds (a
checkpointed block's recomputed views) stays valid until it is released: eviction drops this
object's reference, the memory goes with the last one.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from zero_cache.plan.eviction import belady_victim
from zero_cache.plan.tier_names import DEVICE
from zero_cache.plan.working_set import GROUPS_IN_USE


class AcquisitionTrace:
    """The order groups are acquired in one iteration: recorded once, then followed with a cursor (pure)."""

    def __init__(self) -> None:
        self.groups: list[int] = []
        """Acquisitions of the recorded iteration (consecutive repeats collapsed)."""
        self.recording = True
        self._cursor = -1

    def new_iteration(self) -> None:
        """A forward starts: the first one ends the recording, every one rewinds the cursor."""
        if self.groups:
            self.recording = False
        self._cursor = -1

    def visit(self, group: int) -> None:
        """``group`` is acquired now: record it, or move the cursor to its next place in the trace."""
        if self.recording:
            if not self.groups or self.groups[-1] != group:
                self.groups.append(group)
            return
        if 0 <= self._cursor < len(self.groups) and self.groups[self._cursor] == group:
            return
        position = self._find(group, self._cursor + 1)
        if position is not None:
            self._cursor = position

    def _find(self, group: int, start: int) -> int | None:
        """The first position of ``group`` at or after ``start``, else from the beginning; None if absent."""
        for position in (*range(start, len(self.groups)), *range(0, min(start, len(self.groups)))):
            if self.groups[position] == group:
                return position
        return None

    def upcoming(self, count: int) -> list[int]:
        """The next ``count`` distinct groups after the cursor (none while recording)."""
        if self.recording or self._cursor < 0:
            return []
        current, seen = self.groups[self._cursor], []
        for group in self.groups[self._cursor + 1:]:
            if len(seen) == count:
                break
            if group != current and group not in seen:
                seen.append(group)
        return seen

    def next_use(self, group: int) -> int:
        """Acquisitions until ``group`` is needed again in this iteration (``len(trace) + 1``: not again)."""
        for distance, later in enumerate(self.groups[self._cursor + 1:], start=1):
            if later == group:
                return distance
        return len(self.groups) + 1


RECENT = GROUPS_IN_USE
"""Groups not evicted for having been acquired last: a module may span two groups, and a checkpointed block
recomputed in backward holds its views of them without acquiring them again."""


@dataclass(frozen=True, slots=True)
class _SavedView:
    """A tensor autograd saved that is a view of a live group buffer, kept as its position instead."""

    group: int
    offset: int
    shape: torch.Size
    stride: tuple[int, ...]


@dataclass(slots=True)
class _Live:
    buffer: torch.Tensor
    """The whole group (``world_size`` chunks)."""
    work: Any
    """Its all-gather or host->device copy while in flight, else None."""
    borrowed: bool = False
    """The buffer is the shard itself (one rank, home on the device): never evicted nor freed."""


@dataclass(frozen=True, slots=True)
class RecordedGathers:
    """Gathered params: the group acquisitions the warm-up recorded, and the gathering in force."""

    groups: tuple[int, ...]
    """Groups in the order they were acquired (forward, recomputed blocks, backward; repeats collapsed)."""
    reuse_slots: int
    """Live slots that keep groups for reuse (the live groups less those gathered ahead)."""
    streamed: frozenset[int]
    """Groups whose shards stream from a home off the device."""
    sharded: bool
    """Params are sharded over ranks (every group is gathered), not streamed on one rank."""


def live_slots(max_live: int, ahead: int) -> int:
    """Groups live at once under a plan's ``max_live`` with ``ahead`` gathered ahead of use: at least ``ahead`` +
    :data:`RECENT`, the fewest that work."""
    return max(max_live, ahead + RECENT)


class GatheredGroups:
    """The live groups of one :class:`~zero_cache.storage.chunks.ChunkStore` with gathered params, and their gathers.

    Args:
        store: chunk storage with ``shard_params``.
        max_live: groups live at once (at least ``ahead + 2``: in use, being gathered, one spare).
        ahead: groups gathered ahead of use, along the recorded trace.
        wait_owned: blocks until the pending updates of this rank's chunks in a group have landed in its shard.
        transfers: the host<->device copies (:class:`~zero_cache.runtime.transfers.Transfers`), for shards at home
            on the host.
    """

    def __init__(self, store: Any, *, max_live: int, ahead: int, wait_owned: Callable[[int], None],
                 transfers: Any = None) -> None:
        self.store = store
        self.transfers = transfers
        self.sharding = store.sharding
        self.ahead = ahead
        self.resize(max_live)
        self.wait_owned = wait_owned
        self.trace = AcquisitionTrace()
        self._live: dict[int, _Live] = {}  # in order of last use (the warm-up evicts the first)
        self._group_at: dict[tuple[str, int], int] = {}  # (device type, buffer address) -> group
        self._recent: list[int] = []  # the last RECENT groups acquired, newest first: their module may still compute
        self._closed: set[int] = set()  # groups whose shard holds this step's gradients
        self._holds: dict[int, int] = {}  # group -> modules whose forward is running and use it
        self.gathers = 0
        """Gathers issued, all-gathers and host copies (a measure of the policy: each group is needed about 2-3
        times a step)."""

    def resize(self, max_live: int, ahead: int | None = None) -> None:
        """A new plan's number of live groups (at least ``ahead + 2``) and, if given, its prefetch depth, from the
        next acquisition on."""
        if ahead:
            self.ahead = ahead
        self.max_live = live_slots(max_live, self.ahead)

    @property
    def live_groups(self) -> list[int]:
        return list(self._live)

    def acquire(self, group: int) -> torch.Tensor:
        """Make ``group`` live (gathering it now if it is not), gather the next ones ahead; returns its buffer."""
        live = self._live.get(group)
        if live is not None and self._recent[:1] == [group] and live.work is None:
            return live.buffer  # the common case: the same group again (one per saved tensor)
        if group in self._closed:
            raise RuntimeError(f"chunk group {group} is used again after its gradients were reduced into this rank's "
                               "shard: with sharded params, run forward and backward once per step (or set "
                               "gradient_accumulation_steps for several micro-batches)")
        self._recent = [group, *(g for g in self._recent if g != group)][:RECENT]
        self.trace.visit(group)
        self._issue(group)
        live = self._live.pop(group)
        self._live[group] = live  # most recently used
        if live.work is not None:
            live.work.wait()
            live.work = None
        upcoming = self.trace.upcoming(2 * self.ahead)
        for later in upcoming[:self.ahead]:
            self._issue(later)
        for later in upcoming[self.ahead:]:  # a home that can start early (a disk read) does, a window further
            if later not in self._live and later not in self._closed:
                self.store.group_home(later).prefetch(later)
        return live.buffer

    def _issue(self, group: int) -> None:
        if group in self._live or group in self._closed:
            return
        shard, home = self.store.shards[group], self.store.group_home(group)
        if not (home.streams or self.sharding.sharded):
            self.wait_owned(group)
            self._live[group] = _Live(shard, None, borrowed=True)
        else:
            self._make_room()
            self.wait_owned(group)  # this rank's update has landed in its shard
            buffer = self.store.tiers[DEVICE].allocate(self.sharding.world_size * self.store.layout.chunk_numel,
                                                       self.store.compute_dtype, zero=False)
            self._live[group] = _Live(buffer, home.gather(group, shard, buffer, self.sharding, self.transfers))
            self.gathers += 1
        self._group_at[_address(self._live[group].buffer)] = group
        self.store.bind_group(group, self._live[group].buffer)

    def _make_room(self) -> None:
        while sum(not live.borrowed for live in self._live.values()) >= self.max_live:
            candidates = [g for g, live in self._live.items()
                          if g not in self._recent and not self._holds.get(g) and not live.borrowed]
            if not candidates:
                return
            self.release(belady_victim(candidates, self.trace.next_use, self.trace.recording))

    def release(self, group: int, *, closed: bool = False) -> None:
        """Drop ``group``'s buffer and turn its params into placeholders; ``closed``: its shard now holds
        gradients, so it must not be gathered again until the step."""
        if closed:
            self._closed.add(group)
        live = self._live.pop(group, None)
        if live is None:
            return
        if live.work is not None:
            live.work.wait()  # never free a buffer a collective still writes
        if group in self._recent:
            self._recent.remove(group)
        del self._group_at[_address(live.buffer)]
        self.store.unbind_group(group)
        if not live.borrowed:
            self.store.tiers[DEVICE].free(live.buffer)

    def hold(self, group: int) -> None:
        """A module's forward starts using ``group``: it is not evicted until :meth:`unhold` (a parent's own
        parameters stay gathered while its children run, a module may span more than two groups)."""
        self._holds[group] = self._holds.get(group, 0) + 1

    def unhold(self, group: int) -> None:
        self._holds[group] -= 1
        if not self._holds[group]:
            del self._holds[group]

    def release_all(self) -> None:
        """Drop every live group (the shards changed: a step, a restore or a load)."""
        for group in list(self._live):
            self.release(group)
        for home in self.store.homes.values():
            home.forget_prefetched()
        self._closed.clear()
        self._holds.clear()

    def new_iteration(self) -> None:
        self.trace.new_iteration()

    # ------------------------------------------------------------------ saved tensors
    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Autograd saves views of live buffers as positions, so backward gathers them again."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def _pack(self, tensor: torch.Tensor) -> Any:
        group = self._group_at.get(_address(tensor))
        if group is None:
            # With hooks installed autograd no longer checks saved tensors' versions: keep the check.
            return tensor, tensor._version
        return _SavedView(group, tensor.storage_offset(), tensor.shape, tensor.stride())

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _SavedView):
            tensor, version = saved
            if tensor._version != version:
                raise RuntimeError(f"a tensor of shape {tuple(tensor.shape)} saved for backward was modified by an "
                                   f"in-place operation (version {version}, now {tensor._version}); make that "
                                   "operation out of place")
            return tensor
        return self.acquire(saved.group).as_strided(saved.shape, saved.stride, saved.offset)


def _address(tensor: torch.Tensor) -> tuple[str, int]:
    """Where a tensor's memory starts (unique in the process: CUDA's addresses never overlap the host's)."""
    return tensor.device.type, tensor.untyped_storage().data_ptr()
