"""Calibration of per-op times to a whole-graph measurement (pure maths, no timing).

An op timed on its own also pays a fixed harness cost per timed call that a real run does not (the
closure, ``torch.autograd.grad``'s set-up; on a GPU little, the launches being queued ahead). Summed over
hundreds of small ops that cost dominates, so stages of many small ops were over-predicted far more than a
stage of a few large ones. The model here, over the forward and backward times of all ops together::

    net_i = max(raw_i - overhead_i, 0)       overhead_i: the harness timed on a no-op, in op i's direction
    calibrated_i = scale * net_i,  scale = measured_total / sum_i net_i

so the calibrated times sum to the whole graph's forward + backward measured end to end (one measurement:
a separate forward-only truth would make the backward a difference of two noisy times), and the split of
that total over the ops follows their net cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True, slots=True)
class Calibrated:
    """Calibrated per-entry times and the factor that made them."""

    times_s: tuple[float, ...]
    """Seconds per entry; they sum to the measured total (when one was given and some entry has a net cost)."""
    scale: float
    """Applied to the net times (1.0 without a measured total)."""


def calibrate_op_times(raw_s: Sequence[float], overhead_s: Sequence[float],
                       measured_total_s: float | None) -> Calibrated:
    """Subtract each entry's harness overhead, then scale so the entries sum to the measured total.

    Args:
        raw_s: times as timed one op at a time (>= 0), e.g. every op's forward then every op's backward;
            an entry of 0 (an op with no backward) stays 0.
        overhead_s: the harness's fixed cost per call for each entry (>= 0), same length as ``raw_s``.
        measured_total_s: the sum the entries should have, timed end to end; None or <= 0 means no ground
            truth (only the overheads are subtracted).

    Returns:
        The calibrated times. When no entry is above its overhead, the raw times are scaled instead
        (nothing else is left to share the total by).

    Raises:
        ValueError: lengths differ, or a negative time.
    """
    if len(raw_s) != len(overhead_s):
        raise ValueError(f"calibrate_op_times: {len(raw_s)} times but {len(overhead_s)} overheads")
    if any(t < 0 for t in raw_s) or any(o < 0 for o in overhead_s):
        raise ValueError("calibrate_op_times: times and overheads must be >= 0")
    net_s = [max(t - o, 0.0) for t, o in zip(raw_s, overhead_s)]
    if not any(net_s):
        net_s = list(raw_s)
    net_total_s = sum(net_s)
    scale = measured_total_s / net_total_s if measured_total_s and measured_total_s > 0 and net_total_s > 0 else 1.0
    return Calibrated(times_s=tuple(scale * t for t in net_s), scale=scale)
