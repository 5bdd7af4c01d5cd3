"""Typed configuration of ZeRO-Cache (the ``"zero_cache"`` section of the JSON config)."""

from __future__ import annotations

from dataclasses import dataclass, field

from zero_cache.plan.tier_names import DEVICE, HOST, NVME
from zero_cache.plan.units import AUTO, parse_budget

OFFLOAD_DEVICES = ("none", "cpu", "nvme")
PARAM_HOMES = (AUTO, DEVICE.value, HOST.value, NVME.value)
AIO_BACKENDS = ("auto", "native", "deepspeed", "libaio", "threads")
STATE_DTYPES = ("fp32", "bf16")
"""``zero_cache.state_dtype`` values: the optimizer states' dtype (its itemsize is in
:data:`STATE_ITEMSIZE`)."""
STATE_ITEMSIZE = {"fp32": 4, "bf16": 2}


@dataclass(kw_only=True, slots=True)
class AioConfig:
    """DeepSpeed's ``aio`` block, which drives the NVMe tier's IO."""

    block_size: int = 1_048_576
    """Bytes per IO piece (a multiple of 4096)."""

    queue_depth: int = 8
    """Pieces in flight at once."""

    thread_count: int = 1
    """Worker threads of the ``threads`` and ``deepspeed`` backends (DeepSpeed's intra_op_parallelism)."""

    single_submit: bool = False
    """Submit pieces one system call at a time instead of in batches."""

    overlap_events: bool = True
    """Reap completions while submitting (DeepSpeed's knob; the native backend always does)."""

    backend: str = "auto"
    """"auto", or force one of "native", "deepspeed", "libaio", "threads"."""

    def __post_init__(self) -> None:
        if self.block_size < 4096 or self.block_size % 4096:
            raise ValueError(f"aio.block_size: must be a positive multiple of 4096 bytes, got {self.block_size}")
        if self.queue_depth < 1:
            raise ValueError(f"aio.queue_depth: must be >= 1, got {self.queue_depth}")
        if self.thread_count < 1:
            raise ValueError(f"aio.thread_count: must be >= 1, got {self.thread_count}")
        if self.backend not in AIO_BACKENDS:
            raise ValueError(f"zero_cache.aio.backend: must be one of {AIO_BACKENDS}, got {self.backend!r}")


