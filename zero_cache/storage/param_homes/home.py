"""Where a chunk's params live between uses: its **home**, one class per kind (device, host here; NVMe in
:mod:`zero_cache.storage.param_homes.nvme`), registered by tier name in :mod:`zero_cache.storage.param_homes.registry`.

Replicated params live on the device for good (:class:`DeviceHome`). Gathered params (sharded over
ranks, or streamed on one rank) keep this rank's shard of each collective group at a home the plan
names; a group is made whole on the device only while it is used (:mod:`zero_cache.runtime.gathered`). A
step asks each home five things, and nothing else in the runtime knows which kind it is:

* ``gather``: make the group whole in a device buffer (its slot among the live groups);
* ``write_gradient``: take the group's reduced gradient, which replaces the params in the home
  until the step regenerates them from the fp32 masters (one micro-batch per step);
* ``fetch_gradient`` / ``update_buffer``: where the host's Adam reads the gradient and writes the
  new params in the compute dtype;
* ``store_params``: put those new params home (a host->device copy, nothing when the update ran in
  the home itself, or a disk write).

What a home costs (host bytes, disk bytes, disk bytes moved per step, whether it streams, ...) is the planner's
to know: a class takes its answers from :mod:`zero_cache.plan.home_costs` (``costs``), the one place they are written.
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar, Iterator

import torch

from zero_cache.plan.home_costs import HOME_COSTS, HomeCosts
from zero_cache.plan.tier_names import DEVICE, HOST, TierName
from zero_cache.storage.tiers import BufferPool

_COST_FLAGS = ("name", "streams", "in_host_memory", "stages_updates", "device_steppable")


class ParamHome:
    """A kind of home for param chunks (shards): how a step reaches it, and (from ``costs``) what it costs.

    Args:
        tiers: the store's tiers by name (a home allocates from the one it is named after).
        numel: elements of one shard.
        dtype: the compute dtype.
        num_shards: shards the plan puts in homes of this kind (a home that reserves room up front uses it).
    """

    costs: ClassVar[HomeCosts]
    """What the planner prices a home of this kind at (:mod:`zero_cache.plan.home_costs`); its flags below are copied
    from it when the class is defined, so the runtime and the plan read one answer."""
    name: ClassVar[TierName]
    streams: ClassVar[bool]
    """Off the device: copied in on use (:attr:`HomeCosts.streams <zero_cache.plan.home_costs.HomeCosts.streams>`)."""
    in_host_memory: ClassVar[bool]
    """The shard is pinned host memory, updated there in place (``HomeCosts.in_host_memory``)."""
    stages_updates: ClassVar[bool]
    """Host updates go through the updater's staging buffers (``HomeCosts.stages_updates``)."""
    device_steppable: ClassVar[bool]
    """Host-held optimizer groups of its chunks may be stepped on the device (``HomeCosts.device_steppable``)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "costs" in cls.__dict__:
            for flag in _COST_FLAGS:
                setattr(cls, flag, getattr(cls.costs, flag))

    # ------------------------------------------------------------------ cost (the planner's questions, from costs)
    @classmethod
    def host_bytes(cls, shards: int, shard_bytes: int) -> int:
        """Host bytes that ``shards`` homes of this kind take (buffers included)."""
        return cls.costs.host_bytes(shards, shard_bytes)

    @classmethod
    def disk_bytes(cls, shards: int, shard_bytes: int) -> int:
        """Swap-file bytes that ``shards`` homes of this kind take."""
        return cls.costs.disk_bytes(shards, shard_bytes)

    @classmethod
    def disk_bytes_per_step(cls, shards: int, owned: int, shard_bytes: int, gathers_per_step: float,
                            waiting: int = 0) -> int:
        """Disk bytes one step moves for ``shards`` homes (:meth:`HomeCosts.disk_bytes_per_step
        <zero_cache.plan.home_costs.HomeCosts.disk_bytes_per_step>`)."""
        return cls.costs.disk_bytes_per_step(shards, owned, shard_bytes, gathers_per_step, waiting)

    @classmethod
    def gradients_to_disk_per_step(cls, waiting: int) -> int:
        """Of ``waiting`` gradients (owned chunks updated after backward), how many wait for their update on disk."""
        return cls.costs.gradients_to_disk_per_step(waiting)

    # ------------------------------------------------------------------ the runtime's questions
    def __init__(self, tiers: dict[str, Any], numel: int, dtype: torch.dtype, num_shards: int = 0) -> None:
        self.tiers, self.numel, self.dtype = tiers, numel, dtype

    def allocate(self, group: int) -> torch.Tensor | None:
        """Room for ``group``'s shard, zeroed: its tensor, or None where the home is not addressable memory (a
        file)."""
        return self.tiers[self.name].allocate(self.numel, self.dtype)

    def free(self, group: int, shard: torch.Tensor | None) -> None:
        self.tiers[self.name].free(shard)

    def held_bytes(self) -> dict[str, int]:
        """Tier -> bytes one shard here holds in the tiers' budgets (what moving one here takes, or away frees)."""
        return {self.name: self.numel * torch.empty((), dtype=self.dtype).element_size()}

    def has_room(self) -> bool:
        """Whether :meth:`allocate` would find room for another shard now (a re-plan orders its moves by it)."""
        return all(self.tiers[tier].free_bytes >= num_bytes for tier, num_bytes in self.held_bytes().items())

    @contextlib.contextmanager
    def open(self, group: int, shard: torch.Tensor | None, *, fresh: bool = False,
             write_back: bool = False) -> Iterator[torch.Tensor]:
        """The shard's values, readable and (with ``write_back``) writable for the block; synchronous (setup,
        moves between homes, checkpoints). ``fresh``: its old values are not needed."""
        yield shard

    def gather(self, group: int, shard: torch.Tensor | None, buffer: torch.Tensor, sharding: Any,
               transfers: Any) -> Any:
        """Start making ``group`` whole in the device ``buffer``; returns the work to wait for."""
        raise NotImplementedError

    def reduce_target(self, shard: torch.Tensor | None) -> torch.Tensor | None:
        """Where a reduce-scatter may write the reduced gradient itself (device memory), else None: it stays in
        the bucket and :meth:`write_gradient` takes it home."""
        return None

    def write_gradient(self, group: int, shard: torch.Tensor | None, reduced: torch.Tensor, transfers: Any, *,
                       waits: bool = True) -> Any:
        """Take this rank's reduced gradient slice (on the device) home, over the params; returns its token.
        ``waits``: its update runs after backward (else during backward, from the gradient soon)."""
        raise NotImplementedError

    def fetch_gradient(self, group: int, param_chunk: torch.Tensor | None, pool: BufferPool, transfers: Any, *,
                       written: Any, landed: Any) -> tuple[torch.Tensor, Any]:
        """(host buffer holding the chunk's gradient in the compute dtype, token of its transfer) for the host's
        Adam; ``written``: the compute-stream point after which a gradient in the param chunk is complete,
        ``landed``: :meth:`write_gradient`'s token."""
        buffer = pool.acquire()
        return buffer, transfers.copy(buffer, param_chunk, "d2h", after=written)

    def update_buffer(self, group: int, param_chunk: torch.Tensor | None, pool: BufferPool) -> torch.Tensor:
        """A host buffer for the chunk's new params when none was fetched (a revision, restored masters)."""
        return pool.acquire()

    def give_back(self, buffer: torch.Tensor, pool: BufferPool, in_use_until: Any = None) -> None:
        """Return a buffer of :meth:`fetch_gradient` or :meth:`update_buffer` unused (a deferred or failed update)."""
        pool.release(buffer, in_use_until)

    def store_params(self, group: int, param_chunk: torch.Tensor | None, buffer: torch.Tensor, pool: BufferPool,
                     transfers: Any) -> Any:
        """Put the new params in ``buffer`` home and give the buffer back; returns the device-side event the next
        use of the chunk waits for (None: nothing to wait for on the device)."""
        ready = transfers.copy(param_chunk, buffer, "h2d")
        pool.release(buffer, ready)
        return ready

    def prefetch(self, group: int) -> None:
        """``group`` will be gathered soon (along the recorded trace): start what can start early."""

    def forget_prefetched(self) -> None:
        """Drop what :meth:`prefetch` started (the shards change: a step, a restore)."""

    def trim(self) -> None:
        """Give back the host memory the home holds beside its shards that no shard here needs now (a re-plan moved
        them all out); between steps, with the work in flight finished. Nothing by default."""

    def flush(self) -> None:
        """Wait for the writes in flight (raise a failed one's error)."""

    def close(self) -> None:
        """Free what the home holds outside the tiers' memory (a swap file)."""

    def disk_report(self) -> dict[str, int]:
        """Disk bytes the home holds ("bytes") and has read and written since the last report ("read", "write")."""
        return {}

    def use_timeline(self, timeline: Any) -> None:
        """While a step is traced, the home's disk requests go on the timeline's ``disk`` track."""


