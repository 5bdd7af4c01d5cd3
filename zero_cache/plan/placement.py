"""What the planner decides with, and what it decides (plain frozen dataclasses; :mod:`zero_cache.plan.planner` makes
them): :class:`PlanInputs`, :class:`Plan`, and :class:`PlanError` when the model states do not fit."""

from __future__ import annotations

from dataclasses import dataclass

from zero_cache.plan.home_costs import DISK_BLOCK_BYTES, align_up, home_costs
from zero_cache.plan.state_costs import STAGING_BUFFERS, SWAP_BUFFERS
from zero_cache.plan.step_cost import NOMINAL_RATES, NUM_STATE_FIELDS, STATE_BYTES_PER_ELEMENT, Rates, StepTraffic
from zero_cache.plan.tier_names import DEVICE, HOST, NVME, REMOTE
from zero_cache.plan.units import format_bytes
from zero_cache.plan.working_set import WorkingSet

DEVICE_MARGIN_FRACTION = 0.03
"""Device budget kept free for allocator fragmentation and transients."""

_HOME_WORDS = {HOST: "the host"}
"""How the summary names a home where its tier's name is not the words (the others: their name)."""


class PlanError(ValueError):
    """The model states do not fit in the tiers; the message gives the shortfall per tier."""


@dataclass(frozen=True, slots=True)
class PlanInputs:
    """What the planner knows about one run."""

    num_chunks: int
    """Chunks in the layout."""
    chunk_numel: int
    """Elements per chunk."""
    param_bytes_per_element: int
    """2 for bf16/fp16 compute, 4 for fp32."""
    device_budget_bytes: int
    """Device bytes ZeRO-Cache may use, activations included."""
    host_budget_bytes: int
    """Host bytes ZeRO-Cache may use (pinned)."""
    trace: tuple[int, ...] = ()
    """Chunk accesses of one iteration in order (forward, then backward); empty before warm-up."""
    activation_reserve_bytes: int = 0
    """Device bytes held back for what ZeRO-Cache does not own (activations, workspace): the config's
    ``activation_memory`` (or its "auto" guess) before the warm-up, the peak it measured after."""
    margin_fraction: float = DEVICE_MARGIN_FRACTION
    """Device budget kept free for allocator fragmentation and transients."""
    grad_bytes_per_element: int = 4
    """The gradient accumulator's bytes per element, in the state dtype (4 in fp32, 2 in bf16); 0 when
    single-micro-batch gradients are written into the param chunk."""
    state_bytes_per_element: int = STATE_BYTES_PER_ELEMENT
    """An optimizer group's master and moments per element: 12 in fp32, 6 in bf16
    (:func:`~zero_cache.plan.step_cost.state_bytes_per_element`)."""
    staging_buffers: int = STAGING_BUFFERS
    """Pinned param-chunk-sized transfer buffers on the host (when any optimizer group is there)."""
    nvme_budget_bytes: int = 0
    """Bytes the NVMe tier may take; 0 = no NVMe tier."""
    nvme_path_set: bool = False
    """``zero_cache.nvme_path`` is set (its budget may still be 0: a disk too small for "auto"'s margin)."""
    swap_buffers: int = SWAP_BUFFERS
    """Pinned bounce buffers of one swap slot each (when any optimizer group is on NVMe)."""
    owned: tuple[int, ...] | None = None
    """Chunks whose optimizer groups this rank holds (data-parallel sharding); None = all of them."""
    padding_chunks: int = 0
    """Zero param chunks that complete the last collective group (sharding)."""
    gradient_buckets: int = 0
    """Gradient buckets wanted on the device (each a group of ``group_size`` param chunks), from which sharded or
    gathered params reduce; 0 = none. Fewer are planned where they do not fit (:mod:`zero_cache.plan.working_set`)."""
    param_chunks_held: int | None = None
    """Param chunks this rank stores: None = all of them and the padding (replicated params, resident), or
    one per collective group (gathered params: its shards, each at home on the device or the host)."""
    group_size: int = 1
    """Chunks per collective group (the data-parallel world size; 1 when params stream on one rank)."""
    param_home: str = DEVICE
    """Gathered params: where this rank's shards may live: "device" (all resident), "host" (all in pinned
    host memory, copied in on use: DeepSpeed's ``offload_param``), "nvme" (all in the NVMe tier's swap, read
    through a few pinned buffers), or "auto" (the device or a home of ``param_homes_off_device``, by what the
    step costs)."""
    param_homes_off_device: tuple[str, ...] = (HOST,)
    """The homes "auto" may give a shard off the device: the host, and NVMe where the config permits it."""
    live_groups: int = 0
    """Gathered params: groups wanted live on the device at once (``max_live_elements``), at least the fewest
    that work (``gather_ahead`` + the groups in use)..."""
    gather_ahead: int = 1
    """...and groups wanted fetched ahead of use (``prefetch_depth`` / ``gather_ahead_elements``)."""
    gathers_per_step: float = 2.0
    """Gathered params: times a group is brought onto the device per step: forward and backward before the
    warm-up; after it, Belady's eviction rule run over the recorded acquisitions (:func:`~zero_cache.plan.eviction.
    gathers_per_group`, recomputed blocks included)."""
    kept_bytes_per_element: int = 0
    """Host bytes per element of a kept gradient (host chunks updated during backward, one micro-batch per
    step: the compute dtype's size); 0 = none are wanted."""
    device_steps: int | None = 0
    """Host-held optimizer groups to step on the device after backward (:mod:`zero_cache.optim.device_steps`): that
    many at most, or None for the count with the cheapest step
    (:func:`~zero_cache.plan.step_cost.cheapest_device_steps`)."""
    rates: Rates = NOMINAL_RATES
    """How fast PCIe and the host's Adam move the step's work: the placements are compared at these rates."""

    def __post_init__(self) -> None:
        if self.owned is not None and not all(0 <= c < self.num_chunks for c in self.owned):
            raise ValueError(f"owned chunks {self.owned} must lie in 0..{self.num_chunks - 1}")

    @property
    def owned_chunks(self) -> tuple[int, ...]:
        return tuple(range(self.num_chunks)) if self.owned is None else self.owned

    @property
    def param_chunk_bytes(self) -> int:
        return self.chunk_numel * self.param_bytes_per_element

    @property
    def optimizer_bytes_per_element(self) -> int:
        return self.state_bytes_per_element + self.grad_bytes_per_element

    @property
    def optimizer_chunk_bytes(self) -> int:
        return self.chunk_numel * self.optimizer_bytes_per_element

    @property
    def swap_slot_bytes(self) -> int:
        """Disk bytes of one optimizer group: its states, padded to whole 4 KiB blocks."""
        return align_up(self.chunk_numel * self.state_bytes_per_element)

    @property
    def swap_buffer_bytes(self) -> int:
        """Host bytes of one bounce buffer: a slot plus the slack ``Tier.allocate_aligned`` takes to align it."""
        return self.swap_slot_bytes + DISK_BLOCK_BYTES

    @property
    def live_group_bytes(self) -> int:
        """Device bytes of one gathered group (``group_size`` chunks)."""
        return self.group_size * self.param_chunk_bytes

    @property
    def exchange_buffer_bytes(self) -> int:
        """Device bytes of the wanted gradient buckets."""
        return self.gradient_buckets * self.live_group_bytes

    @property
    def scratch_bytes(self) -> int:
        """One chunk per tier, in the state dtype, through which the update reads gradients of another dtype."""
        return self.chunk_numel * self.state_bytes_per_element // NUM_STATE_FIELDS


