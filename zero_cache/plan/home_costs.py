"""What a param home costs, for the planner: one frozen dataclass per kind of home (pure: no tensors).

The planner asks a kind of home (:mod:`zero_cache.storage.param_homes.registry`: the device, pinned host memory, NVMe)
the same few questions: does a shard there stream onto the device on use, is it pinned host memory the host's Adam
updates in place, do its updates go through the staging buffers, may its optimizer groups be stepped on the device, and
how many host bytes, disk bytes and disk bytes per step ``shards`` of them take (PCIe bytes are the same for every home
off the device: :mod:`zero_cache.plan.step_cost`). The answers live here and only here: the runtime home classes take
theirs from :data:`HOME_COSTS` (``ParamHome.costs``), so what the plan priced is what the runtime does, and the
planner never imports a runtime module (``tests/unit/test_layering.py`` imports it with torch hidden).

A new kind of home is one entry here and one runtime class in the registry
(:data:`zero_cache.storage.param_homes.registry.HOME_CLASSES`).
"""

from __future__ import annotations

from dataclasses import dataclass

from zero_cache.plan.tier_names import DEVICE, HOST, NVME, TierName

DISK_BLOCK_BYTES = 4096
"""Swap slots and bounce buffers are whole blocks of this size (O_DIRECT; ``zero_cache.storage.nvme.ALIGN_BYTES``)."""

NVME_STAGING_BUFFERS = 8
"""Pinned buffers of one shard each through which NVMe homes are read and written: the host worker holds up to
three (the update's gradient, the next update's, a revision's output), the training thread one (a gather or a
gradient arriving), and the rest (:data:`NVME_HELD`) are held between calls."""
NVME_HELD = NVME_STAGING_BUFFERS - 4
"""Buffers held between calls: :data:`NVME_READS_AHEAD` reads started ahead and :data:`NVME_HELD_GRADIENTS` gradients
waiting for their update after backward, each kind in its own share (neither drops the other for room, so what a
step moves does not depend on timing, and the plan counts it: :meth:`NvmeCosts.gradients_to_disk_per_step`). A
gradient that an update during backward takes comes on top: it is the worker's next input, and while the worker
lags, the training thread waits for a buffer rather than send that gradient to disk and back."""
NVME_READS_AHEAD = 2
"""Reads started ahead (``NvmeHome.prefetch``): the slots of the next window beyond the groups being gathered,
as wide as the default ``prefetch_depth`` (2)."""
NVME_HELD_GRADIENTS = NVME_HELD - NVME_READS_AHEAD
"""Gradients waiting in buffers for their update after backward (the last backward writes, which the step updates
first); the oldest beyond them waits in its slot on disk."""


def align_up(num_bytes: int) -> int:
    """``num_bytes`` rounded up to whole disk blocks."""
    return -(-num_bytes // DISK_BLOCK_BYTES) * DISK_BLOCK_BYTES


@dataclass(frozen=True, slots=True)
class HomeCosts:
    """A kind of param home as the planner sees it. The defaults (and the methods' zeros) are a home that takes no
    host or disk bytes; each kind overrides what differs."""

    name: TierName
    """The tier it is named after (the plan's ``param_home`` entries)."""
    streams: bool = True
    """Off the device: copied in on use (its gathers cost PCIe bytes each time)."""
    in_host_memory: bool = False
    """The shard is pinned host memory: the host's Adam updates it in place, and a device step reads its gradient
    from there and writes its params back there (:mod:`zero_cache.optim.device_steps`)."""
    stages_updates: bool = True
    """Host updates of its chunks go through the updater's staging buffers (planned with the host's bytes)."""
    device_steppable: bool = True
    """Its chunks' host-held optimizer groups may be stepped on the device after backward."""
    on_disk: bool = False
    """The shard lives in a swap file (ties between placements of equal cost go to fewer of these)."""

    def host_bytes(self, shards: int, shard_bytes: int) -> int:
        """Host bytes that ``shards`` homes of this kind take (buffers included)."""
        return 0

    def disk_bytes(self, shards: int, shard_bytes: int) -> int:
        """Swap-file bytes that ``shards`` homes of this kind take."""
        return 0

    def disk_bytes_per_step(self, shards: int, owned: int, shard_bytes: int, gathers_per_step: float,
                            waiting: int = 0) -> int:
        """Disk bytes one step moves for ``shards`` homes, ``owned`` of them updated by this rank, ``waiting`` of
        those after backward (their gradients wait for the step: :meth:`gradients_to_disk_per_step`)."""
        return 0

    def gradients_to_disk_per_step(self, waiting: int) -> int:
        """Of ``waiting`` gradients (owned chunks updated after backward), how many wait for their update on disk."""
        return 0


@dataclass(frozen=True, slots=True)
class DeviceCosts(HomeCosts):
    """The shard stays in device memory: used in place (one rank) or all-gathered; no host or disk bytes."""

    name: TierName = DEVICE
    streams: bool = False


@dataclass(frozen=True, slots=True)
class HostCosts(HomeCosts):
    """The shard lives in pinned host memory, its own staging buffer: the host's Adam updates it in place."""

    name: TierName = HOST
    in_host_memory: bool = True
    stages_updates: bool = False

    def host_bytes(self, shards: int, shard_bytes: int) -> int:
        return shards * shard_bytes


@dataclass(frozen=True, slots=True)
class NvmeCosts(HomeCosts):
    """The shard lives in a slot of a swap file, read and written through :data:`NVME_STAGING_BUFFERS` pinned
    buffers: per step a read per gather and a write per updated shard, plus a write and a read per gradient that
    waited on disk (:meth:`gradients_to_disk_per_step`)."""

    name: TierName = NVME
    stages_updates: bool = False
    device_steppable: bool = False
    on_disk: bool = True

    def host_bytes(self, shards: int, shard_bytes: int) -> int:
        return NVME_STAGING_BUFFERS * (align_up(shard_bytes) + DISK_BLOCK_BYTES) if shards else 0

    def disk_bytes(self, shards: int, shard_bytes: int) -> int:
        return shards * align_up(shard_bytes)

    def disk_bytes_per_step(self, shards: int, owned: int, shard_bytes: int, gathers_per_step: float,
                            waiting: int = 0) -> int:
        return int((shards * gathers_per_step + owned + 2 * self.gradients_to_disk_per_step(waiting))
                   * align_up(shard_bytes))

    def gradients_to_disk_per_step(self, waiting: int) -> int:
        return max(0, waiting - NVME_HELD_GRADIENTS)


HOME_COSTS: dict[str, HomeCosts] = {costs.name: costs for costs in (DeviceCosts(), HostCosts(), NvmeCosts())}
"""The kinds of param home by tier name: what each costs."""

OFF_DEVICE_FILL_ORDER: tuple[TierName, ...] = (HOST, NVME)
"""Homes off the device in the order the search fills them with the streamed shards: the groups the next forward
needs first go to the first (host-homed groups may be stepped on the device), the rest to the last of them that
the config permits."""


def home_costs(name: str) -> HomeCosts:
    """What a home of tier ``name`` costs (the plan's ``param_home`` entries)."""
    return HOME_COSTS[name]
