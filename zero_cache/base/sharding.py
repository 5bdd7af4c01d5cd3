"""Chunk ownership over data-parallel ranks, and the two collectives that move chunks between them.

Ownership is by whole chunk. Chunks are grouped ``W`` at a time (group ``g`` = chunks ``gW ..
gW+W-1``) in one contiguous buffer of ``W`` slots, and each rank owns one slot of every group: it
keeps that chunk's optimizer group (fp32 master, exp_avg, exp_avg_sq) in whichever tier its own
plan picks. One collective serves a whole group:

* **reduce-scatter** during backward: each rank's gradients (written over its param chunks, or
  into a gradient bucket when micro-batches accumulate) are summed into the owner's slot;
* **all-gather** before the next forward: each owner's updated chunk is copied to every rank.

This is ZeRO-2's partitioning of gradients and optimizer states at chunk granularity, with the
chunk as the bucket. With ``shard_params`` (ZeRO-3) the parameters are partitioned the same way:
a rank keeps only its own slot of each group, the all-gather reads it (``source``) into a group
buffer that lives only while the group is in use (:mod:`zero_cache.runtime.gathered`), and the
reduce-scatter writes the summed gradients into it (``out``). With one rank every chunk is owned
and nothing is communicated.

**Hierarchical** (``hierarchical``, over N hosts of L ranks): each collective runs in two stages, the
host's NVLink first. The reduce-scatter sums within the host (rank ``l`` of a host gets block ``l`` of
L, which holds N slots) and then across hosts among the ranks of the same local index (each gets one
slot of its block); the all-gather runs the other way round. Rank ``(n, l)`` therefore owns slot
``l N + n``, and only 1/L of the bytes crosses the network per rank. On one host it equals the flat
exchange.

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
    hierarchical: bool = False
    """Two-stage collectives, within each host first (needs ``world_size`` a multiple of ``ranks_per_host``)."""
    host_group: dist.ProcessGroup | None = None
    """Hierarchical: the ranks of this host (from :func:`hierarchical_groups`)."""
    peer_group: dist.ProcessGroup | None = None
    """Hierarchical: the ranks of the same local index on every host."""
    side_stream: torch.cuda.Stream | None = None
    """Hierarchical on NCCL: the stream that waits between the two stages (not the compute stream)."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world_size}")
        if self.hierarchical and (self.ranks_per_host < 1 or self.world_size % self.ranks_per_host):
            raise ValueError(f"hierarchical collectives need the {self.world_size} ranks in whole hosts of "
                             f"{self.ranks_per_host}")

    @property
    def num_hosts(self) -> int:
        return self.world_size // self.ranks_per_host if self.hierarchical else 1

    def rank_of_slot(self, slot: int) -> int:
        """The rank that owns slot ``slot`` of every group (flat: the same number)."""
        if not self.hierarchical:
            return slot
        local, host = divmod(slot, self.num_hosts)
        return host * self.ranks_per_host + local

    @property
    def slot(self) -> int:
        """This rank's slot in every group."""
        if not self.hierarchical:
            return self.rank
        host, local = divmod(self.rank, self.ranks_per_host)
        return local * self.num_hosts + host

    @property
    def sharded(self) -> bool:
        return self.world_size > 1

    def owner(self, chunk: int) -> int:
        """The rank that holds ``chunk``'s optimizer group."""
        return self.rank_of_slot(chunk % self.world_size)

    def owns(self, chunk: int) -> bool:
        return self.owner(chunk) == self.rank

    def owned(self, num_chunks: int) -> tuple[int, ...]:
        """This rank's chunks among ``num_chunks``."""
        return tuple(range(self.slot, num_chunks, self.world_size))

    def mine(self, buffer: torch.Tensor) -> torch.Tensor:
        """This rank's slot of a group buffer."""
        return buffer.view(self.world_size, -1)[self.slot]

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

    def reduce_scatter(self, buffer: torch.Tensor, out: torch.Tensor | None = None) -> dist.Work | None:
        """Sum ``buffer`` (one group, ``world_size`` equal slots) over ranks into this rank's slot, async.

        With ``out`` the sum lands there instead (NCCL, flat: directly; otherwise copied from the slot once
        the collective is done, inside ``wait()``).
        """
        if not self.sharded:
            if out is not None:
                out.copy_(self.mine(buffer))
            return None
        if not self.hierarchical:
            work = _reduce_scatter(buffer, self.rank, self.world_size, self.group, out)
        else:
            host, peers = self._stages(buffer)
            work = _Chain([lambda: _reduce_scatter(*host), lambda: _reduce_scatter(*peers)], self.side_stream)
        if out is None or (not self.hierarchical and dist.get_backend(self.group) == "nccl"):
            return work
        return _Then(work, lambda: out.copy_(self.mine(buffer)))

    def all_gather(self, buffer: torch.Tensor, source: torch.Tensor | None = None) -> dist.Work | None:
        """Fill every slot of ``buffer`` (one group) from the rank that owns it, async.

        ``source``: this rank's slot comes from there (sharded params) instead of being in ``buffer`` already.
        """
        if not self.hierarchical:  # (one rank: only the copy from ``source``)
            return _all_gather(buffer, self.rank, self.world_size, self.group, source)
        host, peers = self._stages(buffer)
        return _Chain([lambda: _all_gather(*peers, source), lambda: _all_gather(*host)], self.side_stream)

    def _stages(self, buffer: torch.Tensor) -> tuple[tuple, tuple]:
        """(buffer, this rank's index, ranks, group) of the within-host stage (the whole group buffer, in
        blocks of ``num_hosts`` slots) and of the across-host stage (this rank's block, in slots)."""
        local, host = self.rank % self.ranks_per_host, self.rank // self.ranks_per_host
        block = buffer.view(self.ranks_per_host, -1)[local]
        return (buffer, local, self.ranks_per_host, self.host_group), (block, host, self.num_hosts, self.peer_group)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the ranks in place (synchronous)."""
        if self.sharded:
            dist.all_reduce(tensor, group=self.group)


def hierarchical_groups(world_size: int, ranks_per_host: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(this host's group, this local index's group across hosts); every rank must call it (collective).

    Ranks are numbered host by host, as torchrun and the deepspeed launcher do.
    """
    rank, hosts = dist.get_rank(), world_size // ranks_per_host
    mine = {}
    for host in range(hosts):  # new_group is collective: every rank creates every group, in the same order
        group = dist.new_group(list(range(host * ranks_per_host, (host + 1) * ranks_per_host)))
        if rank // ranks_per_host == host:
            mine["host"] = group
    for local in range(ranks_per_host):
        group = dist.new_group(list(range(local, world_size, ranks_per_host)))
        if rank % ranks_per_host == local:
            mine["peer"] = group
    return mine["host"], mine["peer"]


