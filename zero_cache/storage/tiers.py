"""Memory tiers behind one interface: a byte budget, allocate/free, and usage counters.

The device tier is the compute device (CUDA, or the CPU in CPU-only runs, so every path runs in
tests); the host tier is pinned CPU memory when CUDA is present (pinned once at allocation, reused
for the whole run: no per-step pinning). The NVMe tier (``zero_cache.storage.nvme``) keeps the same budget
counters but hands out slots of a swap file instead of tensors.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import deque
from typing import Any, Callable

import numpy
import psutil
import torch

from zero_cache.plan.tier_names import DEVICE, HOST
from zero_cache.plan.units import format_bytes

AUTO_MARGIN_FRACTION = 0.03
""""auto" budgets leave this share of the measured free memory to everything else..."""
AUTO_MARGIN_MIN_BYTES = 2**30
"""...and at least this many bytes."""


class TierFullError(MemoryError):
    """An allocation would exceed the tier's budget (a planning bug: plans are checked up front)."""


class Tier:
    """A budgeted pool of tensors on one device.

    Args:
        name: "device" or "host" (used in messages).
        device: where tensors are allocated.
        budget_bytes: most bytes this tier may hold.
        pin_memory: allocate page-locked host memory (host tier with CUDA present).
    """

    def __init__(self, name: str, device: torch.device, budget_bytes: int, *, pin_memory: bool = False) -> None:
        self.name = name
        self.device = device
        self.budget_bytes = budget_bytes
        self.pin_memory = pin_memory
        self.used_bytes = 0
        self.peak_bytes = 0
        self._interval_low_bytes = 0  # the least held since the last take_interval_low()

    @property
    def free_bytes(self) -> int:
        return self.budget_bytes - self.used_bytes

    def allocate(self, numel: int, dtype: torch.dtype, *, zero: bool = True) -> torch.Tensor:
        """A flat tensor counted against the budget, zeroed unless ``zero`` is false (it is about to be
        overwritten whole: no memset)."""
        num_bytes = numel * torch.empty((), dtype=dtype).element_size()
        if num_bytes > self.free_bytes:
            raise TierFullError(f"{self.name} tier: allocating {format_bytes(num_bytes)} exceeds its budget "
                                f"({format_bytes(self.used_bytes)} of {format_bytes(self.budget_bytes)} in use)")
        if self.pin_memory:
            tensor = _pinned_zeros(numel, dtype)
        else:
            tensor = (torch.zeros if zero else torch.empty)(numel, dtype=dtype, device=self.device)
        self.used_bytes += num_bytes
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        return tensor

    def allocate_aligned(self, num_bytes: int, align_bytes: int) -> torch.Tensor:
        """A zeroed uint8 buffer whose address is a multiple of ``align_bytes`` (O_DIRECT IO needs it)."""
        raw = self.allocate(num_bytes + align_bytes, torch.uint8)
        start = -raw.data_ptr() % align_bytes
        return raw[start:start + num_bytes]

    def free_aligned(self, buffer: torch.Tensor, align_bytes: int) -> None:
        """Return the bytes of a buffer from :meth:`allocate_aligned` (with the slack its alignment took)."""
        self._give_back(buffer.numel() * buffer.element_size() + align_bytes)

    def free(self, tensor: torch.Tensor) -> None:
        """Return a tensor's bytes to the budget (the caller drops its references; pinned pages are
        unpinned when the last view of them is gone)."""
        self._give_back(tensor.numel() * tensor.element_size())

    def _give_back(self, num_bytes: int) -> None:
        self.used_bytes -= num_bytes
        assert self.used_bytes >= 0, f"{self.name} tier freed more than it allocated"
        self._interval_low_bytes = min(self._interval_low_bytes, self.used_bytes)

    def take_interval_low(self) -> int:
        """The least bytes held since the last call (or since the tier was made), and a new interval from now
        (:mod:`zero_cache.runtime.nonmodel` reads the engine's own bytes beside the allocator's peak this way)."""
        low = min(self._interval_low_bytes, self.used_bytes)
        self._interval_low_bytes = self.used_bytes
        return low


def wait(token: Any) -> None:
    """Block until ``token`` has completed: a CUDA event, an IO request (``.wait()``), or None (nothing to wait for)."""
    if token is None:
        return
    if isinstance(token, torch.cuda.Event):
        token.synchronize()
    else:
        token.wait()


