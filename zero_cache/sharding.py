"""Chunk ownership over data-parallel ranks, and the two collectives that move chunks between them.

Ownership is by whole chunk: rank ``r`` of ``W`` owns chunk ``c`` when ``c % W == r``, and keeps
that chunk's optimizer group (fp32 master, exp_avg, exp_avg_sq) in whichever tier its own plan
picks. Chunks are grouped ``W`` at a time (group ``g`` = chunks ``gW .. gW+W-1``, one per rank) in
one contiguous buffer, so one collective serves a whole group:

* **reduce-scatter** after backward: each rank's gradients (written over its param chunks) are
  summed into the owner's chunk of the group;
* **all-gather** before the next forward: each owner's updated chunk is copied to every rank.

This is ZeRO-2's partitioning of gradients and optimizer states at chunk granularity (the
parameters themselves stay replicated on every rank's device), with the chunk as the bucket.
With one rank every chunk is owned and nothing is communicated.

On NCCL both collectives run in place in the group buffer (NCCL's in-place rule: the rank's
slice sits at ``rank * count`` of the full buffer) and asynchronously on NCCL's stream; the caller
orders its compute stream after them with ``Work.wait()``. Gloo lacks an in-place
reduce-scatter, so there the whole group is all-reduced and each rank keeps its slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class Sharding:
    """This rank's place among the ranks that share chunk ownership."""

    rank: int = 0
    """Index of this rank in ``group``."""
    world_size: int = 1
    """Ranks sharing the chunks."""
    group: dist.ProcessGroup | None = None
    """Their process group (None: the default group, or no communication when ``world_size`` is 1)."""
    ranks_per_host: int = 1
    """Ranks sharing this host's RAM: an "auto" host budget is split between them."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world_size}")

    @property
    def sharded(self) -> bool:
        return self.world_size > 1

    def owner(self, chunk: int) -> int:
        """The rank that holds ``chunk``'s optimizer group."""
        return chunk % self.world_size

    def owns(self, chunk: int) -> bool:
        return self.owner(chunk) == self.rank

    def owned(self, num_chunks: int) -> tuple[int, ...]:
        """This rank's chunks among ``num_chunks``."""
        return tuple(range(self.rank, num_chunks, self.world_size))

    def group_of(self, chunk: int) -> int:
        """The collective group (``world_size`` consecutive chunks) ``chunk`` belongs to."""
        return chunk // self.world_size

    def group_chunks(self, group: int, num_chunks: int) -> range:
        """The real (not padding) chunks of a collective group."""
        return range(group * self.world_size, min(num_chunks, (group + 1) * self.world_size))

    def num_groups(self, num_chunks: int) -> int:
        return -(-num_chunks // self.world_size)

    def padded_chunks(self, num_chunks: int) -> int:
        """Chunks allocated so every group is whole (the padding chunks stay zero)."""
        return self.num_groups(num_chunks) * self.world_size

    # ------------------------------------------------------------------ collectives
    def _is_nccl(self) -> bool:
        return dist.get_backend(self.group) == "nccl"

    def reduce_scatter(self, buffer: torch.Tensor) -> dist.Work | None:
        """Sum ``buffer`` (one group, ``world_size`` equal slices) over ranks into this rank's slice, async."""
        if not self.sharded:
            return None
        if self._is_nccl():
            mine = buffer.view(self.world_size, -1)[self.rank]
            return dist.reduce_scatter_tensor(mine, buffer, group=self.group, async_op=True)
        return dist.all_reduce(buffer, group=self.group, async_op=True)

    def all_gather(self, buffer: torch.Tensor) -> dist.Work | None:
        """Fill every slice of ``buffer`` (one group) from the rank that owns it, async."""
        if not self.sharded:
            return None
        slices = list(buffer.view(self.world_size, -1).unbind())
        if self._is_nccl():
            return dist.all_gather_into_tensor(buffer, slices[self.rank], group=self.group, async_op=True)
        return dist.all_gather(slices, slices[self.rank].clone(), group=self.group, async_op=True)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the ranks in place (synchronous)."""
        if self.sharded:
            dist.all_reduce(tensor, group=self.group)
