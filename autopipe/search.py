"""Partition search: contiguous stages of a cost chain that minimise the bottleneck stage time.

The pipeline's steady state runs at the pace of its slowest stage, so the objective is the min-max
(bottleneck) stage time under each stage's memory cap. Over a chain this is exact by dynamic programming
(the linear-partition recurrence used by PipeDream's planner)::

    best[j][b] = min over a < b of  max(best[j-1][a], T_{j-1}(a, b))      (T = inf if stage j-1 does not fit)

O(S * n^2) with the inner minimum vectorised over ``a``. The same routine, with parameter bytes as the cost
and cuts allowed only between layers, is DeepSpeed's ``partition_method="parameters"`` baseline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from autopipe.cost import CostChain, CostSettings, StageCostModel

PartCost = Callable[[int, np.ndarray, int], np.ndarray]
"""cost(part_index, candidate_starts, end) -> cost of each candidate part [start, end) (inf = not allowed)."""


def min_max_partition(num_units: int, num_parts: int, cost: PartCost,
                      allowed_starts: np.ndarray | None = None) -> tuple[float, tuple[int, ...]]:
    """Exact min-max split of ``num_units`` units into ``num_parts`` non-empty contiguous parts.

    Args:
        num_units: length n of the chain.
        num_parts: number of parts; at most n.
        cost: vectorised part cost, see :data:`PartCost`.
        allowed_starts: boolean mask over units [0, n): where a part other than the first may start
            (None = anywhere).

    Returns:
        ``(bottleneck, starts)``: the smallest achievable maximum part cost (inf if none is finite) and
        the first unit of each part (``starts[0] == 0``).
    """
    if not 1 <= num_parts <= num_units:
        raise ValueError(f"num_parts={num_parts}: must be between 1 and the {num_units} units of the chain")
    allowed = np.ones(num_units, dtype=bool) if allowed_starts is None else np.asarray(allowed_starts, dtype=bool)
    best = np.full((num_parts + 1, num_units + 1), np.inf)
    choice = np.zeros((num_parts + 1, num_units + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for part in range(1, num_parts + 1):
        ends = range(num_units, num_units + 1) if part == num_parts else range(part, num_units + 1)
        for end in ends:
            starts = np.arange(part - 1, end)
            prev = best[part - 1, starts]
            candidates = np.maximum(prev, cost(part - 1, starts, end))
            if part > 1:
                candidates = np.where(allowed[starts], candidates, np.inf)
            pick = int(np.argmin(candidates))
            best[part, end], choice[part, end] = candidates[pick], starts[pick]
    bounds, end = [], num_units
    for part in range(num_parts, 0, -1):
        end = int(choice[part, end])
        bounds.append(end)
    return float(best[num_parts, num_units]), tuple(reversed(bounds))


@dataclass(frozen=True, slots=True)
class StagePrediction:
    """Predicted cost of one stage (chunk) per micro-batch."""

    first_unit: int
    end_unit: int
    forward_s: float
    backward_s: float
    """Including the forward re-run when recompute is on."""
    comm_s: float
    time_s: float
    memory_bytes: float


@dataclass(frozen=True, slots=True)
class PlanPrediction:
    """A split and what the cost model predicts for it."""

    method: str
    """"auto", "uniform-layers" or "parameters"."""
    stage_starts: tuple[int, ...]
    """First unit of each chunk."""
    stages: tuple[StagePrediction, ...]
    bottleneck_s: float
    """Largest stage time per micro-batch."""
    step_time_s: float
    """One flush of M micro-batches: sum(T) + (M-1) * max(T) for GPipe/1F1B; M * max rank load
    + (S-1) * max chunk time for interleaved."""
    bubble_fraction: float
    """Idle share of the flush, 1 - M * sum(T) / (S * step); (S-1)/(M+S-1) when balanced."""


def predict(chain: CostChain, settings: CostSettings, stage_starts: tuple[int, ...], method: str) -> PlanPrediction:
    """Evaluate a given split under the cost model.

    Args:
        chain: measured units.
        settings: schedule and limits.
        stage_starts: first unit of each of the ``settings.num_chunks`` chunks, ascending, starting at 0.
        method: a label for reports.

    Returns:
        Per-stage times and memory, step time and bubble fraction.
    """
    if len(stage_starts) != settings.num_chunks or stage_starts[0] != 0 or list(stage_starts) != sorted(
            set(stage_starts)) or stage_starts[-1] >= chain.num_units:
        raise ValueError(f"stage_starts={stage_starts}: need {settings.num_chunks} ascending distinct unit indices "
                         f"from 0 below {chain.num_units}")
    model = StageCostModel(chain, settings)
    ends = (*stage_starts[1:], chain.num_units)
    stages = tuple(StagePrediction(first_unit=a, end_unit=b, forward_s=float(model.forward_s(a, b)),
                                   backward_s=float(model.backward_s(a, b)), comm_s=float(model.comm_s(a, b)),
                                   time_s=float(model.time_s(a, b)), memory_bytes=float(model.memory_bytes(c, a, b)))
                   for c, (a, b) in enumerate(zip(stage_starts, ends)))
    times = [stage.time_s for stage in stages]
    ranks, micro = settings.num_stages, settings.num_microbatches
    if settings.schedule == "interleaved":
        loads = [sum(times[rank::ranks]) for rank in range(ranks)]
        step = micro * max(loads) + (ranks - 1) * max(times)
    else:
        step = sum(times) + (micro - 1) * max(times)
    bubble = 1.0 - micro * sum(times) / (ranks * step) if step > 0 else 0.0
    return PlanPrediction(method=method, stage_starts=tuple(stage_starts), stages=stages, bottleneck_s=max(times),
                          step_time_s=step, bubble_fraction=bubble)


def search(chain: CostChain, settings: CostSettings) -> PlanPrediction:
    """The split with the smallest bottleneck stage time whose stages all fit their memory cap.

    Args:
        chain: measured units.
        settings: schedule, number of stages, memory cap, bandwidth.

    Returns:
        The prediction of the best split (method "auto").

    Raises:
        ValueError: fewer units than chunks, or no split fits the memory cap (the message gives the
            smallest peak stage memory any split reaches).
    """
    chunks = settings.num_chunks
    if chunks > chain.num_units:
        raise ValueError(f"autopipe.num_stages * virtual_stages_per_rank = {chunks} stages, but the model has only "
                         f"{chain.num_units} pieces between its allowed cuts ({chain.num_units - 1} cut points); use "
                         "fewer stages or raise autopipe.max_cut_tensors")
    model = StageCostModel(chain, settings)
    bottleneck, starts = min_max_partition(chain.num_units, chunks, model.feasible_time_s)
    if math.isinf(bottleneck):
        need, _ = min_max_partition(chain.num_units, chunks, model.memory_bytes)
        per_rank = need * settings.virtual_stages_per_rank
        raise ValueError(
            f"autopipe.stage_memory_limit_bytes={settings.memory_limit_bytes:.0f} "
            f"({settings.memory_limit_bytes / 2**30:.2f} GiB): no split into {chunks} stages fits; the best split "
            f"still needs {per_rank:.0f} bytes ({per_rank / 2**30:.2f} GiB) on its fullest rank. Allowed: a limit "
            f">= that, more stages, autopipe.recompute=true, fewer micro-batches in flight (gpipe keeps all M), "
            "or a smaller micro-batch")
    return predict(chain, settings, starts, "auto")


def layer_start_mask(chain: CostChain) -> np.ndarray:
    """Units where a layer-granular split may start a stage: where the layer index changes."""
    if not chain.unit_layer:
        return np.ones(chain.num_units, dtype=bool)
    layers = np.asarray(chain.unit_layer)
    return np.concatenate(([True], layers[1:] != layers[:-1]))


def uniform_layer_starts(chain: CostChain, num_parts: int) -> tuple[int, ...]:
    """Megatron-style split: round(L / S) layers per stage; the ops before the first layer (embeddings)
    join stage 0 and those after the last (head, loss) join the last stage.

    Args:
        chain: units with ``unit_layer`` and ``num_layers`` set.
        num_parts: stages.

    Returns:
        First unit of each stage.

    Raises:
        ValueError: no layer structure, fewer layers than stages, or a layer boundary that is not a cut.
    """
    if not chain.unit_layer or chain.num_layers < num_parts:
        raise ValueError(f"a uniform-layer split into {num_parts} stages needs >= {num_parts} layers; the chain "
                         f"has {chain.num_layers}")
    layers = np.asarray(chain.unit_layer)
    starts = [0]
    for part in range(1, num_parts):
        first_layer = round(part * chain.num_layers / num_parts)
        unit = int(np.searchsorted(layers, first_layer, side="left"))
        if unit >= chain.num_units or layers[unit] != first_layer or unit <= starts[-1]:
            raise ValueError(f"layer {first_layer} does not start at a cut of the chain")
        starts.append(unit)
    return tuple(starts)


def parameter_count_starts(chain: CostChain, num_parts: int) -> tuple[int, ...]:
    """DeepSpeed's ``partition_method="parameters"``: balance parameter bytes over layer-granular stages.

    Raises:
        ValueError: fewer layer-granular places to start a stage than stages.
    """
    prefix = np.concatenate(([0.0], np.cumsum(np.asarray(chain.param_bytes, dtype=np.float64))))
    bottleneck, starts = min_max_partition(chain.num_units, num_parts, lambda _, a, b: prefix[b] - prefix[a],
                                           layer_start_mask(chain))
    if math.isinf(bottleneck):  # the DP found no split on layer boundaries; its starts would cut inside layers
        raise ValueError(f"a parameter-count split into {num_parts} stages needs >= {num_parts} layer-granular "
                         f"stage starts; the chain has {int(layer_start_mask(chain).sum())}")
    return starts


@dataclass(frozen=True, slots=True)
class PlanReport:
    """The searched split next to the two by-layer baselines, all under the same cost model."""

    auto: PlanPrediction
    baselines: tuple[PlanPrediction, ...]

    def speedup_over(self, method: str) -> float:
        """Predicted step-time ratio baseline / auto."""
        baseline = next(b for b in self.baselines if b.method == method)
        return baseline.step_time_s / self.auto.step_time_s

    def format(self) -> str:
        """A plain-text table: stages per method, then predicted speedups."""
        lines = []
        for plan in (self.auto, *self.baselines):
            lines.append(f"{plan.method}: stage starts (units) {list(plan.stage_starts)}, "
                         f"step {plan.step_time_s * 1e3:.3f} ms, bottleneck {plan.bottleneck_s * 1e3:.3f} ms, "
                         f"bubble {plan.bubble_fraction:.1%}")
            lines.append(f"  {'stage':>5} {'units':>11} {'fwd ms':>9} {'bwd ms':>9} {'comm ms':>8} {'time ms':>9} "
                         f"{'memory GiB':>10}")
            for index, stage in enumerate(plan.stages):
                units = f"{stage.first_unit}-{stage.end_unit - 1}"
                lines.append(f"  {index:>5} {units:>11} {stage.forward_s * 1e3:>9.3f} "
                             f"{stage.backward_s * 1e3:>9.3f} {stage.comm_s * 1e3:>8.3f} {stage.time_s * 1e3:>9.3f} "
                             f"{stage.memory_bytes / 2**30:>10.3f}")
        for baseline in self.baselines:
            lines.append(f"predicted speedup of auto over {baseline.method}: {self.speedup_over(baseline.method):.3f}x")
        return "\n".join(lines)


def plan_with_baselines(chain: CostChain, settings: CostSettings) -> PlanReport:
    """Search the split and evaluate the uniform-layer and parameter-count splits beside it.

    Args:
        chain: measured units.
        settings: schedule and limits.

    Returns:
        The report; baselines are evaluated without the memory cap (they are what a user would set by hand).
    """
    auto = search(chain, settings)
    chunks = settings.num_chunks
    baselines = []
    for method, starts_of in (("uniform-layers", uniform_layer_starts), ("parameters", parameter_count_starts)):
        try:
            baselines.append(predict(chain, settings, starts_of(chain, chunks), method))
        except ValueError:  # too few layers for a by-layer split: nothing to compare against
            continue
    return PlanReport(auto=auto, baselines=tuple(baselines))
