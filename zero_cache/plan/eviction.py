"""Which live group of gathered params makes room for the next: Belady's rule, one function (pure, no tensors).

Belady's rule (evict the page whose next use is furthest away: optimal for equal-size pages, Belady 1966) along
the acquisition order recorded in the first iteration; before that order is known, the least recently used group
goes. It is the one rule, and nothing selects it: the plan prices Belady (the re-plan after warm-up runs
:func:`belady_misses` over the recorded trace, through :func:`gathers_per_group`, to estimate how often each group
is brought onto the device per step) and the runtime runs Belady (:class:`~zero_cache.runtime.gathered.GatheredGroups`
asks :func:`belady_victim` for each victim), so what the planner assumes and what gathering does are one function.

A second rule (LRU, say) would come with a config key that selects it, passed both to gathering and to the
re-plan's estimate (``zero_cache.warmup.with_measured_gathers``), which would then simulate that rule rather than
Belady's. Note for that simulation: the runtime offers its candidates least recently used first,
:func:`belady_misses` in the order they were fetched; for Belady's rule that changes only which of several groups
never used again goes (the same misses), for LRU it is the rule.
"""

from __future__ import annotations

from typing import Callable, Sequence


def belady_victim(candidates: Sequence[int], next_use: Callable[[int], int], recording: bool) -> int:
    """The group to evict: the one used furthest in the future; the least recently used while the trace is recorded.

    Args:
        candidates: groups that may be evicted, least recently used first.
        next_use: acquisitions until a group is needed again (larger: later; past the trace: never again).
        recording: the acquisition order is still being recorded (``next_use`` knows nothing yet).
    """
    if recording:
        return candidates[0]
    return max(candidates, key=next_use)


def belady_misses(trace: Sequence[int], capacity: int) -> tuple[int, list[tuple[int, int | None]]]:
    """Simulate a cache of ``capacity`` equal-size groups under :func:`belady_victim`, its trace known.

    Args:
        trace: group accesses in order.
        capacity: groups that fit at once (>= 1).

    Returns:
        (number of misses, list of (fetched group, evicted group or None) per miss).
    """
    if capacity < 1:
        raise ValueError("capacity must be at least one chunk")
    next_use = _next_use_table(trace)
    cached: dict[int, int] = {}  # group -> index of its next use
    events: list[tuple[int, int | None]] = []
    for i, group in enumerate(trace):
        if group in cached:
            cached[group] = next_use[i]
            continue
        victim = None
        if len(cached) >= capacity:
            victim = belady_victim(list(cached), cached.__getitem__, recording=False)
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
