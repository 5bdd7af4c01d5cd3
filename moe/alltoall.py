"""Token exchange between expert-parallel ranks: flat and hierarchical all-to-all, as autograd ops.

Shape legend: N = rows (tokens), D = model dim, W = ranks in the expert-parallel group,
L = ranks per node, M = nodes (W = M * L), E = experts (all ranks), J = experts per rank (E / W).

Rows leave a rank sorted by global expert, so by destination rank. An exchange is a list of ops,
each either a local ``reorder`` of consecutive pieces or an ``all_to_all_single`` with split sizes;
its inverse (the combine, and every backward) runs the inverted ops in reverse order.

* flat: one all-to-all over the W ranks, then reorder from [source][expert] to [expert][source]
  so each local expert's rows are contiguous;
* hierarchical (Tutel's 2D all-to-all, Hwang et al. 2022, sec. 3.3): first an all-to-all inside
  the node that hands each local rank l the rows bound for rank l of every node, then an
  all-to-all among the ranks with the same local index on the M nodes. Each rank sends M - 1
  inter-node messages of L times the size instead of W - L small ones; the bytes crossing nodes
  are the same. Both end in the same [source][expert] layout, so the outputs are bit-identical.

An all-to-all step runs over a process group, or over any :class:`Transport` put in its place (a benchmark's
staged or split exchange, for instance one whose inter-node step goes through host memory).

All split sizes come from one all-gathered [W, E] count matrix per chunk (the layer copies it to
the host once per forward: ``all_to_all_single`` takes host integers).

Each all-to-all is issued with ``async_op=True``; :class:`Exchange` advances op by op so a chunk's
exchange can be in flight while another chunk's experts compute. On NCCL, ``Work.wait()`` only
orders the streams; the host does not block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from moe.dispatch import inverse_order, reorder_chunks


@dataclass(slots=True)
class _Box:
    """The in-flight work of one all-to-all (forward) and of its reverse (backward)."""

    work: object = None
    grad_work: object = None
    grad_input: Tensor | None = None


class Transport(Protocol):
    """Something other than a process group that carries one all-to-all step."""

    def all_to_all_single(self, output: Tensor, input: Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int]) -> object:
        """Start ``dist.all_to_all_single``'s exchange (splits in the step's rank order); returns an object
        whose ``wait()`` returns once ``output`` may be read."""


def _launch(input_ND: Tensor, send: list[int], recv: list[int],
            group: dist.ProcessGroup | Transport) -> tuple[Tensor, object]:
    output_ND = input_ND.new_empty((sum(recv), *input_ND.shape[1:]))
    if group is not None and not isinstance(group, dist.ProcessGroup):  # (a ProcessGroup has a method of that name)
        return output_ND, group.all_to_all_single(output_ND, input_ND.contiguous(), recv, send)
    work = dist.all_to_all_single(output_ND, input_ND.contiguous(), recv, send, group=group, async_op=True)
    return output_ND, work


class _AllToAllStart(torch.autograd.Function):
    """Launch all_to_all_single; the output is valid only after :class:`_AllToAllWait`."""

    @staticmethod
    def forward(ctx, x_ND: Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup, box: _Box) -> Tensor:
        ctx.box = box
        output_ND, box.work = _launch(x_ND, send, recv, group)
        return output_ND

    @staticmethod
    def backward(ctx, _unused_grad: Tensor):
        box = ctx.box
        box.grad_work.wait()  # the reverse exchange launched by _AllToAllWait.backward
        grad_input, box.grad_input, box.grad_work = box.grad_input, None, None
        return grad_input, None, None, None, None


class _AllToAllWait(torch.autograd.Function):
    """Wait for the launch; in backward, launch the reverse exchange of the gradient."""

    @staticmethod
    def forward(ctx, output_ND: Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup,
                box: _Box) -> Tensor:
        ctx.send, ctx.recv, ctx.group, ctx.box = send, recv, group, box
        box.work.wait()
        box.work = None
        return output_ND.view_as(output_ND)

    @staticmethod
    def backward(ctx, grad_ND: Tensor):
        box = ctx.box
        box.grad_input, box.grad_work = _launch(grad_ND, ctx.recv, ctx.send, ctx.group)
        return grad_ND, None, None, None, None


@dataclass(frozen=True, slots=True)
class Reorder:
    """Put consecutive pieces of ``sizes`` rows in ``order``."""

    sizes: list[int]
    order: list[int]

    def inverse(self) -> Reorder:
        return Reorder([self.sizes[i] for i in self.order], inverse_order(self.order))


@dataclass(frozen=True, slots=True)
class AllToAll:
    """``all_to_all_single`` over ``group`` (a process group or a :class:`Transport`) with host split sizes."""

    group: dist.ProcessGroup | Transport
    send: list[int]
    recv: list[int]

    def inverse(self) -> AllToAll:
        return AllToAll(self.group, self.recv, self.send)


@dataclass(frozen=True, slots=True)
class ExchangePlan:
    """Ops that take a rank's rows (sorted by global expert) to its experts' rows ([expert][source])."""

    ops: tuple[Reorder | AllToAll, ...]
    rows_per_local_expert: list[int]
    """Rows each local expert receives (host integers)."""

    def inverse_ops(self) -> tuple[Reorder | AllToAll, ...]:
        """The combine: the same ops inverted, in reverse order."""
        return tuple(op.inverse() for op in reversed(self.ops))


def _local_expert_reorder(counts_WE: list[list[int]], rank: int, per_rank: int) -> tuple[Reorder, list[int]]:
    """[source][local expert] -> [local expert][source], and the rows of each local expert."""
    world = len(counts_WE)
    mine = [[counts_WE[s][rank * per_rank + j] for j in range(per_rank)] for s in range(world)]
    sizes = [mine[s][j] for s in range(world) for j in range(per_rank)]
    order = [s * per_rank + j for j in range(per_rank) for s in range(world)]
    return Reorder(sizes, order), [sum(mine[s][j] for s in range(world)) for j in range(per_rank)]


def _rank_rows(counts_WE: list[list[int]], per_rank: int) -> list[list[int]]:
    """S[s][d]: rows rank s sends to rank d."""
    return [[sum(row[d * per_rank:(d + 1) * per_rank]) for d in range(len(counts_WE))] for row in counts_WE]


def flat_plan(counts_WE: list[list[int]], rank: int, group: dist.ProcessGroup) -> ExchangePlan:
    """One all-to-all over the expert-parallel group.

    Args:
        counts_WE: rows each rank sends to each global expert (the all-gathered counts).
        rank: this rank's index in the group.
        group: the expert-parallel group.

    Returns:
        The :class:`ExchangePlan`.
    """
    world = len(counts_WE)
    per_rank = len(counts_WE[0]) // world
    rows = _rank_rows(counts_WE, per_rank)
    reorder, rows_per_expert = _local_expert_reorder(counts_WE, rank, per_rank)
    exchange = AllToAll(group, rows[rank], [rows[s][rank] for s in range(world)])
    return ExchangePlan((exchange, reorder), rows_per_expert)


def hierarchical_plan(counts_WE: list[list[int]], rank: int, ranks_per_node: int, intra: dist.ProcessGroup,
                      inter: dist.ProcessGroup) -> ExchangePlan:
    """Intra-node all-to-all, then inter-node all-to-all among ranks of the same local index.

    Args:
        counts_WE: rows each rank sends to each global expert.
        rank: this rank's index in the expert-parallel group (node = rank // L, local = rank % L).
        ranks_per_node: L; must divide W.
        intra: group of the L ranks of this node, in local order.
        inter: group of the ranks with this local index on every node, in node order.

    Returns:
        The :class:`ExchangePlan`; its result equals :func:`flat_plan`'s.
    """
    world, lpn = len(counts_WE), ranks_per_node
    nodes, per_rank = world // lpn, len(counts_WE[0]) // world
    node, local = divmod(rank, lpn)
    rows = _rank_rows(counts_WE, per_rank)
    # 1. my pieces by destination (node2, local2) -> (local2, node2), sent to local rank local2.
    by_local = Reorder(rows[rank], [n2 * lpn + l2 for l2 in range(lpn) for n2 in range(nodes)])
    intra_send = [sum(rows[rank][n2 * lpn + l2] for n2 in range(nodes)) for l2 in range(lpn)]
    intra_recv = [sum(rows[node * lpn + ls][n2 * lpn + local] for n2 in range(nodes)) for ls in range(lpn)]
    # 2. received pieces (source local ls, destination node n2) -> (n2, ls), sent to node n2.
    arrived = [rows[node * lpn + ls][n2 * lpn + local] for ls in range(lpn) for n2 in range(nodes)]
    by_node = Reorder(arrived, [ls * nodes + n2 for n2 in range(nodes) for ls in range(lpn)])
    inter_send = [sum(rows[node * lpn + ls][n2 * lpn + local] for ls in range(lpn)) for n2 in range(nodes)]
    inter_recv = [sum(rows[ns * lpn + ls][rank] for ls in range(lpn)) for ns in range(nodes)]
    # 3. arrival order is (source node, source local) = source rank: the flat layout.
    reorder, rows_per_expert = _local_expert_reorder(counts_WE, rank, per_rank)
    ops = (by_local, AllToAll(intra, intra_send, intra_recv), by_node, AllToAll(inter, inter_send, inter_recv),
           reorder)
    return ExchangePlan(ops, rows_per_expert)


@dataclass(slots=True)
class Exchange:
    """One exchange in progress: runs its ops, leaving at most one all-to-all in flight.

    ``advance()`` completes the in-flight all-to-all (if any) and runs ops up to and including the
    next launch; ``finish()`` runs everything and returns the rows.
    """

    ops: tuple[Reorder | AllToAll, ...]
    rows_ND: Tensor
    _next: int = 0
    _pending: tuple | None = field(default=None)

    def _complete(self) -> None:
        if self._pending is not None:
            op, box = self._pending
            self.rows_ND = _AllToAllWait.apply(self.rows_ND, op.send, op.recv, op.group, box)
            self._pending = None

    def advance(self) -> None:
        """Finish the in-flight all-to-all, then run ops until the next one is launched."""
        self._complete()
        while self._next < len(self.ops):
            op = self.ops[self._next]
            self._next += 1
            if isinstance(op, Reorder):
                self.rows_ND = reorder_chunks(self.rows_ND, op.sizes, op.order)
                continue
            box = _Box()
            self.rows_ND = _AllToAllStart.apply(self.rows_ND, op.send, op.recv, op.group, box)
            self._pending = (op, box)
            return

    def finish(self) -> Tensor:
        """Run the remaining ops and return the exchanged rows."""
        while self._pending is not None or self._next < len(self.ops):
            self.advance()
        return self.rows_ND
