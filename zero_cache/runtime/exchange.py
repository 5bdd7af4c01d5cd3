"""The collectives of sharded chunks, issued from the training thread in one order on every rank.

:class:`ChunkExchange` keeps the state of one optimizer's reduce-scatters and all-gathers (see
:mod:`zero_cache.base.sharding` for the ownership and the group layout):

* **gradients**: a group is reduced once its gradients are complete on this rank, either in place
  in the param chunks (one micro-batch per step: gradients are written over the parameters) or
  from a *gradient bucket* (accumulating micro-batches: the parameters are still needed, so the
  gradients go to a group-sized compute-dtype buffer, and the owner adds its reduced slice to its
  fp32 accumulator). Reductions are waited for in issue order, one or more groups late, so the
  compute stream seldom waits for NCCL;
* **parameters**: after a step every group is stale; the next forward gathers each group in its
  pre-hook, and issues the next stale group's gather so it runs under this one's compute.

With gathered params (``store.shard_params``: sharded over the ranks, or streamed on one rank) the
gradients always go through buckets and are reduced straight into the owner's shard (a shard at home
on the host receives its slice from the device->host stream, and the slice's squared norm is taken
on the device first); the parameters are gathered on use by :class:`~zero_cache.runtime.gathered.GatheredGroups`,
and a group is dropped as soon as its reduction is done.

The worker thread never issues a collective, so ranks cannot disagree on the order.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from zero_cache.base.sharding import Sharding
from zero_cache.plan.home_costs import home_costs
from zero_cache.plan.tier_names import DEVICE
from zero_cache.plan.working_set import GRADIENT_BUCKETS, reduction_lag
from zero_cache.runtime.gathered import GatheredGroups, RecordedGathers, live_slots
from zero_cache.storage.chunks import ChunkStore
from zero_cache.storage.tiers import wait


class ChunkExchange:
    """Reduce-scatters and all-gathers of one optimizer's chunk groups.

    Args:
        store: the chunk storage (its ``sharding`` says who owns what).
        wait_owner: blocks until an owned chunk's pending update has landed in its param chunk.
        accumulate: micro-batches accumulate: reduce from gradient buckets, which the owner adds to its
            fp32 accumulators (sharded params use buckets either way).
        gather_ahead: groups whose all-gather is started ahead of the one a forward needs.
        max_live_groups: gathered params: groups gathered at once (see :class:`GatheredGroups`).
        buckets: gradient buckets the plan gives the device (:mod:`zero_cache.plan.working_set`). More are allocated
            (within the device budget) while more groups are open at once (e.g. a tied embedding's group stays
            open until the end of backward); with no more than the groups in use, each reduction is waited for
            as soon as it is issued, so no bucket is held by one in flight.
        overlap_comm: leave a reduction in flight behind backward where a bucket is planned for it.
        transfers: host<->device copies (:class:`~zero_cache.runtime.transfers.Transfers`), for shards at home on the
        host.
    """

    def __init__(self, store: ChunkStore, wait_owner: Callable[[int], None], *, accumulate: bool,
                 gather_ahead: int = 1, max_live_groups: int = 0, buckets: int = GRADIENT_BUCKETS,
                 overlap_comm: bool = True, transfers: Any = None) -> None:
        self.store = store
        self.sharding: Sharding = store.sharding
        self.wait_owner = wait_owner
        self.num_groups = self.sharding.num_groups(store.layout.num_chunks)
        self.accumulate = accumulate
        self.uses_buckets = accumulate or store.shard_params
        self.gather_ahead = gather_ahead
        self.buckets = buckets
        self.overlap_comm = overlap_comm
        self.transfers = transfers
        self.gathered = (GatheredGroups(store, max_live=max_live_groups, ahead=gather_ahead,
                                        wait_owned=self._wait_owned, transfers=transfers)
                         if store.shard_params else None)
        self.into_shards = store.shard_params and not accumulate
        """Reductions land in this rank's shard, over its params (sharded params, one micro-batch per step)."""
        self._reduced: set[int] = set()  # groups reduced in this micro-step
        self._reductions: dict[int, Any] = {}  # group -> its reduction, issued and not yet waited for
        self._gathers: dict[int, Any] = {}  # group -> its gather, issued and not yet waited for
        self._stale: set[int] = set()  # groups whose non-owned chunks await their owners' params
        self._open: dict[int, torch.Tensor] = {}  # group -> its bucket (being filled or reduced)
        self._free: list[tuple[torch.Tensor, Any]] = []  # (bucket, token of the copy still reading it)
        self.landed: dict[int, Any] = {}
        """Group -> the device->host copy that wrote its reduced gradients into a shard at home on the host."""
        self.reduced_squares: dict[int, torch.Tensor] = {}
        """Group -> squared norm (on the device) of this rank's reduced slice, for shards at home on the host (several
        ranks)."""

    @property
    def reduction_lag(self) -> int:
        """Reductions left in flight behind backward (see :func:`~zero_cache.plan.working_set.reduction_lag`; without
        buckets, reductions in place take no device memory of their own)."""
        if not self.uses_buckets:
            return 1 if self.overlap_comm else 0
        return reduction_lag(self.buckets, self.overlap_comm)

    def close(self) -> None:
        """Drop every gathered group (its params become placeholders) and gradient bucket
        (:mod:`zero_cache.optim.release`)."""
        if self.gathered is not None:
            self.gathered.release_all()
        self._open.clear()
        self._free.clear()

    def apply_working_set(self, plan: Any) -> None:
        """A new plan's gradient buckets, prefetch depth and live groups, from the next use on."""
        self.buckets = plan.gradient_buckets
        if self.gathered is not None:
            self.gathered.resize(plan.cache_slots, ahead=plan.gather_ahead)

    # ------------------------------------------------------------------ gradients
    def bucket_view(self, chunk: int) -> torch.Tensor:
        """``chunk``'s slice of its group's gradient bucket, zeroed when the group opens one."""
        group = self.sharding.group_of(chunk)
        bucket = self._open.get(group)
        if bucket is None:
            bucket = self._open[group] = self._take_bucket()
        return bucket.view(self.sharding.world_size, -1)[chunk % self.sharding.world_size]

    def _take_bucket(self) -> torch.Tensor:
        if self._free:
            bucket, in_use_until = self._free.pop()
            if isinstance(in_use_until, torch.cuda.Event):  # the bucket's next writer is the compute stream
                torch.cuda.current_stream(in_use_until.device).wait_event(in_use_until)
            else:
                wait(in_use_until)
        else:
            numel = self.sharding.world_size * self.store.layout.chunk_numel
            bucket = self.store.tiers[DEVICE].allocate(numel, self.store.compute_dtype)
        return bucket.zero_()

    def release_bucket(self, group: int, in_use_until: Any = None) -> None:
        """Return ``group``'s bucket once its owner has read the reduced slice (``in_use_until``: that copy)."""
        self._free.append((self._open.pop(group), in_use_until))

    def reduce(self, group: int) -> None:
        """Issue the group's reduce-scatter (from its bucket, or in place in its param chunks; sharded params
        without accumulation: into this rank's shard)."""
        self._reduced.add(group)
        buffer = self._open[group] if self.uses_buckets else self.store.group_buffers[group]
        if self.into_shards:  # an unused group's shard may still be receiving the last step's update
            self._wait_owned(group)
        target = self._home_target(group) if self.into_shards else None
        self._reductions[group] = self.sharding.reduce_scatter(buffer, target)

    def reduce_rest(self) -> None:
        """Reduce every group not yet reduced in this micro-step, in group order (unused parameters)."""
        for group in range(self.num_groups):
            if group not in self._reduced:
                if self.uses_buckets and group not in self._open:
                    self._open[group] = self._take_bucket()
                self.reduce(group)

    def completed(self, keep_in_flight: int = 0, updated_now: Callable[[int], bool] | None = None) -> list[int]:
        """Wait for the oldest reductions, leaving ``keep_in_flight`` in flight; returns their groups in order.
        ``updated_now``: whether a group's owned chunk is updated as soon as it returns (during backward), so its
        gradient does not wait for the step in its home (None: every one waits)."""
        waiting = list(self._reductions)
        done = waiting[:max(0, len(waiting) - keep_in_flight)]
        for group in done:
            work = self._reductions.pop(group)
            if work is not None:
                work.wait()
            if self.into_shards:
                # The sum goes into the shard, over the params: the group must not be gathered again before the
                # step (releasing it waits for a gather still in flight, which reads the shard).
                self.gathered.release(group, closed=True)
                waits = updated_now is None or not updated_now(group)
                self.release_bucket(group, self._write_home(group, waits) if self._home_target(group) is None
                                    else None)
        return done

    def _home_target(self, group: int) -> torch.Tensor | None:
        """Where the reduce-scatter writes this rank's slice itself (a shard in device memory), else None."""
        return self.store.group_home(group).reduce_target(self.store.shards[group])

    def _write_home(self, group: int, waits: bool) -> Any:
        """Take this rank's reduced slice to its shard's home off the device (``waits``: for an update after
        backward); returns the transfer's token."""
        reduced = self.sharding.mine(self._open[group])
        if self.sharding.sharded:  # (one rank sums its squares per parameter, from the gradient hook)
            self.reduced_squares[group] = torch.linalg.vector_norm(reduced, dtype=torch.float32).square()
        self.landed[group] = self.store.group_home(group).write_gradient(group, self.store.shards[group], reduced,
                                                                         self.transfers, waits=waits)
        return self.landed[group]

    def reduced_slice(self, group: int) -> torch.Tensor:
        """This rank's reduced slice of a completed group (sum over the ranks)."""
        buffer = self._open[group] if self.uses_buckets else self.store.group_buffers[group]
        return self.sharding.mine(buffer)

    def new_micro_step(self) -> None:
        assert not self._reductions, "a reduction of the previous micro-step was never waited for"
        self._reduced.clear()
        self.landed.clear()
        self.reduced_squares.clear()
        if not self.accumulate:  # buckets of groups left incomplete (a window dropped by zero_grad)
            for group in list(self._open):
                self.release_bucket(group)

    # ------------------------------------------------------------------ parameters
    def mark_stale(self) -> None:
        """Every group's non-owned chunks are out of date (after a step or a restore)."""
        if self.gathered is not None:
            self.gathered.release_all()
            return
        self._stale = set(range(self.num_groups))

    def prepare(self, chunk: int) -> None:
        """Gather ``chunk``'s group if it is stale (or, sharded params, not live), and start gathering the next
        ``gather_ahead`` ones."""
        group = self.sharding.group_of(chunk)
        if self.gathered is not None:
            self.gathered.acquire(group)
            return
        self._issue_gather(group)
        work = self._gathers.pop(group, None)
        if work is not None:
            work.wait()
        for later in sorted(g for g in self._stale if g > group)[:self.gather_ahead]:
            self._issue_gather(later)

    def _issue_gather(self, group: int) -> None:
        if group not in self._stale:
            return
        self._stale.discard(group)
        self._wait_owned(group)
        self._gathers[group] = self.sharding.all_gather(self.store.group_buffers[group])

    def _wait_owned(self, group: int) -> None:
        """Until the pending updates of this rank's chunks in ``group`` have landed in its param chunk (shard)."""
        for chunk in self.sharding.group_chunks(group, self.store.layout.num_chunks):
            if self.sharding.owns(chunk):
                self.wait_owner(chunk)

    def recorded_gathers(self, under: Any = None) -> RecordedGathers | None:
        """Gathered params: the group acquisitions recorded so far, and the slots kept for reuse and the streamed
        groups under the plan ``under`` (default: the gathering in force); None where nothing is gathered."""
        gathered = self.gathered
        if gathered is None:
            return None
        if under is None:
            reuse = gathered.max_live - gathered.ahead
            streamed = frozenset(g for g in range(self.num_groups) if self.store.group_home(g).streams)
        else:  # (as GatheredGroups.resize takes a plan)
            ahead = under.gather_ahead or self.gather_ahead
            reuse = live_slots(under.cache_slots, ahead) - ahead
            streamed = frozenset(g for g, home in enumerate(under.param_home) if home_costs(home).streams)
        return RecordedGathers(tuple(gathered.trace.groups), reuse, streamed, self.sharding.sharded)

    def sync(self) -> None:
        """Gather every stale group now (every rank calls it, e.g. before a checkpoint)."""
        for group in sorted(self._stale):
            self._issue_gather(group)
        for work in self._gathers.values():
            if work is not None:
                work.wait()
        self._gathers.clear()