@dataclass(kw_only=True, slots=True)
class ZeroCacheConfig:
    """Where model states live and how they move between GPU, pinned host memory and NVMe."""

    enabled: bool = False
    """Manage parameters, gradients and optimizer states in chunks across the memory tiers."""

    chunk_size: int | str = AUTO
    """Elements per chunk, or "auto" to search a size from the model's tensor sizes."""

    device_memory_budget: int | str = AUTO
    """Bytes of accelerator memory for model states ("2GB", 2147483648, or "auto" = free memory less a margin)."""

    host_memory_budget: int | str = AUTO
    """Bytes of pinned host memory for model states (same forms as device_memory_budget)."""

    activation_memory: int | str = AUTO
    """Device bytes held back for activations until the first step has measured them (same forms as
    device_memory_budget; "auto": a tenth of the device budget, and at least half of it up to 12 GiB, what
    a 13B model at micro-batch 8 and sequence 1024 with activation checkpointing peaks at). The chunk size and
    whether params are gathered are decided with it. A configured reserve is also what the first (warm-up)
    step runs with; with "auto" on a GPU, where it is only a guess, the warm-up step runs at the plan's least
    device footprint instead (:func:`~zero_cache.resolve.least_footprint_plan`: every byte the host can take
    leaves the device). The re-plan after the first step uses the measured peak either way."""

    prefetch_depth: int = 2
    """How many chunks ahead of use, along the warm-up trace, to start copying to the device."""

    update_in_backward: bool | str = AUTO
    """Start each host-resident chunk's Adam update during backward, as soon as the chunk's last
    gradient is complete (the last micro-batch's backward when they accumulate), so CPU Adam overlaps
    the rest of backward and the next forward. Exact: the clip factor and a non-finite gradient are
    known only after backward, so each such chunk keeps its gradient on the host until the step, which
    takes the update back or redoes it with the true factor when needed (:mod:`zero_cache.optim.revision`).
    "auto" = on (data-parallel ranks that accumulate micro-batches update after backward)."""

    fold_waited_updates: bool = True
    """A host update that waits for the global norm (a step that clips, or no ``update_in_backward``) stores the
    weight alone and keeps the gradient; a job behind the step's updates folds the moments in, off the path to the
    next forward (:mod:`zero_cache.optim.revision`, "Waited steps"). Bit for bit the eager update; false stores
    everything in the update's own pass (the A/B of the bench: ``--set zero_cache.fold_waited_updates=false``)."""

    native_host_adam: bool | str = AUTO
    """Update host chunks with ``csrc/fused_host_adam.cpp`` (built on first use; bf16 gradient in, bf16
    weight out in one pass) instead of the library CPU Adam. "auto": on when the compute device is a
    GPU, where the host update runs beside GPU work and its speed sets the step time. A failed build
    is logged and falls back to the library kernel."""

    device_steps: int | str = AUTO
    """Host-held optimizer groups stepped on the GPU after backward, instead of by the host's Adam: their fp32
    states are copied in, stepped by the GPU's fused Adam and copied back, piece by piece through the device's
    update scratch (:mod:`zero_cache.optim.device_steps`). Each costs 24-28 PCIe bytes per element and spares the
    host's Adam a chunk. A number caps how many (0: none); "auto": as many as make the step cheapest by the
    planner's estimate, on a GPU (none on a CPU-only run)."""

    overlap_comm: bool = True
    """Sharded over data-parallel ranks: reduce-scatter each chunk group from backward as soon as its
    gradients are complete, under the rest of backward (true), or every group at ``step()`` (false).
    DeepSpeed's ``zero_optimization.overlap_comm`` carries over."""

    hierarchical: bool | str = AUTO
    """Sharded: run each reduce-scatter and all-gather within the host first (NVLink), then across hosts
    among the ranks of the same local index, so 1/L of the bytes crosses the network (L = ranks per
    host). "auto": when the ranks span several hosts."""

    ranks_per_host: int | None = None
    """Ranks per host, for the hierarchy and the split of an "auto" host budget; None = the launcher's
    ``LOCAL_WORLD_SIZE``."""

    gather_ahead_elements: int = 50_000_000
    """Sharded: parameter elements whose all-gather is started ahead of the forward that needs them
    (rounded up to whole chunk groups, at least one). DeepSpeed's
    ``zero_optimization.stage3_prefetch_bucket_size`` carries over."""

    shard_params: bool | str = AUTO
    """Sharded over data-parallel ranks: keep only this rank's chunk of each group's params (ZeRO-3) and
    all-gather a group while forward or backward uses it, instead of a full copy per rank (ZeRO-2). It
    frees (W-1)/W of the params' device memory for optimizer states, for two more all-gathers of the
    model per step. "auto": shard when that puts more optimizer states on the device, or is the only way
    the model fits."""

    param_home: str = AUTO
    """Where the bf16/fp16 params live between uses. "device": on the GPU for the whole run (the model's
    weights must fit there). "host": every chunk's params at home in pinned host memory, copied to the
    GPU ahead of use along the warm-up trace into a few device slots, their gradients written back to
    that home and updated there by the host Adam (DeepSpeed's ``offload_param: {device: cpu}`` carries
    over to this). "auto": as many chunks stay home on the GPU as the plan finds worth it by what the
    step costs (PCIe bytes against CPU Adam), the rest stream from the host; a model whose weights fit
    beside their optimizer states keeps them all on the GPU (and, with ``nvme_param_homes``, the disk takes
    those the host has no room for or that cost less there). "nvme": every chunk's params at home in a swap
    file under ``nvme_path`` (which must be set), host memory holding only a few pinned buffers they are
    read and written through."""

    nvme_param_homes: bool = False
    """With ``param_home`` "auto": shards may also be homed on NVMe (``nvme_path`` must be set), where the plan
    finds that cheaper than the host or the host has no room for them. DeepSpeed's ``offload_param: {device:
    nvme}`` sets it: a permission, as ``offload_param: {device: cpu}`` is for the host."""

    max_live_elements: int = 1_000_000_000
    """Sharded params: parameter elements gathered at once (rounded down to whole chunk groups, at least
    ``gather_ahead`` + 2 groups). DeepSpeed's ``zero_optimization.stage3_max_live_parameters`` carries over."""

    nvme_path: str | None = None
    """Directory for the NVMe tier's swap files; None keeps all states in GPU + host memory. Optimizer
    states that fit in neither the device nor the host budget go there (DeepSpeed's
    ``offload_optimizer.nvme_path`` / ``offload_param.nvme_path`` carry over)."""

    nvme_memory_budget: int | str = AUTO
    """Bytes the swap files may take ("auto" = the free space under nvme_path, less a margin)."""

    state_dtype: str = "fp32"
    """The dtype of every chunk's master weights, Adam moments and gradient accumulator, in every home (device, host,
    NVMe; checkpoints hold them upcast to fp32, exactly): "fp32", or "bf16", which DeepSpeed's
    ``bf16.bf16_master_weights_and_grads`` with ``bf16.bf16_optimizer_states`` sets (6 bytes an element of states
    instead of 12; the step's arithmetic stays fp32, its results are rounded to bf16). Set it through those keys; the
    loader refuses a value they disagree with."""

    aio: AioConfig = field(default_factory=AioConfig)
    """How the NVMe tier does its IO (filled from DeepSpeed's top-level ``aio`` block)."""

    def __post_init__(self) -> None:
        if isinstance(self.chunk_size, str):
            if self.chunk_size != AUTO:
                raise ValueError(
                    f"zero_cache.chunk_size: expected a number of elements or 'auto', got {self.chunk_size!r}"
                )
        elif self.chunk_size < 1024:
            raise ValueError(
                f"zero_cache.chunk_size: {self.chunk_size} elements is too small; use at least 1024 or 'auto'"
            )
        # Parse now so a bad size fails at load time, not at the first allocation.
        parse_budget(self.device_memory_budget, name="zero_cache.device_memory_budget")
        parse_budget(self.host_memory_budget, name="zero_cache.host_memory_budget")
        parse_budget(self.nvme_memory_budget, name="zero_cache.nvme_memory_budget")
        parse_budget(self.activation_memory, name="zero_cache.activation_memory")
        if self.nvme_path is not None and not str(self.nvme_path).strip():
            raise ValueError(
                "zero_cache.nvme_path: empty; give a directory on the NVMe drive, or null for no disk tier"
            )
        if self.max_live_elements < 0:
            raise ValueError(f"zero_cache.max_live_elements: must be >= 0, got {self.max_live_elements}")
        for key in ("update_in_backward", "native_host_adam", "shard_params"):
            value = getattr(self, key)
            if not isinstance(value, bool) and value != AUTO:
                raise ValueError(f"zero_cache.{key}: expected true, false or 'auto', got {value!r}")
        if self.param_home not in PARAM_HOMES:
            raise ValueError(f"zero_cache.param_home: must be one of {PARAM_HOMES}, got {self.param_home!r}")
        if not isinstance(self.nvme_param_homes, bool):
            raise ValueError(f"zero_cache.nvme_param_homes: expected true or false, got {self.nvme_param_homes!r}")
        if self.nvme_param_homes and self.nvme_path is None:
            raise ValueError("zero_cache.nvme_param_homes is true but no swap directory is set: "
                             "set zero_cache.nvme_path (or offload_param.nvme_path) to a directory on a local disk")
        if not isinstance(self.hierarchical, bool) and self.hierarchical != AUTO:
            raise ValueError(f"zero_cache.hierarchical: expected true, false or 'auto', got {self.hierarchical!r}")
        if self.ranks_per_host is not None and self.ranks_per_host < 1:
            raise ValueError(f"zero_cache.ranks_per_host: must be >= 1 (or null), got {self.ranks_per_host}")
        if self.gather_ahead_elements < 0:
            raise ValueError(f"zero_cache.gather_ahead_elements: must be >= 0, got {self.gather_ahead_elements}")
        if not (self.device_steps == AUTO or (isinstance(self.device_steps, int) and not isinstance(
                self.device_steps, bool) and self.device_steps >= 0)):
            raise ValueError(f"zero_cache.device_steps: expected a number of optimizer groups >= 0 or 'auto', "
                             f"got {self.device_steps!r}")
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(f"zero_cache.state_dtype: must be one of {STATE_DTYPES}, got {self.state_dtype!r} (set "
                             "it through bf16.bf16_master_weights_and_grads and bf16.bf16_optimizer_states)")
        if self.prefetch_depth < 0:
            raise ValueError(f"zero_cache.prefetch_depth: must be >= 0, got {self.prefetch_depth}")

    @property
    def state_itemsize(self) -> int:
        """Bytes of one element of one state (master, exp_avg, exp_avg_sq, accumulator)."""
        return STATE_ITEMSIZE[self.state_dtype]

    @property
    def device_budget_bytes(self) -> int | None:
        """The device budget in bytes, or None for "auto"."""
        return parse_budget(self.device_memory_budget, name="zero_cache.device_memory_budget")

    @property
    def nvme_budget_bytes(self) -> int | None:
        """The NVMe budget in bytes, or None for "auto"."""
        return parse_budget(self.nvme_memory_budget, name="zero_cache.nvme_memory_budget")

    @property
    def host_budget_bytes(self) -> int | None:
        """The host budget in bytes, or None for "auto"."""
        return parse_budget(self.host_memory_budget, name="zero_cache.host_memory_budget")
