"""Where the expert-parallel ranks sit (nodes x ranks per node), their process groups, and the
alpha-beta cost model that picks flat or hierarchical all-to-all.

Cost model (Hockney's alpha-beta: a message of b bytes costs alpha + b / bandwidth), extended by two fixed
costs that a per-link probe alone does not show. Each of the W = M * L ranks holds B bytes to exchange, B / W for
every rank (balanced routing):

* a link (:class:`Link`) costs ``call_s`` once per all-to-all call over it, ``latency_s`` per peer message
  (gloo over TCP sends one message per peer, so its cost grows with the fan-out; NCCL's mostly does not), and
  b / bandwidth per rank;
* an exchange step (``step_s``) costs the exchange machinery around one all-to-all: the reorders, the
  launch and the host's wait. Flat pays it once, hierarchical twice.

* flat: every rank posts W - 1 messages at once. The L - 1 intra-node ones share NVLink, the
  W - L inter-node ones share the rank's NIC; both run concurrently, so
  t_flat = step + max(c_intra + (L-1) a_intra + B (L-1)/W / bw_intra,  c_inter + (W-L) a_inter + B (W-L)/W / bw_inter).
* hierarchical (Tutel 2D): an intra-node all-to-all of all B bytes (L - 1 messages of B / L), then an
  inter-node one (M - 1 messages of B / M), one after the other:
  t_hier = 2 step + c_intra + (L-1) a_intra + B (L-1)/L / bw_intra + c_inter + (M-1) a_inter + B (M-1)/M / bw_inter.

The inter-node bytes are equal ((W-L)/W = (M-1)/M); the hierarchical exchange trades an extra
intra-node pass (its call, its bytes and one more step) for M - 1 instead of W - L inter-node messages, so it
wins for small messages and many nodes, and loses for large messages: the crossover is where the two lines
meet. Hierarchical's slope in B is at least flat's, so the set where it wins is [0, crossover).

Fitting (:func:`fit_link`): a probe times one all-to-all per size and fan-out; alpha and bandwidth come from a
least-squares line in *relative* error. Absolute least squares over 64 KiB .. 256 MiB is set by the largest
sizes, whose noise is milliseconds, and leaves the intercept (the per-message latency the crossover hangs on)
to chance: on a gloo link it gave 136 us where the 64 KiB probe itself took 335 us (issue 41).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class Link:
    """One kind of link in the alpha-beta model."""

    latency_s: float
    """alpha: seconds per peer message."""
    bandwidth_bytes_per_s: float
    """1 / beta: bytes per second per rank."""
    call_s: float = 0.0
    """Seconds per all-to-all call over this link, whatever its fan-out (0: folded into ``latency_s``)."""

    def __post_init__(self) -> None:
        if self.latency_s < 0 or self.bandwidth_bytes_per_s <= 0 or self.call_s < 0:
            raise ValueError(f"Link: latency_s and call_s must be >= 0, bandwidth_bytes_per_s > 0; got {self}")


def step_on_link_s(link: Link, peers: int, bytes_moved: float) -> float:
    """Seconds of one all-to-all call over ``link`` that sends ``peers`` messages, ``bytes_moved`` in all."""
    return link.call_s + peers * link.latency_s + bytes_moved / link.bandwidth_bytes_per_s


def flat_all_to_all_s(bytes_per_rank: float, ranks_per_node: int, nodes: int, intra: Link, inter: Link, *,
                      step_s: float = 0.0) -> float:
    """Predicted seconds of one flat all-to-all (see the module docstring).

    Args:
        bytes_per_rank: B, bytes each rank sends (to all ranks, itself included).
        ranks_per_node: L.
        nodes: M.
        intra: NVLink-class link inside a node.
        inter: network link between nodes (per rank).
        step_s: the exchange machinery's cost per all-to-all step (reorders, launch, host wait).

    Returns:
        Seconds.
    """
    world, lpn = ranks_per_node * nodes, ranks_per_node
    on_node = step_on_link_s(intra, lpn - 1, bytes_per_rank * (lpn - 1) / world) if lpn > 1 else 0.0
    off_node = step_on_link_s(inter, world - lpn, bytes_per_rank * (world - lpn) / world) if nodes > 1 else 0.0
    return step_s + max(on_node, off_node)


def hierarchical_all_to_all_s(bytes_per_rank: float, ranks_per_node: int, nodes: int, intra: Link,
                              inter: Link, *, step_s: float = 0.0) -> float:
    """Predicted seconds of one two-step (intra-node, then inter-node) all-to-all; same arguments as
    :func:`flat_all_to_all_s`."""
    lpn = ranks_per_node
    steps = [(intra, lpn - 1, bytes_per_rank * (lpn - 1) / lpn),
             (inter, nodes - 1, bytes_per_rank * (nodes - 1) / nodes)]
    # A level with one member has no step (one node: the flat exchange inside it; cf. build_expert_parallel_groups).
    return sum(step_s + step_on_link_s(link, peers, moved) for link, peers, moved in steps if peers > 0)


def prefer_hierarchical(bytes_per_rank: float, ranks_per_node: int, nodes: int, intra: Link, inter: Link, *,
                        step_s: float = 0.0) -> bool:
    """True when the model predicts the hierarchical exchange to be faster (never on one node or one rank per node)."""
    if nodes < 2 or ranks_per_node < 2:
        return False
    args = (bytes_per_rank, ranks_per_node, nodes, intra, inter)
    return hierarchical_all_to_all_s(*args, step_s=step_s) < flat_all_to_all_s(*args, step_s=step_s)


def crossover_bytes(ranks_per_node: int, nodes: int, intra: Link, inter: Link, *, step_s: float = 0.0,
                    upper_bytes: float = 1e12) -> float | None:
    """Largest bytes per rank at which hierarchical is still predicted faster (bisection).

    Hierarchical's slope in B is at least flat's (module docstring), so the set where it wins is [0, crossover).

    Returns:
        The crossover in bytes, or None if hierarchical never wins (e.g. a single node).
    """
    def wins(num_bytes: float) -> bool:
        return prefer_hierarchical(num_bytes, ranks_per_node, nodes, intra, inter, step_s=step_s)

    if not wins(1.0):
        return None
    low, high = 1.0, upper_bytes
    if wins(high):
        return high
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if wins(mid) else (low, mid)
    return low


def fit_link(points: list[tuple[int, float, float]]) -> Link:
    """Fit a :class:`Link` to probe times, least squares in relative error.

    Args:
        points: (peers, bytes_moved, seconds) of one all-to-all call each: ``peers`` messages leave the rank,
            ``bytes_moved`` bytes in all. With one fan-out the fixed part is all ``latency_s`` (per message,
            ``call_s`` = 0); with two or more fan-outs it splits into ``call_s`` + peers * ``latency_s``.

    Returns:
        The fitted link (terms that come out negative are dropped and the rest refitted, so it stays valid).

    Raises:
        ValueError: fewer than two sizes, or a time that is not positive.
    """
    if len({b for _, b, _ in points}) < 2 or any(t <= 0 for _, _, t in points):
        raise ValueError(f"fit_link: need >= 2 sizes and positive times, got {points}")
    terms = ["call", "peer", "bytes"] if len({p for p, _, _ in points}) > 1 else ["peer", "bytes"]
    column = {"call": lambda p, b: 1.0, "peer": lambda p, b: float(p), "bytes": lambda p, b: b}
    while True:
        # Rows divided by the measured time: each point's error counts relative to its own size.
        a = torch.tensor([[column[k](p, b) / t for k in terms] for p, b, t in points], dtype=torch.float64)
        solution = torch.linalg.lstsq(a, torch.ones(len(points), 1, dtype=torch.float64)).solution.flatten().tolist()
        fitted = dict(zip(terms, solution))
        negative = [k for k in terms if k != "bytes" and fitted[k] < 0]
        if not negative:
            break
        terms.remove(negative[0])
    return Link(latency_s=fitted.get("peer", 0.0), bandwidth_bytes_per_s=1.0 / max(fitted["bytes"], 1e-18),
                call_s=fitted.get("call", 0.0))


def measured_crossover_bytes(points: list[tuple[float, float, float]]) -> float | None:
    """The measured crossover: above the last size where hierarchical wins, where hier / flat reaches 1
    (interpolated in log bytes and log ratio up to the next size).

    Args:
        points: (bytes per rank, flat seconds, hierarchical seconds), by increasing bytes.

    Returns:
        Bytes, or None when hierarchical never wins or still wins at the largest size.
    """
    wins = [i for i, (_, flat, hier) in enumerate(points) if hier < flat]
    if not wins or wins[-1] == len(points) - 1:
        return None
    (xa, fa, ha), (xb, fb, hb) = points[wins[-1]], points[wins[-1] + 1]
    da, db = math.log(ha / fa), math.log(hb / fb)
    return math.exp(math.log(xa) + (math.log(xb) - math.log(xa)) * da / (da - db))


def crossover_under_noise(points: list[tuple[float, float, float]], noise: float = 0.02) -> list[float | None]:
    """:func:`measured_crossover_bytes` with one size's hierarchical time ``noise`` faster, then slower, for each size
    in turn: how far timing noise moves the measured crossover (None where it removes it)."""
    return [measured_crossover_bytes([(x, flat, hier * (1 + sign * noise) if j == i else hier)
                                      for j, (x, flat, hier) in enumerate(points)])
            for i in range(len(points)) for sign in (-1, 1)]


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
