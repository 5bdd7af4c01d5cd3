"""Token dispatch and combine by sorting and indexing (no one-hot [T, E, C] tensors).

Shape legend: T = tokens on this rank, D = model dim, E = experts (all ranks), K = top_k,
R = T * K routes, C = token chunks (for overlap), N = kept routes of one chunk (rows sent to experts).

GShard's dense dispatch builds a [T, E, C] one-hot mask and contracts it with [T, D] (cost
T * E * C * D). Here the kept routes are sorted by (chunk, expert) once with a stable argsort, the
rows are gathered with ``index_select`` (T * K * D) and the results are scattered back with
``index_add_`` weighted by the gate (Megatron's "permute / unpermute", Tutel's fast dispatcher).

Rows of one expert keep token order, so the layout is deterministic, and every dispatch of the
same routing gives the same bytes. The row counts are known on the device without a sync; the
layer copies them to the host once per forward (all-to-all split sizes are host integers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moe.gate import Routing, count_per_bin


@dataclass(frozen=True, slots=True)
class SortedRoutes:
    """Kept routes sorted by chunk, then expert, then token; dropped routes at the end of each chunk."""

    order_R: Tensor
    """int64 [R]: route indices (token-major: route r is token r // K, choice r % K) in dispatch order."""
    rows_CE: Tensor
    """int64 [C, E]: kept routes of each chunk per expert, on the device."""
    top_k: int
    """Routes per token."""


@dataclass(frozen=True, slots=True)
class ChunkRows:
    """The rows one chunk sends to the experts."""

    token_N: Tensor
    """int64 [N]: source token of each row, grouped by expert."""
    weight_N: Tensor
    """fp32 [N]: gate weight each row's expert output is scaled by."""


def chunk_bounds(num_tokens: int, num_chunks: int) -> list[tuple[int, int]]:
    """Contiguous token ranges [start, stop) of ``num_chunks`` nearly equal chunks (some may be empty)."""
    step = -(-num_tokens // num_chunks) if num_tokens else 0
    return [(min(c * step, num_tokens), min((c + 1) * step, num_tokens)) for c in range(num_chunks)]


def sort_routes(routing: Routing, num_experts: int, num_chunks: int = 1) -> SortedRoutes:
    """Sort the kept routes by (chunk, expert, token) with one stable argsort; no host sync.

    Args:
        routing: the gate's decision.
        num_experts: E.
        num_chunks: token chunks; chunk c holds the tokens of ``chunk_bounds(T, C)[c]``.

    Returns:
        The :class:`SortedRoutes`.
    """
    num_tokens, top_k = routing.expert_TK.shape
    expert_R = routing.expert_TK.reshape(-1)
    kept_R = routing.kept_TK.reshape(-1)
    chunk_T = torch.zeros(num_tokens, dtype=torch.int64, device=expert_R.device)
    for c, (start, _) in enumerate(chunk_bounds(num_tokens, num_chunks)[1:], start=1):
        chunk_T[start:] = c
    chunk_R = chunk_T.repeat_interleave(top_k)
    slot_R = torch.where(kept_R, expert_R, torch.full_like(expert_R, num_experts))  # E = "dropped"
    key_R = chunk_R * (num_experts + 1) + slot_R
    order_R = torch.argsort(key_R, stable=True)
    rows_CE = count_per_bin(key_R, num_chunks * (num_experts + 1)).view(num_chunks, num_experts + 1)
    return SortedRoutes(order_R=order_R, rows_CE=rows_CE[:, :num_experts], top_k=top_k)


def chunk_rows(sorted_routes: SortedRoutes, weight_TK: Tensor, num_tokens: int, rows_CE: list[list[int]],
               chunk: int) -> ChunkRows:
    """The dispatched rows of one chunk.

    Args:
        sorted_routes: from :func:`sort_routes`.
        weight_TK: the routing's combine weights.
        num_tokens: T.
        rows_CE: ``sorted_routes.rows_CE`` copied to the host.
        chunk: which chunk.

    Returns:
        Token index and gate weight of each row, grouped by expert.
    """
    top_k = sorted_routes.top_k
    bounds = chunk_bounds(num_tokens, len(rows_CE))
    start = bounds[chunk][0] * top_k  # every route of the earlier chunks (kept or dropped) comes first
    route_N = sorted_routes.order_R[start:start + sum(rows_CE[chunk])]
    return ChunkRows(token_N=route_N // top_k, weight_N=weight_TK.reshape(-1).index_select(0, route_N))


def permute(x_TD: Tensor, rows: ChunkRows) -> Tensor:
    """Gather the rows sent to the experts: [T, D] -> [N, D] grouped by expert."""
    return x_TD.index_select(0, rows.token_N)


def combine(y_ND: Tensor, token_N: Tensor, weight_N: Tensor, num_tokens: int) -> Tensor:
    """Weighted sum of each token's expert outputs: [N, D] -> [T, D].

    Accumulates in fp32 (a bf16 sum of k routes loses precision) and returns ``y_ND.dtype``.
    Tokens all of whose routes were dropped get zeros (the residual connection carries them).
    """
    out_TD = torch.zeros(num_tokens, y_ND.shape[-1], dtype=torch.float32, device=y_ND.device)
    out_TD = out_TD.index_add(0, token_N, y_ND.float() * weight_N.unsqueeze(1))
    return out_TD.to(y_ND.dtype)


def reorder_chunks(x_ND: Tensor, sizes: list[int], order: list[int]) -> Tensor:
    """Concatenate the pieces ``x_ND.split(sizes)`` in ``order`` (differentiable; one copy).

    Args:
        x_ND: rows made of consecutive pieces.
        sizes: rows of each piece, in their current order.
        order: index of the piece to put at each position.

    Returns:
        The reordered rows.
    """
    if order == list(range(len(sizes))):
        return x_ND
    pieces = x_ND.split(sizes)
    return torch.cat([pieces[i] for i in order]) if pieces else x_ND


def inverse_order(order: list[int]) -> list[int]:
    """The permutation that undoes ``order``."""
    inverse = [0] * len(order)
    for position, piece in enumerate(order):
        inverse[piece] = position
    return inverse
