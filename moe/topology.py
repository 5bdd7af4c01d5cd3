"""Where the expert-parallel ranks sit (nodes x ranks per node), their process groups, and the
alpha-beta cost model that picks flat or hierarchical all-to-all.

Cost model (Hockney's alpha-beta: a message of b bytes costs alpha + b / bandwidth). Each of the
W = M * L ranks holds B bytes to exchange, B / W for every rank (balanced routing):

* flat: every rank posts W - 1 messages at once. The L - 1 intra-node ones share NVLink, the
  W - L inter-node ones share the rank's NIC; both run concurrently, so
  t_flat = max((L-1) * a_intra + B (L-1)/W / bw_intra,  (W-L) * a_inter + B (W-L)/W / bw_inter).
* hierarchical (Tutel 2D): an intra-node all-to-all of all B bytes (L - 1 messages of B / L), then an
  inter-node one (M - 1 messages of B / M), one after the other:
  t_hier = (L-1) * a_intra + B (L-1)/L / bw_intra + (M-1) * a_inter + B (M-1)/M / bw_inter.

The inter-node bytes are equal ((W-L)/W = (M-1)/M); the hierarchical exchange trades an extra
intra-node pass for M - 1 instead of W - L inter-node message latencies, so it wins for small
messages and many nodes, and loses for large messages: the crossover is where the two lines meet.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class Link:
    """One kind of link in the alpha-beta model."""

    latency_s: float
    """alpha: seconds per message."""
    bandwidth_bytes_per_s: float
    """1 / beta: bytes per second per rank."""

    def __post_init__(self) -> None:
        if self.latency_s < 0 or self.bandwidth_bytes_per_s <= 0:
            raise ValueError(f"Link: latency_s must be >= 0 and bandwidth_bytes_per_s > 0, got {self}")


def flat_all_to_all_s(bytes_per_rank: float, ranks_per_node: int, nodes: int, intra: Link, inter: Link) -> float:
    """Predicted seconds of one flat all-to-all (see the module docstring).

    Args:
        bytes_per_rank: B, bytes each rank sends (to all ranks, itself included).
        ranks_per_node: L.
        nodes: M.
        intra: NVLink-class link inside a node.
        inter: network link between nodes (per rank).

    Returns:
        Seconds.
    """
    world = ranks_per_node * nodes
    intra_s = (ranks_per_node - 1) * intra.latency_s + bytes_per_rank * (ranks_per_node - 1) / world / intra.bandwidth_bytes_per_s
    inter_s = (world - ranks_per_node) * inter.latency_s + bytes_per_rank * (world - ranks_per_node) / world / inter.bandwidth_bytes_per_s
    return max(intra_s, inter_s)


def hierarchical_all_to_all_s(bytes_per_rank: float, ranks_per_node: int, nodes: int, intra: Link,
                              inter: Link) -> float:
    """Predicted seconds of one two-step (intra-node, then inter-node) all-to-all; same arguments as
    :func:`flat_all_to_all_s`."""
    lpn = ranks_per_node
    intra_s = (lpn - 1) * intra.latency_s + bytes_per_rank * (lpn - 1) / lpn / intra.bandwidth_bytes_per_s
    inter_s = (nodes - 1) * inter.latency_s + bytes_per_rank * (nodes - 1) / nodes / inter.bandwidth_bytes_per_s
    return intra_s + inter_s


def prefer_hierarchical(bytes_per_rank: float, ranks_per_node: int, nodes: int, intra: Link, inter: Link) -> bool:
    """True when the model predicts the hierarchical exchange to be faster (never on one node or one rank per node)."""
    if nodes < 2 or ranks_per_node < 2:
        return False
    args = (bytes_per_rank, ranks_per_node, nodes, intra, inter)
    return hierarchical_all_to_all_s(*args) < flat_all_to_all_s(*args)


def crossover_bytes(ranks_per_node: int, nodes: int, intra: Link, inter: Link, *, upper_bytes: float = 1e12) -> float | None:
    """Largest bytes per rank at which hierarchical is still predicted faster (bisection).

    Both predictions are piecewise linear in B and hierarchical's slope is the larger, so the set where
    it wins is [0, crossover).

    Returns:
        The crossover in bytes, or None if hierarchical never wins (e.g. a single node).
    """
    if not prefer_hierarchical(1.0, ranks_per_node, nodes, intra, inter):
        return None
    low, high = 1.0, upper_bytes
    if prefer_hierarchical(high, ranks_per_node, nodes, intra, inter):
        return high
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if prefer_hierarchical(mid, ranks_per_node, nodes, intra, inter) else (low, mid)
    return low


def ranks_per_node_from_env(override: int | None = None) -> int:
    """Ranks per node: ``override`` (``moe.ranks_per_node``) or the launcher's LOCAL_WORLD_SIZE, else 1.

    Raises:
        ValueError: LOCAL_WORLD_SIZE is not a positive integer.
    """
    if override is not None:
        return override
    raw = os.environ.get("LOCAL_WORLD_SIZE", "1")
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE={raw!r}: expected a positive integer (set moe.ranks_per_node instead)")
    return int(raw)


@dataclass(frozen=True, slots=True)
class ExpertParallelGroups:
    """This rank's expert-parallel group and, on several nodes, its intra- and inter-node subgroups."""

    group: dist.ProcessGroup
    """The expert-parallel group (consecutive global ranks)."""
    rank: int
    """This rank's index in ``group``."""
    size: int
    """W, ranks in ``group``."""
    ranks_per_node: int
    """L as seen inside the group (min(L, W))."""
    intra: dist.ProcessGroup | None
    """Ranks of this node in the group; None when the group fits in one node."""
    inter: dist.ProcessGroup | None
    """Ranks with this local index on every node of the group; None when it fits in one node."""

    @property
    def nodes(self) -> int:
        return self.size // self.ranks_per_node


def build_expert_parallel_groups(ep_size: int, ranks_per_node: int) -> ExpertParallelGroups:
    """Create the expert-parallel groups (every rank must call this, in the same order).

    Global ranks are split into consecutive blocks of ``ep_size``; inside each block, nodes are
    consecutive runs of ``ranks_per_node`` ranks (torchrun's rank order).

    Args:
        ep_size: W; must divide the world size.
        ranks_per_node: L; when W > L it must divide W.

    Returns:
        This rank's :class:`ExpertParallelGroups`.

    Raises:
        ValueError: sizes that do not divide.
    """
    world, me = dist.get_world_size(), dist.get_rank()
    if ep_size < 1 or world % ep_size:
        raise ValueError(f"moe.ep_size={ep_size}: must divide the world size {world}")
    lpn = min(ranks_per_node, ep_size)
    if ep_size % lpn:
        raise ValueError(f"moe.ranks_per_node={ranks_per_node}: must divide moe.ep_size={ep_size} "
                         "(expert-parallel groups span whole nodes)")
    mine = {}
    for start in range(0, world, ep_size):
        block = list(range(start, start + ep_size))
        group = dist.new_group(block)
        if me in block:
            mine["group"] = group
        if lpn == ep_size:  # one node: no subgroups
            continue
        for node_start in range(0, ep_size, lpn):
            ranks = block[node_start:node_start + lpn]
            sub = dist.new_group(ranks)
            if me in ranks:
                mine["intra"] = sub
        for local in range(lpn):
            ranks = block[local::lpn]
            sub = dist.new_group(ranks)
            if me in ranks:
                mine["inter"] = sub
    return ExpertParallelGroups(group=mine["group"], rank=me % ep_size, size=ep_size, ranks_per_node=lpn,
                                intra=mine.get("intra"), inter=mine.get("inter"))
