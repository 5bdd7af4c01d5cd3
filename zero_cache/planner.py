"""From a warm-up trace and tier budgets to a placement plan (pure functions, no tensors).

Per chunk there are two groups of state:

* the **param** chunk in the compute dtype, read by forward and backward;
* the **optimizer group**: fp32 master, exp_avg, exp_avg_sq, and an fp32 gradient accumulator
  when micro-batches accumulate (single-micro-batch gradients are written into the param chunk
  and take no bytes of their own), read and written once per step.

The plan decides, in this order of value per device byte:

1. device room left after the measured non-model peak (activations, workspace) and a margin;
2. param chunks resident on the device for the whole run when they all fit (no traffic at all);
   otherwise a cache of ``cache_slots`` param chunks, filled along the trace with prefetch and
   emptied by Belady's rule (evict the chunk whose next use is furthest away: optimal for
   equal-size pages, Belady 1966);
3. as many optimizer groups on the device as fit (updated by the GPU Adam, no traffic), for the
   chunks used first in the forward, so the host's update of the later chunks hides behind it;
4. as many of the rest on the host as its budget holds, plus ``staging_buffers`` pinned param-sized
   buffers through which every host<->device transfer goes;
5. with an NVMe tier, the remaining groups in its swap file: those of the chunks used *last* in the
   forward, whose updates start first in backward and are needed last by the next forward, so
   their disk reads and writes have the most compute to hide under. They cost the host
   ``swap_buffers`` pinned bounce buffers (read chunk i+1 while updating chunk i while writing
   chunk i-1) and, when micro-batches accumulate, their fp32 gradient accumulators.

If something does not fit, :func:`make_plan` raises :class:`PlanError` with the shortfall per
tier and what to change, before a single byte is allocated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from zero_cache.units import format_bytes

DEVICE, HOST, NVME = "device", "host", "nvme"
OFF_DEVICE = (HOST, NVME)
"""Tiers whose chunks the host worker updates (NVMe groups through bounce buffers)."""
REMOTE = "remote"
"""The optimizer group of a chunk that another data-parallel rank owns (see ``zero_cache.sharding``)."""
SWAP_ALIGN_BYTES = 4096
"""Swap slots and bounce buffers are whole 4 KiB blocks (O_DIRECT)."""
STATE_BYTES_PER_ELEMENT = 12
"""fp32 master + exp_avg + exp_avg_sq (the gradient's bytes come on top, by its dtype)."""


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
    nonmodel_peak_bytes: int = 0
    """Peak device bytes not owned by ZeRO-Cache (activations, workspace), from the warm-up."""
    prefetch_depth: int = 2
    """Chunks fetched ahead of use when params are cached rather than resident."""
    margin_fraction: float = 0.03
    """Device budget kept free for allocator fragmentation and transients."""
    grad_bytes_per_element: int = 4
    """4 for an fp32 gradient accumulator, 0 when single-micro-batch gradients are written into the param chunk."""
    staging_buffers: int = 4
    """Pinned param-chunk-sized transfer buffers on the host (when any optimizer group is there)."""
    nvme_budget_bytes: int = 0
    """Bytes the NVMe tier may take; 0 = no NVMe tier."""
    swap_buffers: int = 3
    """Pinned bounce buffers of one swap slot each (when any optimizer group is on NVMe)."""
    owned: tuple[int, ...] | None = None
    """Chunks whose optimizer groups this rank holds (data-parallel sharding); None = all of them."""
    padding_chunks: int = 0
    """Zero param chunks that complete the last collective group (sharding)."""
    exchange_buffer_bytes: int = 0
    """Device bytes of the gradient buckets that sharded, accumulating micro-batches reduce from (and, with
    sharded params, of the groups gathered at once)."""
    param_chunks_held: int | None = None
    """Param chunks this rank stores: None = all of them and the padding (replicated params), or one per
    collective group (sharded params: its shards)."""

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
        return STATE_BYTES_PER_ELEMENT + self.grad_bytes_per_element

    @property
    def optimizer_chunk_bytes(self) -> int:
        return self.chunk_numel * self.optimizer_bytes_per_element

    @property
    def swap_slot_bytes(self) -> int:
        """Disk bytes of one optimizer group: its fp32 states, padded to whole 4 KiB blocks."""
        return -(-self.chunk_numel * STATE_BYTES_PER_ELEMENT // SWAP_ALIGN_BYTES) * SWAP_ALIGN_BYTES

    @property
    def swap_buffer_bytes(self) -> int:
        """Host bytes of one bounce buffer: a slot plus the slack ``Tier.allocate_aligned`` takes to align it."""
        return self.swap_slot_bytes + SWAP_ALIGN_BYTES

    @property
    def scratch_bytes(self) -> int:
        """One fp32 chunk per tier through which the update reads low-precision gradients."""
        return self.chunk_numel * 4


@dataclass(frozen=True, slots=True)
class Plan:
    """Where each chunk's states live, and how params move."""

    params_resident: bool
    """All param chunks stay on the device; no param traffic."""
    cache_slots: int
    """Param chunks the device holds at once when not resident."""
    optimizer_tier: tuple[str, ...]
    """DEVICE, HOST or NVME for each chunk's optimizer group; REMOTE where another rank owns it."""
    device_bytes: int
    """Model-state bytes planned on the device."""
    host_bytes: int
    """Model-state bytes planned on the host."""
    nvme_bytes: int = 0
    """Swap-file bytes planned on the NVMe tier."""
    params_sharded: bool = False
    """This rank holds one param chunk per collective group (its shards); the others are gathered on use."""

    def summary(self) -> str:
        counts = {tier: self.optimizer_tier.count(tier) for tier in (DEVICE, HOST, NVME)}
        params = "resident on the device" if self.params_resident else f"cached in {self.cache_slots} device slots"
        if self.params_sharded:
            params = "sharded (this rank's shards resident on the device, the other chunks gathered on use)"
        disk = f", nvme {format_bytes(self.nvme_bytes)}" if self.nvme_bytes else ""
        owned = len(self.optimizer_tier) - self.optimizer_tier.count(REMOTE)
        return (f"params {params}; optimizer states of {owned} chunks: {counts[DEVICE]} on the "
                f"device, {counts[HOST]} on the host, {counts[NVME]} on NVMe; device {format_bytes(self.device_bytes)}, "
                f"host {format_bytes(self.host_bytes)}{disk}")


def first_use_order(trace: Sequence[int], num_chunks: int) -> tuple[int, ...]:
    """Chunks by first appearance in the trace, then any never traced, in index order."""
    seen: dict[int, None] = dict.fromkeys(trace)
    return tuple(seen) + tuple(c for c in range(num_chunks) if c not in seen)


def make_plan(inputs: PlanInputs) -> Plan:
    """Decide placement; raise PlanError with the shortfall when it cannot fit.

    Returns:
        The plan, maximising device residency in the order described in the module docstring.
    """
    n = inputs.num_chunks
    owned = inputs.owned_chunks
    room = (int(inputs.device_budget_bytes * (1 - inputs.margin_fraction)) - inputs.nonmodel_peak_bytes
            - inputs.scratch_bytes - inputs.exchange_buffer_bytes)
    held = n + inputs.padding_chunks if inputs.param_chunks_held is None else inputs.param_chunks_held
    all_params = held * inputs.param_chunk_bytes
    min_slots = min(n, inputs.prefetch_depth + 2)  # in use + being fetched + one spare
    if room >= all_params:
        params_resident, cache_slots, param_device = True, n, all_params
    elif inputs.param_chunks_held is not None:  # shards are not streamed from the host
        need = all_params + inputs.device_budget_bytes - room
        raise PlanError(_shortfall_message("device", need, inputs.device_budget_bytes, inputs, detail=(
            f"it holds this rank's {held} param shards of {format_bytes(inputs.param_chunk_bytes)} and "
            f"{format_bytes(inputs.exchange_buffer_bytes)} of gathered groups and gradient buckets besides "
            f"{format_bytes(inputs.nonmodel_peak_bytes)} of activations")))
    elif room >= min_slots * inputs.param_chunk_bytes:
        cache_slots = room // inputs.param_chunk_bytes
        # Leave room for optimizer groups only once params are resident; a param cache takes it all.
        params_resident, param_device = False, cache_slots * inputs.param_chunk_bytes
    else:
        need = min_slots * inputs.param_chunk_bytes + inputs.nonmodel_peak_bytes + inputs.scratch_bytes
        raise PlanError(_shortfall_message("device", need, inputs.device_budget_bytes, inputs, detail=(
            f"it needs room for {min_slots} param chunks of {format_bytes(inputs.param_chunk_bytes)} besides "
            f"{format_bytes(inputs.nonmodel_peak_bytes)} of activations")))
    device_optim = max(0, room - param_device) // inputs.optimizer_chunk_bytes if params_resident else 0
    device_optim = min(len(owned), device_optim)
    # Device optimizer groups go to the chunks the next forward needs first: the host groups' CPU
    # Adam and their host->device copies then overlap the forward through those early layers.
    mine = set(owned)
    order = [c for c in first_use_order(inputs.trace, n) if c in mine]
    host_fixed = inputs.scratch_bytes + (0 if params_resident else all_params)
    num_host, num_nvme, host_bytes = _split_host_and_nvme(inputs, len(owned) - device_optim, host_fixed)
    tiers = [REMOTE] * n
    for position, chunk in enumerate(order):
        tiers[chunk] = DEVICE if position < device_optim else HOST if position < device_optim + num_host else NVME
    device_bytes = (param_device + device_optim * inputs.optimizer_chunk_bytes + inputs.scratch_bytes
                    + inputs.exchange_buffer_bytes)
    return Plan(params_resident=params_resident, cache_slots=cache_slots, optimizer_tier=tuple(tiers),
                device_bytes=device_bytes, host_bytes=host_bytes, nvme_bytes=num_nvme * inputs.swap_slot_bytes,
                params_sharded=inputs.param_chunks_held is not None)


def _split_host_and_nvme(inputs: PlanInputs, off_device: int, host_fixed: int) -> tuple[int, int, int]:
    """(groups on the host, groups on NVMe, host bytes) for the ``off_device`` groups, host first."""
    staging = inputs.staging_buffers * inputs.param_chunk_bytes if off_device else 0
    per_host = inputs.optimizer_chunk_bytes
    per_nvme_on_host = inputs.chunk_numel * inputs.grad_bytes_per_element  # accumulators stay in RAM
    bounce = inputs.swap_buffers * inputs.swap_buffer_bytes

    def host_bytes(num_host: int) -> int:
        num_nvme = off_device - num_host
        return (host_fixed + staging + num_host * per_host + num_nvme * per_nvme_on_host
                + (bounce if num_nvme else 0))

    if host_bytes(off_device) <= inputs.host_budget_bytes:
        return off_device, 0, host_bytes(off_device)
    if inputs.nvme_budget_bytes <= 0:
        raise PlanError(_shortfall_message("host", host_bytes(off_device), inputs.host_budget_bytes, inputs, detail=(
            f"{off_device} chunks' optimizer states ({inputs.optimizer_bytes_per_element} B/element)"
            + ("" if host_fixed == inputs.scratch_bytes else " and every param chunk's home copy") + " live there")))
    num_host = max(0, (inputs.host_budget_bytes - host_bytes(0)) // max(1, per_host - per_nvme_on_host))
    num_host = min(num_host, off_device - 1)
    if host_bytes(num_host) > inputs.host_budget_bytes:
        raise PlanError(_shortfall_message("host", host_bytes(num_host), inputs.host_budget_bytes, inputs, detail=(
            f"even with {off_device - num_host} optimizer groups on NVMe it holds {inputs.swap_buffers} bounce "
            f"buffers of {format_bytes(inputs.swap_buffer_bytes)}, {inputs.staging_buffers} staging buffers"
            + (" and the gradient accumulators" if per_nvme_on_host else ""))))
    num_nvme = off_device - num_host
    if num_nvme * inputs.swap_slot_bytes > inputs.nvme_budget_bytes:
        raise PlanError(_shortfall_message("nvme", num_nvme * inputs.swap_slot_bytes, inputs.nvme_budget_bytes,
                                           inputs, detail=f"{num_nvme} optimizer groups of "
                                                          f"{format_bytes(inputs.swap_slot_bytes)} go to disk"))
    return num_host, num_nvme, host_bytes(num_host)


def _shortfall_message(tier: str, need: int, have: int, inputs: PlanInputs, detail: str) -> str:
    total = inputs.num_chunks * (inputs.param_chunk_bytes + inputs.optimizer_chunk_bytes)
    owned = len(inputs.owned_chunks)
    held = inputs.num_chunks if inputs.param_chunks_held is None else inputs.param_chunks_held
    params = "every param chunk" if inputs.param_chunks_held is None else f"{held} param chunks"
    share = ("" if owned == inputs.num_chunks else
             f" (this data-parallel rank holds {params} and the optimizer states of {owned} of the "
             f"{inputs.num_chunks} chunks: {format_bytes(held * inputs.param_chunk_bytes + owned * inputs.optimizer_chunk_bytes)})")
    return (f"model states do not fit: the {tier} tier needs {format_bytes(need)} but its budget is "
            f"{format_bytes(have)} (short by {format_bytes(need - have)}); {detail}. All model states together "
            f"take {format_bytes(total)}{share}. Raise zero_cache.{tier}_memory_budget, "
            + ("give the NVMe tier more room (free disk space under zero_cache.nvme_path)" if inputs.nvme_budget_bytes
               else "add an NVMe tier (zero_cache.nvme_path)")
            + ", shrink the micro-batch or enable activation checkpointing, or use more GPUs.")


def belady_misses(trace: Sequence[int], capacity: int) -> tuple[int, list[tuple[int, int | None]]]:
    """Simulate a cache of ``capacity`` equal-size chunks under Belady's rule.

    Args:
        trace: chunk accesses in order.
        capacity: chunks that fit at once (>= 1).

    Returns:
        (number of misses, list of (fetched chunk, evicted chunk or None) per miss).
    """
    if capacity < 1:
        raise ValueError("capacity must be at least one chunk")
    next_use = _next_use_table(trace)
    cached: dict[int, int] = {}  # chunk -> index of its next use
    events: list[tuple[int, int | None]] = []
    for i, chunk in enumerate(trace):
        if chunk in cached:
            cached[chunk] = next_use[i]
            continue
        victim = None
        if len(cached) >= capacity:
            victim = max(cached, key=lambda c: cached[c])  # furthest next use (never used = infinity)
            del cached[victim]
        cached[chunk] = next_use[i]
        events.append((chunk, victim))
    return len(events), events


def _next_use_table(trace: Sequence[int]) -> list[int]:
    """For each position, the position of the same chunk's next access (len(trace) + 1 if none)."""
    never = len(trace) + 1
    table, last = [never] * len(trace), {}
    for i in range(len(trace) - 1, -1, -1):
        table[i] = last.get(trace[i], never)
        last[trace[i]] = i
    return table