class DeviceHome(ParamHome):
    """The shard (or the replicated param chunk) stays in device memory: used in place on one rank, all-gathered
    over several; the device's Adam may update it, and the host's sends its new params back in."""

    costs = HOME_COSTS[DEVICE]

    def gather(self, group: int, shard: torch.Tensor | None, buffer: torch.Tensor, sharding: Any,
               transfers: Any) -> Any:
        return sharding.all_gather(buffer, source=shard)

    def reduce_target(self, shard: torch.Tensor | None) -> torch.Tensor | None:
        return shard

    def write_gradient(self, group: int, shard: torch.Tensor | None, reduced: torch.Tensor, transfers: Any, *,
                       waits: bool = True) -> Any:
        return None  # the reduce-scatter wrote it (reduce_target)


class HostHome(ParamHome):
    """The shard lives in pinned host memory (DeepSpeed's ``offload_param: cpu``): copied in on use, its reduced
    gradient copied home over it, and updated there in place by the host's Adam (it is its own staging buffer)."""

    costs = HOME_COSTS[HOST]

    def gather(self, group: int, shard: torch.Tensor | None, buffer: torch.Tensor, sharding: Any,
               transfers: Any) -> Any:
        return copy_in_and_gather(shard, buffer, sharding, transfers)[1]

    def write_gradient(self, group: int, shard: torch.Tensor | None, reduced: torch.Tensor, transfers: Any, *,
                       waits: bool = True) -> Any:
        return transfers.copy(shard, reduced, "d2h", after=transfers.mark())

    def fetch_gradient(self, group: int, param_chunk: torch.Tensor | None, pool: BufferPool, transfers: Any, *,
                       written: Any, landed: Any) -> tuple[torch.Tensor, Any]:
        return param_chunk, landed  # already home: updated there, in place

    def update_buffer(self, group: int, param_chunk: torch.Tensor | None, pool: BufferPool) -> torch.Tensor:
        return param_chunk

    def give_back(self, buffer: torch.Tensor, pool: BufferPool, in_use_until: Any = None) -> None:
        pass  # the home itself

    def store_params(self, group: int, param_chunk: torch.Tensor | None, buffer: torch.Tensor, pool: BufferPool,
                     transfers: Any) -> Any:
        return None  # updated in place; the next gather copies it in


class _Copied:
    """A host->device copy behind a collective's ``wait()``: orders the caller's stream after it."""

    def __init__(self, event: torch.cuda.Event | None) -> None:
        self.event = event

    def wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream(self.event.device).wait_event(self.event)


def copy_in_and_gather(source: torch.Tensor, buffer: torch.Tensor, sharding: Any, transfers: Any) -> tuple[Any, Any]:
    """This rank's shard copied in from host memory (``source``), then the other ranks' slots gathered behind it;
    returns (the copy's event, the work to wait for).

    The copy waits for the compute stream issued so far: the caching allocator may have handed out memory that
    kernels queued there still read.
    """
    copied = transfers.copy(sharding.mine(buffer), source, "h2d", after=transfers.mark())
    if not sharding.sharded:
        return copied, _Copied(copied)
    if transfers.h2d is None:
        return copied, sharding.all_gather(buffer)
    with torch.cuda.stream(transfers.h2d):  # NCCL's stream then waits for the copy, not for compute
        return copied, sharding.all_gather(buffer)