@dataclass(frozen=True, slots=True)
class Plan:
    """Where each chunk's states live, and how params move."""

    params_resident: bool
    """No param shard streams from a home off the device (replicated: every param chunk is on the device for good)."""
    cache_slots: int
    """Gathered params: collective groups live on the device at once (0 for replicated params)."""
    optimizer_tier: tuple[str, ...]
    """DEVICE, HOST or NVME for each chunk's optimizer group; REMOTE where another rank owns it."""
    device_bytes: int
    """Model-state bytes planned on the device."""
    host_bytes: int
    """Model-state bytes planned on the host."""
    nvme_bytes: int = 0
    """Swap-file bytes planned on the NVMe tier (``param_nvme_bytes`` of them param shards at home there)."""
    param_nvme_bytes: int = 0
    """Swap-file bytes of the param shards at home on NVMe."""
    params_sharded: bool = False
    """This rank holds one param chunk per collective group (its shard); whole groups are gathered on use."""
    param_home: tuple[str, ...] = ()
    """Gathered params: per collective group, the home of this rank's shard (a tier name;
    :mod:`zero_cache.storage.param_homes.registry`, priced by :mod:`zero_cache.plan.home_costs`)."""
    group_size: int = 1
    """Chunks per collective group (data-parallel ranks)."""
    traffic: StepTraffic = StepTraffic()
    """What one step moves over PCIe and updates on the host under this plan (an estimate)."""
    kept_gradients: tuple[int, ...] = ()
    """Host-updated chunks that keep their gradient on the host (updated during backward, revisable)."""
    device_stepped: tuple[int, ...] = ()
    """Host-tier chunks whose optimizer group is stepped on the device after backward, not by the host's Adam
    (those the next forward needs first)."""
    gather_ahead: int = 0
    """Gathered params: groups fetched ahead of use (the config's depth, or less where it did not fit)."""
    gradient_buckets: int = 0
    """Gradient buckets on the device (the wanted count, or fewer where they did not fit)."""

    @property
    def working_set(self) -> WorkingSet:
        """Its live groups, prefetch depth and gradient buckets (:mod:`zero_cache.plan.working_set`)."""
        return WorkingSet(ahead=self.gather_ahead, live_groups=self.cache_slots, buckets=self.gradient_buckets)

    @property
    def streamed_groups(self) -> int:
        """Groups whose shard lives off the device (host or NVMe) and is copied to the device on use."""
        return sum(home_costs(home).streams for home in self.param_home)

    def summary(self) -> str:
        counts = {tier: self.optimizer_tier.count(tier) for tier in (DEVICE, HOST, NVME)}
        params = "resident on the device"
        if self.params_sharded:
            kind = "sharded" if self.group_size > 1 else "gathered on use"
            homes = " and ".join(sorted({_HOME_WORDS.get(h, h) for h in self.param_home
                                         if home_costs(h).streams})) or "the host"
            params = (f"{kind}: {self.param_home.count(DEVICE)} of {len(self.param_home)} shards at home on the "
                      f"device, {self.streamed_groups} streamed from {homes}; {self.cache_slots} groups live at once, "
                      f"{self.gather_ahead} fetched ahead, {self.gradient_buckets} gradient buckets")
        disk = f", nvme {format_bytes(self.nvme_bytes)}" if self.nvme_bytes else ""
        notes = [f"{len(self.kept_gradients)} keep their gradient"] if self.kept_gradients else []
        notes += [f"{len(self.device_stepped)} stepped on the device"] if self.device_stepped else []
        spilled = self.traffic.gradients_to_disk  # (for their update after backward: a write and a read each)
        if spilled:
            notes.append(f"{spilled} gradients wait on disk" if spilled > 1 else "1 gradient waits on disk")
        kept = f" ({', '.join(notes)})" if notes else ""
        owned = len(self.optimizer_tier) - self.optimizer_tier.count(REMOTE)
        return (f"params {params}; optimizer states of {owned} chunks: {counts[DEVICE]} on the "
                f"device, {counts[HOST]} on the host, {counts[NVME]} on NVMe{kept}; "
                f"device {format_bytes(self.device_bytes)}, host {format_bytes(self.host_bytes)}{disk}; "
                f"per step {self.traffic.describe()}")
