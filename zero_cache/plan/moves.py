"""The order of a re-plan's moves between tiers (pure logic).

A re-plan (``ChunkStore.apply_plan``) moves param shards between homes and optimizer groups between tiers. The
plan fits once every move is made, but a move allocates its new place before it frees its old one, so the order
matters. A group leaving the device for a full host must wait for one leaving the host for the disk. When a
device<->host swap shares the host's last room with a shard, the swap's half must take that room first. So each
move goes when its new place has room, and among those that could go, the one after which the most waiting moves
fit goes first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence


@dataclass(frozen=True, slots=True, eq=False)
class Move:
    """One shard or group to move: what its new place takes and its old place gives back, per budgeted tier (each
    move is itself: compared and hashed by identity)."""

    kind: str
    """"shard" or "group"."""
    index: int
    """The collective group (a shard) or the chunk (an optimizer group)."""
    needs: Mapping[str, int]
    """Tier -> bytes its new place takes."""
    frees: Mapping[str, int]
    """Tier -> bytes its old place gives back."""


def fits(needs: Mapping[str, int], free: Mapping[str, int]) -> bool:
    """Whether ``needs`` (tier -> bytes) fits in ``free`` (tier -> bytes free)."""
    return all(free.get(tier, 0) >= num_bytes for tier, num_bytes in needs.items())


def next_move(pending: Sequence[Move], free: Mapping[str, int], ready: Callable[[Move], bool]) -> Move:
    """The move to make now.

    Args:
        pending: the moves still to make, in order of preference.
        free: tier -> bytes free now.
        ready: whether a move's new place has room now (the tiers' own answer, which may know more than
            ``needs``: a home's swap file).

    Returns:
        Of the ready moves, the one after which the most of the others fit, the first among equals. Where none
        is ready, the first pending move: its allocation raises with the tier that is short.
    """
    movable = [move for move in pending if ready(move)]
    if not movable:
        return pending[0]
    waiting = [move for move in pending if move not in movable]

    def unblocks(move: Move) -> int:
        after = dict(free)
        for tier, num_bytes in move.frees.items():
            after[tier] = after.get(tier, 0) + num_bytes
        for tier, num_bytes in move.needs.items():
            after[tier] = after.get(tier, 0) - num_bytes
        return sum(fits(other.needs, after) for other in waiting)

    return max(movable, key=unblocks)  # (max keeps the first of equals)
