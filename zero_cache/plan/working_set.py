"""The device's working set of gathered params: how many groups are live, fetched ahead, and reduced from (pure).

With params gathered on use (sharded over ranks, or streamed from homes on the host) the device holds, beside
the shards at home there and the optimizer groups, a **working set** of group-sized buffers, each
``group_size`` param chunks in the compute dtype:

* **live groups**: those in use, at least :data:`GROUPS_IN_USE` (a module may span two groups, and a
  checkpointed block recomputed in backward holds its views of both), plus ``ahead`` being fetched ahead of
  use along the trace; more are wanted where they spare re-fetches (``max_live_elements``);
* **gradient buckets**: the groups whose gradients backward is writing, again up to :data:`GROUPS_IN_USE` at
  once (a module's params may end one group and begin the next), plus one whose reduction is left in flight
  so the compute stream seldom waits for it (the reduction lag, :func:`reduction_lag`).

The wanted set is the config's (``prefetch_depth`` / ``gather_ahead_elements``, ``max_live_elements``,
:data:`GRADIENT_BUCKETS`). On a small device it is shrunk before a plan is refused, giving up first what
costs least (:func:`shrinking`): the live groups beyond the fewest, then the lagged bucket, then the prefetch
depth, one group at a time down to one. Only the **minimum working set** (two groups in use, one ahead, two
buckets) is required; a plan that cannot hold even that is refused with the bytes it needs
(:func:`budget_for_room`). Counts never exceed the groups there are: a bucket or a slot beyond them would
never be used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterator

GROUPS_IN_USE = 2
"""Groups a module may use at once (its params may span a group boundary): live together, and writing
gradients together."""
GRADIENT_BUCKETS = GROUPS_IN_USE + 1
"""Gradient buckets wanted on the device: the groups being written, and one being reduced behind them."""
MIN_AHEAD = 1
"""Groups fetched ahead of use in the minimum working set."""


@dataclass(frozen=True, slots=True)
class WorkingSet:
    """Counts of group-sized device buffers with gathered params."""

    ahead: int
    """Groups fetched ahead of use along the trace."""
    live_groups: int
    """Groups live on the device at once (at least ``ahead + GROUPS_IN_USE``, where there are that many)."""
    buckets: int
    """Gradient buckets (0: gradients are not reduced through buckets)."""

    def __post_init__(self) -> None:
        if min(self.ahead, self.live_groups, self.buckets) < 0:
            raise ValueError(f"working set counts must be >= 0, got {self}")

    @property
    def fewest_live(self) -> int:
        """The live groups this prefetch depth cannot do with fewer of."""
        return self.ahead + GROUPS_IN_USE

    def device_bytes(self, group_bytes: int) -> int:
        """Bytes of the live groups and buckets, ``group_bytes`` each."""
        return (self.live_groups + self.buckets) * group_bytes


def capped(wanted: WorkingSet, num_groups: int) -> WorkingSet:
    """``wanted`` within ``num_groups`` gathered groups: no more live groups or buckets than groups, and no
    deeper prefetch than the groups not in use (at least one)."""
    ahead = max(min(MIN_AHEAD, wanted.ahead), min(wanted.ahead, num_groups - GROUPS_IN_USE))
    return WorkingSet(ahead=ahead, live_groups=min(max(wanted.live_groups, ahead + GROUPS_IN_USE), num_groups),
                      buckets=min(wanted.buckets, num_groups))


def shrinking(wanted: WorkingSet, num_groups: int) -> Iterator[WorkingSet]:
    """``wanted`` (capped to ``num_groups``), then ever smaller working sets down to the minimum, in the order
    they cost the step least: the lagged bucket (its reduction is then waited for at once), then the prefetch
    depth, one group at a time (each live count at the fewest its depth needs). Live groups beyond the fewest
    are the planner's to shrink within each (:func:`live_groups_in`)."""
    current = capped(wanted, num_groups)
    yield current
    least_buckets = min(current.buckets, GROUPS_IN_USE)
    if current.buckets > least_buckets:
        current = replace(current, buckets=least_buckets, live_groups=current.fewest_live)
        yield capped(current, num_groups)
    while current.ahead > MIN_AHEAD:
        current = replace(current, ahead=current.ahead - 1, live_groups=current.ahead - 1 + GROUPS_IN_USE)
        yield capped(current, num_groups)


def minimum(wanted: WorkingSet, num_groups: int) -> WorkingSet:
    """The smallest working set :func:`shrinking` reaches: what a plan cannot do without."""
    return list(shrinking(wanted, num_groups))[-1]


def live_groups_in(working: WorkingSet, room_bytes: int, group_bytes: int, streamed_groups: int) -> int | None:
    """Live groups for ``working`` in ``room_bytes``: as many as wanted and fit, at least the fewest its
    prefetch depth needs (both at most ``streamed_groups``, the groups that must be gathered); None when even
    the fewest do not fit."""
    fewest = min(working.fewest_live, streamed_groups)
    if room_bytes < fewest * group_bytes:
        return None
    return max(fewest, min(working.live_groups, streamed_groups, room_bytes // max(1, group_bytes)))


def agreed(sets: list[WorkingSet | None]) -> WorkingSet | None:
    """The working set every rank can hold: the fewest of each count over the ranks' own (each rank's fits its
    device, so fewer fit too); None when some rank has none (its plan failed).

    Which group a gather evicts, and so when it gathers again, follows from the live groups and the prefetch
    depth along a trace every rank shares: with sharded params each gather is an all-gather, so ranks that
    measured different peaks or rates must still run the same counts."""
    if not sets or any(one is None for one in sets):
        return None
    return WorkingSet(ahead=min(one.ahead for one in sets), live_groups=min(one.live_groups for one in sets),
                      buckets=min(one.buckets for one in sets))


def reduction_lag(buckets: int, overlap_comm: bool) -> int:
    """Reductions left in flight behind backward: one where a bucket beyond the groups in use holds it."""
    return 1 if overlap_comm and buckets > GROUPS_IN_USE else 0


def budget_for_room(room_bytes: int, margin_fraction: float) -> int:
    """The least device budget whose share after the allocator's margin (``int(budget * (1 - margin))``, as
    the planner takes it) is at least ``room_bytes``."""
    budget = math.ceil(room_bytes / (1 - margin_fraction))
    while int(budget * (1 - margin_fraction)) < room_bytes:
        budget += 1
    while budget > 0 and int((budget - 1) * (1 - margin_fraction)) >= room_bytes:
        budget -= 1
    return budget
