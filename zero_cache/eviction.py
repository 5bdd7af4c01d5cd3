"""Which live group of gathered params makes room for the next: the eviction rule (pure, no tensors).

The plan names the rule (``Plan.eviction``) and :class:`~zero_cache.gathered.GatheredGroups` asks it for each
victim, so what the planner assumes and what gathering does are one object. The one rule so far is
Belady's (evict the page whose next use is furthest away: optimal for equal-size pages, Belady 1966),
along the acquisition order recorded in the first iteration; before that order is known, the least
recently used group goes. :func:`belady_misses` runs the same rule over a whole trace, which the re-plan
after warm-up uses to estimate how often each group is brought onto the device per step.

No config key selects a rule while there is one: a second rule (LRU, say) comes with the key
(``zero_cache.eviction``), the plan naming the rule from it, and the re-plan's estimate
(``zero_cache.warmup.with_measured_gathers``) simulating the rule the plan names rather than
:func:`gathers_per_group`'s Belady. Note for that simulation: the runtime offers its candidates least recently
used first, :func:`belady_misses` in the order they were fetched; for Belady's rule that changes only which of
several groups never used again goes (the same misses), for LRU it is the rule.
"""

from __future__ import annotations

from typing import Callable, ClassVar, Protocol, Sequence


class EvictionRule(Protocol):
    """Chooses the group to evict among those that may go."""

    name: ClassVar[str]

    def victim(self, candidates: Sequence[int], next_use: Callable[[int], int], recording: bool) -> int:
        """The group to evict.

        Args:
            candidates: groups that may be evicted, least recently used first.
            next_use: acquisitions until a group is needed again (larger: later; past the trace: never again).
            recording: the acquisition order is still being recorded (``next_use`` knows nothing yet).
        """
        ...


class BeladyEviction:
    """Belady's rule along the recorded trace; the least recently used group while it is recorded."""

    name: ClassVar[str] = "belady"

    def victim(self, candidates: Sequence[int], next_use: Callable[[int], int], recording: bool) -> int:
        if recording:
            return candidates[0]
        return max(candidates, key=next_use)


EVICTION_RULES: dict[str, type[EvictionRule]] = {BeladyEviction.name: BeladyEviction}
"""The rules a plan may name."""


def eviction_rule(name: str) -> EvictionRule:
    """The rule a plan names."""
    if name not in EVICTION_RULES:
        raise ValueError(f"unknown eviction rule {name!r}; known: {sorted(EVICTION_RULES)}")
    return EVICTION_RULES[name]()


def belady_misses(trace: Sequence[int], capacity: int) -> tuple[int, list[tuple[int, int | None]]]:
    """Simulate a cache of ``capacity`` equal-size groups under :class:`BeladyEviction`, its trace known.

    Args:
        trace: group accesses in order.
        capacity: groups that fit at once (>= 1).

    Returns:
        (number of misses, list of (fetched group, evicted group or None) per miss).
    """
    if capacity < 1:
        raise ValueError("capacity must be at least one chunk")
    rule = BeladyEviction()
    next_use = _next_use_table(trace)
    cached: dict[int, int] = {}  # group -> index of its next use
    events: list[tuple[int, int | None]] = []
    for i, group in enumerate(trace):
        if group in cached:
            cached[group] = next_use[i]
            continue
        victim = None
        if len(cached) >= capacity:
            victim = rule.victim(list(cached), cached.__getitem__, recording=False)
            del cached[victim]
        cached[group] = next_use[i]
        events.append((group, victim))
    return len(events), events


def gathers_per_group(trace: Sequence[int], capacity: int) -> float:
    """Times each group of ``trace`` (one iteration's acquisitions) is brought onto the device, on average, with
    ``capacity`` groups live at once under Belady's rule."""
    groups = len(set(trace))
    return belady_misses(trace, max(1, capacity))[0] / groups if groups else 0.0


def _next_use_table(trace: Sequence[int]) -> list[int]:
    """For each position, the position of the same group's next access (len(trace) + 1 if none)."""
    never = len(trace) + 1
    table, last = [never] * len(trace), {}
    for i in range(len(trace) - 1, -1, -1):
        table[i] = last.get(trace[i], never)
        last[trace[i]] = i
    return table