def _reduce_scatter(buffer: torch.Tensor, index: int, size: int, group: dist.ProcessGroup | None,
                    out: torch.Tensor | None = None) -> dist.Work | None:
    """Sum ``buffer`` (``size`` slots) over ``group`` into slot ``index`` (or into ``out``, NCCL only), async."""
    if size == 1:
        return None
    if dist.get_backend(group) == "nccl":
        target = buffer.view(size, -1)[index] if out is None else out
        return dist.reduce_scatter_tensor(target, buffer, group=group, async_op=True)
    return dist.all_reduce(buffer, group=group, async_op=True)  # gloo has no in-place reduce-scatter


def _all_gather(buffer: torch.Tensor, index: int, size: int, group: dist.ProcessGroup | None,
                source: torch.Tensor | None = None) -> dist.Work | None:
    """Fill every slot of ``buffer`` (``size`` slots) from the rank of that index in ``group``, async; this
    rank's slot from ``source`` when given."""
    slots = list(buffer.view(size, -1).unbind())
    if size == 1:
        if source is not None:
            slots[index].copy_(source)
        return None
    if dist.get_backend(group) == "nccl":
        return dist.all_gather_into_tensor(buffer, slots[index] if source is None else source, group=group,
                                           async_op=True)
    return dist.all_gather(slots, (slots[index] if source is None else source).clone(), group=group, async_op=True)


class _Chain:
    """Two collectives in sequence behind one ``wait()``: the second is issued once the first is done.

    With a side stream (NCCL) the first stage is waited for there, so the compute stream is not held
    up between the stages; ``wait()`` orders the caller's stream after the second.
    """

    def __init__(self, stages: list, stream: torch.cuda.Stream | None) -> None:
        self._stages = stages
        self._stream = stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())  # the buffer's producer first
            with torch.cuda.stream(self._stream):
                self._last = self._run()
        else:
            self._last = self._run()

    def _run(self) -> dist.Work | None:
        last = None
        for stage in self._stages:
            if last is not None:
                last.wait()
            last = stage()
        return last

    def wait(self) -> None:
        if self._last is not None:
            self._last.wait()
        if self._stream is not None:
            torch.cuda.current_stream().wait_stream(self._stream)


class _Then:
    """A collective followed by a step that needs its result, run inside ``wait()``."""

    def __init__(self, work: dist.Work | None, then) -> None:
        self._work, self._then = work, then

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
        self._then()