class TrafficCounter:
    """Bytes moved per direction since the last :meth:`take`, counted from any thread."""

    def __init__(self, *directions: str) -> None:
        self._lock = threading.Lock()
        self._moved = dict.fromkeys(directions, 0)

    def add(self, direction: str, num_bytes: int) -> None:
        with self._lock:
            self._moved[direction] += num_bytes

    def take(self) -> dict[str, int]:
        """The counts so far, which then restart from zero."""
        with self._lock:
            moved, self._moved = self._moved, dict.fromkeys(self._moved, 0)
        return moved


class BufferPool:
    """A few equal buffers, allocated together at the first use and reused for the whole run.

    A released buffer carries the token of the transfer still using it (a CUDA event or an IO
    request); ``acquire`` waits for that transfer before handing the buffer out again.

    Args:
        count: buffers in the pool.
        allocate: makes one buffer (counted against its tier's budget by the tier).
        free: gives one back to its tier (:meth:`trim`); None: the pool keeps its buffers for the whole run.
    """

    def __init__(self, count: int, allocate: Callable[[], torch.Tensor],
                 free: Callable[[torch.Tensor], None] | None = None) -> None:
        self.count, self._allocate, self._give_back = count, allocate, free
        self._free: deque[tuple[torch.Tensor, Any]] = deque()
        self._allocated = False
        self._available = threading.Condition()

    def acquire(self) -> torch.Tensor:
        with self._available:
            self._allocate_all()
            while not self._free:
                self._available.wait()
            buffer, in_use_until = self._free.popleft()
        wait(in_use_until)
        return buffer

    def _allocate_all(self) -> None:
        if not self._allocated:  # all at once, so the tier's usage does not depend on timing
            self._allocated = True
            self._free.extend((self._allocate(), None) for _ in range(self.count))

    def try_acquire(self) -> torch.Tensor | None:
        """A buffer if one is free now (its last transfer waited for), else None, without blocking on the others."""
        with self._available:
            self._allocate_all()
            if not self._free:
                return None
            buffer, in_use_until = self._free.popleft()
        wait(in_use_until)
        return buffer

    def release(self, buffer: torch.Tensor, in_use_until: Any = None) -> None:
        with self._available:
            self._free.append((buffer, in_use_until))
            self._available.notify()

    @property
    def allocated(self) -> bool:
        """Whether the pool holds its buffers (made at the first use, until :meth:`trim`)."""
        return self._allocated

    def trim(self) -> int:
        """Give every buffer back to its tier, after the transfers still using them: nothing the plan in force keeps
        passes through them (a re-plan moved it all elsewhere), so the pinned pages go, and the host's memory follows
        the plan, which no longer counts them. The next use makes them again. Returns the buffers given back.

        Every buffer must have been released (between steps, with the work in flight finished)."""
        assert self._give_back is not None, "this pool keeps its buffers for the whole run"
        with self._available:
            if not self._allocated:
                return 0
            assert len(self._free) == self.count, f"{self.count - len(self._free)} buffer(s) of the pool still in use"
            held, self._free, self._allocated = list(self._free), deque(), False
        for buffer, in_use_until in held:
            wait(in_use_until)
            self._give_back(buffer)
        return len(held)


