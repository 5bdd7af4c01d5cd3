"""Where pipeline stages start: DeepSpeed's layer partitions, and the traced ops each layer became.

``partition_uniform`` and ``partition_balanced`` reproduce ``deepspeed.runtime.utils`` (0.19) exactly, so a
``PipelineModule`` splits where DeepSpeed's would: the balanced rule is DeepSpeed's dynamic program that
minimises the spread (max - min) of the parts' weights, not their maximum.

The engine traces the whole ``PipelineModule`` with each layer called through a parameterless
``slots.<i>`` module, so every op records the layer it belongs to; :func:`layer_op_starts` turns layer
boundaries into the op indices AutoPipe's runtime cuts at.
"""

from __future__ import annotations

import re

import numpy as np
from torch import fx

from autopipe.graph import OpGraph

SLOT_PREFIX = "slots"
_SLOT = re.compile(rf"^{SLOT_PREFIX}\.(\d+)$")


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """``num_parts + 1`` boundaries splitting ``num_items`` as evenly as possible, larger parts first.

    Returns:
        Part i is ``[parts[i], parts[i + 1])``.
    """
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    return [p * chunk + min(p, residual) for p in range(num_parts + 1)]


def partition_balanced(weights: list[float], num_parts: int) -> list[int]:
    """DeepSpeed's linear partition: contiguous parts whose weight spread (max - min) is smallest.

    Ties go to the later split point, as in DeepSpeed (``>=`` in its inner loop).

    Returns:
        ``num_parts + 1`` boundaries.
    """
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    dp_max = np.full((n + 1, m + 1), np.inf)
    dp_min = np.full((n + 1, m + 1), np.inf)
    dp_cost = np.full((n + 1, m + 1), np.inf)
    position = np.zeros((n + 1, m + 1), dtype=int)
    prefix = np.zeros(n + 1)
    prefix[1:] = np.cumsum(weights)
    dp_max[0, 0] = dp_cost[0, 0] = 0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                part = prefix[i] - prefix[k]
                high, low = max(dp_max[k, j - 1], part), min(dp_min[k, j - 1], part)
                if dp_cost[i, j] >= high - low:
                    dp_cost[i, j], dp_max[i, j], dp_min[i, j], position[i, j] = high - low, high, low, k
    parts = [n]
    for j in reversed(range(1, m + 1)):
        parts.append(int(position[parts[-1], j]))
    return parts[::-1]


def op_layers(graph: OpGraph, num_layers: int) -> list[int]:
    """The layer of each body op: from its ``slots.<i>`` module, else the layer before it (-1 before the first;
    ops after the last layer, e.g. the loss function's own casts, belong to ``num_layers``)."""
    layers, current = [], -1
    for node in graph.ops[:graph.num_body_ops]:
        slot = _slot_of(node)
        current = slot if slot is not None else (num_layers if current == num_layers - 1 else current)
        layers.append(current)
    return layers


def _slot_of(node: fx.Node) -> int | None:
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        match = _SLOT.match(path)
        if match:
            return int(match.group(1))
    return None


def layer_op_starts(graph: OpGraph, parts: list[int]) -> list[int]:
    """First body op of each stage, for DeepSpeed's layer ``parts``.

    Raises:
        ValueError: a stage whose layers produced no ops, or a boundary that a non-floating tensor crosses
            (a stage can only receive tensors a gradient flows back through).
    """
    num_layers = parts[-1]
    layers = op_layers(graph, num_layers)
    starts = [0]
    for stage in range(1, len(parts) - 1):
        first = next((k for k, layer in enumerate(layers) if layer >= parts[stage]), None)
        if first is None or first <= starts[-1]:
            raise ValueError(f"pipeline stage {stage} (layers {parts[stage]}..{parts[stage + 1] - 1}) or the stage "
                             "before it has no operations in the traced model; use fewer stages or another "
                             "partition_method")
        for value in graph.crossing(first):
            meta = value.meta.get("val")
            if meta is None or not getattr(meta, "is_floating_point", lambda: False)():
                raise ValueError(f"pipeline stage {stage} starts at layer {parts[stage]}, where {value.name} "
                                 f"({getattr(meta, 'dtype', type(meta).__name__)}) crosses the cut; stages here pass "
                                 "only floating-point tensors (a gradient flows back through each). Start the stage "
                                 "at another layer, or use partition_method='autopipe'")
        starts.append(first)
    return starts
