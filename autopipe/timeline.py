"""Predicted per-stage timeline of one pipeline flush, and its drawing as a PNG (matplotlib, optional).

The simulation replays the schedule's op order on each stage with the cost model's per-micro-batch
forward and backward times (boundary transfers folded into them) and the data dependencies of a pipeline:
F(s, m) waits for F(s-1, m) and B(s, m) for B(s+1, m), and each stage runs one op at a time. Op order per
stage: GPipe runs all M forwards, then all M backwards; 1F1B runs min(S - s - 1, M) warm-up forwards, then
alternates one forward and one backward, then drains the backwards (Narayanan et al. 2021, PipeDream-Flush).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from autopipe.search import PlanPrediction


@dataclass(frozen=True, slots=True)
class TimelineOp:
    """One forward or backward of one micro-batch on one stage."""

    stage: int
    microbatch: int
    kind: str
    """"F" or "B"."""
    start_s: float
    end_s: float


def stage_order(stage: int, num_stages: int, num_microbatches: int, schedule: str) -> list[tuple[str, int]]:
    """The (kind, micro-batch) sequence a stage runs in one flush."""
    micro = num_microbatches
    if schedule == "gpipe":
        return [("F", m) for m in range(micro)] + [("B", m) for m in range(micro)]
    if schedule != "1f1b":
        raise ValueError(f"schedule={schedule!r}: the timeline simulates 'gpipe' and '1f1b'")
    warmup = min(num_stages - stage - 1, micro)
    order = [("F", m) for m in range(warmup)]
    for m in range(micro - warmup):
        order += [("F", warmup + m), ("B", m)]
    return order + [("B", m) for m in range(micro - warmup, micro)]


def simulate(plan: PlanPrediction, num_microbatches: int, schedule: str) -> list[TimelineOp]:
    """Start and end of every op of one flush under ``plan``'s predicted stage times.

    Args:
        plan: a prediction from :mod:`autopipe.search` (one chunk per stage).
        num_microbatches: M.
        schedule: "gpipe" or "1f1b".

    Returns:
        The ops, in no particular order.
    """
    stages = len(plan.stages)
    # comm is split over the two directions as the cost model charges it: outputs on, gradients back
    forward = [s.forward_s + s.comm_s / 2 for s in plan.stages]
    backward = [s.backward_s + s.comm_s / 2 for s in plan.stages]
    orders = [stage_order(s, stages, num_microbatches, schedule) for s in range(stages)]
    done: dict[tuple[str, int, int], float] = {}
    cursor, free_at = [0] * stages, [0.0] * stages
    ops: list[TimelineOp] = []
    while any(cursor[s] < len(orders[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            if cursor[s] == len(orders[s]):
                continue
            kind, m = orders[s][cursor[s]]
            dependency = ("F", s - 1, m) if kind == "F" and s > 0 else ("B", s + 1, m) if kind == "B" and \
                s < stages - 1 else ("F", s, m) if kind == "B" else None
            if dependency is not None and dependency not in done:
                continue
            start = max(free_at[s], done.get(dependency, 0.0))
            end = start + (forward[s] if kind == "F" else backward[s])
            ops.append(TimelineOp(stage=s, microbatch=m, kind=kind, start_s=start, end_s=end))
            done[(kind, s, m)], free_at[s], cursor[s], progressed = end, end, cursor[s] + 1, True
        if not progressed:
            raise RuntimeError("the schedule order deadlocked; this is a bug in stage_order")
    return ops


def draw_png(plan: PlanPrediction, num_microbatches: int, schedule: str, path: str | os.PathLike) -> float:
    """Draw the simulated flush as a Gantt chart (one row per stage) into ``path``.

    Args:
        plan: the prediction to draw.
        num_microbatches: M.
        schedule: "gpipe" or "1f1b".
        path: the PNG to write.

    Returns:
        The simulated flush time in seconds.

    Raises:
        RuntimeError: matplotlib is not installed (``pip install 'angelptm[plot]'``).
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("drawing the timeline needs matplotlib, which is not installed: "
                           "pip install 'angelptm[plot]' (or pip install matplotlib)") from None
    ops = simulate(plan, num_microbatches, schedule)
    makespan = max(op.end_s for op in ops)
    figure, axes = plt.subplots(figsize=(12, 0.6 * len(plan.stages) + 1.5))
    for op in ops:
        color = "tab:blue" if op.kind == "F" else "tab:orange"
        axes.barh(op.stage, (op.end_s - op.start_s) * 1e3, left=op.start_s * 1e3, color=color, edgecolor="black")
        axes.text((op.start_s + op.end_s) / 2 * 1e3, op.stage, f"{op.kind}{op.microbatch}", ha="center",
                  va="center", fontsize=7, color="white")
    axes.set_yticks(range(len(plan.stages)), [f"stage {s}" for s in range(len(plan.stages))])
    axes.invert_yaxis()
    axes.set_xlabel("time (ms)")
    axes.set_title(f"{plan.method}: {schedule}, {num_microbatches} micro-batches, flush {makespan * 1e3:.2f} ms, "
                   f"bubble {plan.bubble_fraction:.1%}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return makespan