def _pinned_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Zeroed host memory page-locked exactly, and unlocked when its last view is gone.

    ``pin_memory=True`` goes through CUDA's caching host allocator, which rounds every request up
    to a power of two: a 3.8 GB optimizer group takes 4 GiB and a 0.6 GB gradient chunk 1 GiB, and
    since pinned pages cannot be swapped, that slack alone can exhaust host RAM. Registering an
    ordinary allocation (as DeepSpeed's swapper does) pins only what is used. The numpy array owns
    the memory (the tensor keeps it alive), and its finalizer unregisters the pages before they
    are freed: memory returned to the OS while still registered breaks later registrations.
    """
    num_bytes = numel * torch.empty((), dtype=dtype).element_size()
    owner = numpy.zeros(max(num_bytes, 1), dtype=numpy.uint8)  # calloc: pages arrive zeroed, on first touch
    address = owner.ctypes.data
    error = int(torch.cuda.cudart().cudaHostRegister(address, owner.nbytes, 0))
    if error != 0:
        torch.cuda.cudart().cudaGetLastError()  # clear it, or the next kernel launch reports it
        raise TierFullError(f"could not page-lock {format_bytes(num_bytes)} of host memory (CUDA error {error}); "
                            "lower zero_cache.host_memory_budget")
    weakref.finalize(owner, torch.cuda.cudart().cudaHostUnregister, address)
    return torch.from_numpy(owner)[:num_bytes].view(dtype)


def auto_device_budget(device: torch.device, ranks_per_host: int = 1) -> int:
    """Free memory on the compute device, less the margin (host RAM stands in on CPU-only runs, split
    between the ranks of the host, as the host tier is).

    On CUDA, free is what this process may still allocate: the GPU's free memory, or less under a cap the
    process already has (``torch.cuda.set_per_process_memory_fraction``, e.g. a GPU shared with others).
    """
    if device.type == "cuda":
        torch.cuda.empty_cache()  # blocks cached by the allocator (e.g. an fp32 copy of the model) are free too
        free, total = torch.cuda.mem_get_info(device)
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _device: 1.0)(device)
        return device_share(min(free, int(total * fraction) - torch.cuda.memory_reserved(device)))
    return int(psutil.virtual_memory().available * 0.5 * (1 - AUTO_MARGIN_FRACTION) / ranks_per_host)


def device_share(free_bytes: int) -> int:
    """An "auto" device budget: ``free_bytes`` of a GPU less the margin (measured, or a named GPU's total)."""
    return max(0, int(free_bytes - max(AUTO_MARGIN_MIN_BYTES, free_bytes * AUTO_MARGIN_FRACTION)))


HOST_MARGIN_FRACTION = 0.10
"""Pinned memory cannot be swapped out: "auto" leaves this share of *total* RAM (at least 4 GiB) to the
process itself and the OS, so a full host tier never wakes the OOM killer."""


def auto_host_budget(device: torch.device, ranks_per_host: int = 1) -> int:
    """Available host RAM less the margin, split between the ranks on this host (and halved when the
    device tier is host RAM too)."""
    memory = psutil.virtual_memory()
    return host_share(memory.available, memory.total, ranks_per_host, share=0.5 if device.type == "cpu" else 1.0)


def host_share(available_bytes: int, total_bytes: int, ranks_per_host: int = 1, *, share: float = 1.0) -> int:
    """One rank's "auto" host budget: available RAM less the margin on the total, times ``share``, split between
    the host's ranks (measured here, or a named host's RAM, all of it available)."""
    usable = available_bytes - max(4 * 2**30, int(total_bytes * HOST_MARGIN_FRACTION))
    return max(0, int(usable * share / ranks_per_host))


def build_tiers(device: torch.device, device_budget: int | None, host_budget: int | None,
                ranks_per_host: int = 1) -> tuple[Tier, Tier]:
    """The device and host tiers, with "auto" (None) budgets measured now (the host's shared by its ranks)."""
    device_tier = Tier(DEVICE, device, device_budget if device_budget is not None
                       else auto_device_budget(device, ranks_per_host))
    host_tier = Tier(HOST, torch.device("cpu"), host_budget if host_budget is not None
                     else auto_host_budget(device, ranks_per_host), pin_memory=device.type == "cuda")
    return device_tier, host_tier


ALLOC_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
"""Where a user sets the CUDA caching allocator's options (torch reads either)."""


def use_expandable_segments(device: torch.device) -> str:
    """Turn on the CUDA allocator's expandable segments, unless the environment already decides; returns what was done.

    Under a tight device budget the caching allocator's fixed-size segments fragment: a 22 GB cap lost 1.39-1.42
    GiB to memory "reserved by PyTorch but unallocated" and an allocation the plan had room for failed
    (bench/results/HISTORY.md, the 10B and 6.9B runs). Expandable segments map one growing segment per stream
    instead, so what is freed can be reused whatever its size. Segments made before this call stay as they were, and the
    warm-up's re-plan adds what the allocator still holds unallocated at its peak to the non-model reserve
    (:class:`~zero_cache.runtime.nonmodel.NonModelMeter`).
    """
    if device.type != "cuda":
        return "not a CUDA device"
    settings = " ".join(os.environ.get(name, "") for name in ALLOC_CONF_VARIABLES)
    if "expandable_segments" in settings:
        return f"left as the environment sets it ({settings.strip()})"
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    try:
        if setter is not None:
            setter("expandable_segments:True")
        else:  # torch < 2.9
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    except (RuntimeError, AttributeError) as err:  # an allocator that has no such option (a custom one)
        return f"unavailable ({err}); the re-plan keeps the allocator's measured slack as a margin instead"
    return "turned on"
