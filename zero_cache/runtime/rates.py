"""This machine's rates for the plan's cost model: PCIe copies timed by a probe, the host's Adam by its own work.

A plan made before the first step compares placements at :data:`~zero_cache.plan.step_cost.NOMINAL_RATES` (an
H200's). Machines differ in the ratio that decides the placement: on an H100 the host's Adam ran
3.9 G elements/s over training steps against the H200's 4.3, and the floor of a 2.7B plan under a 22 GB cap
was 0.367 s at the nominal rates and 0.443 s at the measured ones (the step ran 0.537 s at best). From the
warm-up step on, plans use:

- **copies**: a probe of :data:`PROBE_BYTES` each way between a buffer of the host tier and the device, timed by
  CUDA events, the fastest of :data:`PROBE_REPEATS` (the bus alone; the step's copies then run beside compute);
- **disk** (where there is a swap file): a probe of up to :data:`PROBE_BYTES` written where the next slot of the
  optimizer groups' swap file goes and read back through the tier's own IO, timed on the host (reads and writes
  together, as the plan counts the step's disk bytes). On an H100's machine the steps with params on NVMe
  moved 9.0 GiB in 5.0 s where the nominal 1.0 GB/s priced them at 8.0 s;
- **device steps**: the elements of the host groups stepped on the device over the seconds from when each step's
  may start (backward and the device-held groups' Adam done) to its last copy out, taken over the tuning's steps
  like the host's Adam; only the step's prediction uses it (the plan's choices stay on the bus's rates);
- **device Adam**: the elements of the device-held groups over the seconds the device's Adam took on the compute
  stream each step; only the step's prediction uses it (a whole-GPU plan has no other work after backward);
- **host memory**: the host's two users of its memory at once, as a step runs them: the host's Adam over a scratch
  chunk of the host tier (:data:`HOST_MEMORY_PASSES` steps on its own threads) while pinned copies run both ways
  between the host tier and the GPU, queued to outlast it (:class:`CopyLoad`); every byte both moved over the
  Adam's seconds. A plain copy between two host buffers reads no such figure: on an H200's host it read 53 GB/s
  where the Adam and the copies together moved 133 (the Adam alone 97, the copies alone 89; ``bench/host_memory.py``),
  so the prediction said 1.39 s of a step that ran 0.71. Only the step's prediction uses it, on a GPU. The ranks of
  a host probe at about the same time, so each reads about its share;
- **host Adam**: the elements the host worker stepped over the seconds it spent in the update itself
  (inputs landed, before the new params leave), so contention with the copies and the training thread is in it;
  taken over the steps that tune the device-step count, not the warm-up (there, 2.7B on an H100 ran it
  at 1.0 G elements/s, the steps after at 3.9: first touches of the states' pages).

On a CPU-only run there is no bus and the "device" shares the host's cores: the nominal copy and Adam rates stay
(the disk is measured there too).

A probe runs at the first step's end, on a machine the plan has just filled, so it may meet a full one: no device
memory for its 64 MiB, no pinned memory, a full or failing disk (:data:`PROBE_FAILURES`). Then it logs why and the
plan keeps the rates it knew; a probe is a measurement, not a reason to end the run. (A full disk that the groups
on NVMe then need is the step's to report, where it happens.)
"""

from __future__ import annotations

import logging
import math
import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from typing import Callable, Iterator

import torch

from zero_cache.plan.step_cost import NOMINAL_RATES, Rates
from zero_cache.storage.nvme import ALIGN_BYTES, NvmeTier
from zero_cache.storage.tiers import Tier, TierFullError

logger = logging.getLogger(__name__)

PROBE_BYTES = 64 * 2**20
"""Bytes of one probe copy: enough to reach the bus's rate, little enough to fit beside any plan."""
PROBE_REPEATS = 3
MIN_PROBE_BYTES = 8 * 2**20
"""A probe shorter than this would time the launch more than the bus: below it (a full host tier) none is run."""
MIN_MEASURED_ELEMENTS = 1 << 20
"""Host Adam work below this many elements is too short to time; the rate it would give is not used."""
HOST_MEMORY_PROBE_BYTES = 2**30
"""Bytes of the host memory probe's scratch chunk (its copies' buffers come beside it)."""
MIN_HOST_MEMORY_PROBE_BYTES = 256 * 2**20
"""A shorter chunk may sit in the last-level cache and read fast: below it (a full host tier) none is run."""
HOST_MEMORY_PROBE_ROOM = 2 * PROBE_BYTES + MIN_HOST_MEMORY_PROBE_BYTES
"""Host tier bytes the host memory probe needs free: its copies' two buffers and the least scratch chunk (a plan
that leaves less runs no probe, as a full machine is not a failure)."""
HOST_MEMORY_PASSES = 4
"""Steps of the host's Adam the probe times (each over its whole chunk: 20-40 ms on an H200's host)."""
COPY_MARGIN = 3.0
"""Copies the probe queues, over those that would last its Adam's steps at the Adam's rate alone (the copies slow
it: 1.6x on an H200's host)."""
PROBE_FAILURES = (torch.OutOfMemoryError, TierFullError, OSError)
"""What a probe may meet on a full machine: no device or pinned memory for its buffer, a full or failing disk."""


class Throughput:
    """Work done and the seconds it took, added by the thread that does it (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.elements, self.seconds = 0, 0.0

    def add(self, elements: int, seconds: float) -> None:
        with self._lock:
            self.elements += elements
            self.seconds += seconds

    def take(self) -> tuple[int, float]:
        """The work and seconds so far; starts again from zero."""
        with self._lock:
            taken = self.elements, self.seconds
            self.elements, self.seconds = 0, 0.0
        return taken


def copy_rates(device: torch.device, host_tier: Tier, nbytes: int = PROBE_BYTES) -> tuple[float, float] | None:
    """(host->device, device->host) bytes per second of pinned copies to and from ``device`` (a GPU); the host
    buffer comes from ``host_tier`` (pinned exactly, counted, given back after, whatever happens), None when it has
    no room."""
    nbytes = min(nbytes, host_tier.free_bytes)
    if nbytes < MIN_PROBE_BYTES:
        return None
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)  # (first: an OOM here takes nothing)
    host = host_tier.allocate(nbytes, torch.uint8, zero=False)
    try:
        stream = torch.cuda.Stream(device)
        best = {"h2d": float("inf"), "d2h": float("inf")}
        with torch.cuda.stream(stream):
            for _ in range(PROBE_REPEATS):
                for way, (into, source) in (("h2d", (on_device, host)), ("d2h", (host, on_device))):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record(stream)
                    into.copy_(source, non_blocking=True)
                    end.record(stream)
                    end.synchronize()
                    best[way] = min(best[way], start.elapsed_time(end) / 1e3)
    finally:
        host_tier.free(host)
    return nbytes / best["h2d"], nbytes / best["d2h"]


HostWork = Callable[[torch.Tensor], Callable[[], int]]
"""Prepares host work over a scratch buffer (bytes of host memory) and answers a function that runs one pass of it
and returns the bytes that pass moved through the host's memory
(:meth:`zero_cache.optim.host_adam.HostAdam.probe_work`)."""


class CopyLoad:
    """Pinned copies of :data:`PROBE_BYTES` both ways between buffers of the host tier and a GPU, each way on its own
    stream, queued to load the bus and the host's memory beside host work; how many bytes they moved between two
    marks. :func:`copy_load` gives its buffers back."""

    def __init__(self, device: torch.device, host_tier: Tier, known: Rates, nbytes: int = PROBE_BYTES) -> None:
        self.device, self.host_tier, self.nbytes = device, host_tier, nbytes
        self.rates = {"h2d": known.h2d_bytes_per_s, "d2h": known.d2h_bytes_per_s}
        self.streams = {way: torch.cuda.Stream(device) for way in self.rates}
        self.marker = torch.cuda.Stream(device)  # (idle: an event recorded on it completes at once)
        self.ends: dict[str, list[torch.cuda.Event]] = {way: [] for way in self.rates}
        on_device = {way: torch.empty(nbytes, dtype=torch.uint8, device=device) for way in self.rates}
        self.pinned: dict[str, torch.Tensor] = {}
        try:
            for way in self.rates:  # (after the device's: an OOM there takes nothing)
                self.pinned[way] = host_tier.allocate(nbytes, torch.uint8, zero=False)
        except BaseException:
            self.close()  # (the one it took)
            raise
        self.pairs = {"h2d": (on_device["h2d"], self.pinned["h2d"]), "d2h": (self.pinned["d2h"], on_device["d2h"])}

    def queue(self, seconds: float) -> None:
        """Enough copies each way to run ``seconds`` at the known rates (and two more)."""
        for way, (into, source) in self.pairs.items():
            with torch.cuda.stream(self.streams[way]):
                for _ in range(math.ceil(seconds * self.rates[way] / self.nbytes) + 2):
                    into.copy_(source, non_blocking=True)
                    self.ends[way].append(torch.cuda.Event(enable_timing=True))
                    self.ends[way][-1].record(self.streams[way])

    def mark(self) -> torch.cuda.Event:
        """An event for this moment on the GPU's clock."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.marker)
        return event

    def moved_between(self, first: torch.cuda.Event, last: torch.cuda.Event | None = None) -> int:
        """Bytes of the copies that ended after ``first`` and by ``last`` (every one after ``first`` where ``last`` is
        None); waits for every queued copy."""
        torch.cuda.synchronize(self.device)
        until = math.inf if last is None else first.elapsed_time(last)
        return self.nbytes * sum(0 < first.elapsed_time(end) <= until for ends in self.ends.values() for end in ends)

    def outlasted(self, first: torch.cuda.Event, last: torch.cuda.Event) -> bool:
        """Whether copies ran each way until ``last``: where one way's ran out earlier, they did not load the whole
        span, and the bytes :meth:`moved_between` the two count would undercount what the span could move."""
        torch.cuda.synchronize(self.device)
        until = first.elapsed_time(last)
        return all(ends and first.elapsed_time(ends[-1]) >= until for ends in self.ends.values())

    def close(self) -> None:
        try:
            torch.cuda.synchronize(self.device)  # (no copy may still read or write a buffer given back)
        finally:
            for buffer in self.pinned.values():
                self.host_tier.free(buffer)
            self.pinned, self.pairs = {}, {}  # (their bytes are back in the tier: no reference is kept)


@contextmanager
def copy_load(device: torch.device, host_tier: Tier, known: Rates, nbytes: int = PROBE_BYTES) -> Iterator[CopyLoad]:
    """A :class:`CopyLoad` of ``nbytes`` copies, its pinned buffers given back to ``host_tier`` whatever happens."""
    load = CopyLoad(device, host_tier, known, nbytes)
    try:
        yield load
    finally:
        load.close()


def host_memory_rate(host_tier: Tier, host_work: HostWork, bus: CopyLoad | None = None,
                     nbytes: int = HOST_MEMORY_PROBE_BYTES, clock: Callable[[], float] = time.perf_counter
                     ) -> float | None:
    """Bytes per second the host's memory reads and writes while ``host_work`` (the host's Adam) runs
    :data:`HOST_MEMORY_PASSES` passes over a scratch buffer from ``host_tier`` (given back after, whatever happens)
    and ``bus`` (on a GPU) copies both ways meanwhile: both users' bytes over the passes' seconds. None without room
    for :data:`MIN_HOST_MEMORY_PROBE_BYTES`, or where the copies ran out before the passes did (logged)."""
    nbytes = min(nbytes, host_tier.free_bytes)
    if nbytes < MIN_HOST_MEMORY_PROBE_BYTES:
        return None
    buffer = host_tier.allocate(nbytes, torch.uint8, zero=False)
    try:
        one_pass = host_work(buffer)  # (its pages touched)
        start = clock()
        one_pass()
        alone = clock() - start
        if bus is not None:
            queued = HOST_MEMORY_PASSES * alone * COPY_MARGIN
            bus.queue(queued)
            first = bus.mark()
        start = clock()
        moved = sum(one_pass() for _ in range(HOST_MEMORY_PASSES))
        seconds = clock() - start
        if bus is not None:
            last = bus.mark()
            if not bus.outlasted(first, last):
                logger.warning("ZeRO-Cache: the host memory probe's copies, queued for %.3f s, ended before its "
                               "Adam's %.3f s; its figure would undercount and is not used", queued, seconds)
                return None
            moved += bus.moved_between(first, last)
    finally:
        host_tier.free(buffer)
    return moved / seconds if seconds > 0 else None


def measured_host_memory(device: torch.device, host_tier: Tier, host_work: HostWork | None,
                         known: Rates = NOMINAL_RATES) -> Rates:
    """``known`` with the host memory probe's rate (``host_work`` beside copies at ``known``'s bus rates), on a GPU
    (the step's prediction is checked there); unchanged on a CPU-only run, without host work to time, without
    :data:`HOST_MEMORY_PROBE_ROOM` in the host tier, or where the probe fails (:func:`_probed`)."""
    if device.type != "cuda" or host_work is None or host_tier.free_bytes < HOST_MEMORY_PROBE_ROOM:
        return known

    def probe() -> Rates:
        with copy_load(device, host_tier, known) as bus:
            rate = host_memory_rate(host_tier, host_work, bus)
        return known if rate is None else replace(known, host_memory_bytes_per_s=rate)

    return _probed("host memory", probe, known)


def _probed(what: str, probe: Callable[[], Rates], known: Rates) -> Rates:
    """``probe()``'s rates, or ``known`` (logged) where it meets a full machine (:data:`PROBE_FAILURES`)."""
    try:
        return probe()
    except PROBE_FAILURES as error:
        # The text, not the error: a log record keeps its args, and the error's traceback would keep the probe's
        # frames alive with it, and their buffers (a GPU test's records held 128 MiB of device memory an engine).
        logger.warning("ZeRO-Cache: the %s probe failed (%s: %s); the plan keeps the rates it knew: %s", what,
                       type(error).__name__, str(error), known.describe())
        return known


def measured_copies(device: torch.device, host_tier: Tier, known: Rates = NOMINAL_RATES) -> Rates:
    """``known`` with the copy probe's rates on a GPU; unchanged on a CPU-only run (no bus), without host room, or
    where the probe fails (:func:`_probed`)."""
    if device.type != "cuda":
        return known

    def probe() -> Rates:
        rates = copy_rates(device, host_tier)
        if rates is None:
            return known
        return replace(known, h2d_bytes_per_s=rates[0], d2h_bytes_per_s=rates[1], copies_measured=True)

    return _probed("PCIe copy", probe, known)


def measured_disk(nvme: NvmeTier | None, host_tier: Tier, known: Rates = NOMINAL_RATES,
                  bounce: torch.Tensor | None = None) -> Rates:
    """``known`` with the disk's rate from a probe of the optimizer groups' swap file (:meth:`NvmeTier.time_io`):
    bytes written and read back over the seconds both took. The probe's buffer is ``bounce`` (a free swap bounce
    buffer, already in the host's plan where groups are on disk, so a full host tier does not stop the probe), else
    taken from the host tier's room and given back. Unchanged without a swap file or room in its budget, where a
    slot or the buffer is under :data:`MIN_PROBE_BYTES` (too short to time), or where the probe fails (a full disk:
    :func:`_probed`)."""
    if nvme is None:
        return known
    room = bounce.numel() if bounce is not None else host_tier.free_bytes - ALIGN_BYTES
    nbytes = min(PROBE_BYTES, nvme.slot_bytes, room) // ALIGN_BYTES * ALIGN_BYTES
    if nbytes < MIN_PROBE_BYTES:
        return known

    def probe() -> Rates:
        raw = None if bounce is not None else host_tier.allocate(nbytes + ALIGN_BYTES, torch.uint8, zero=False)
        start = 0 if raw is None else -raw.data_ptr() % ALIGN_BYTES
        try:
            timed = nvme.time_io((bounce if raw is None else raw)[start:start + nbytes])
        finally:
            if raw is not None:
                host_tier.free(raw)
        if timed is None or sum(timed) <= 0:
            return known
        return replace(known, disk_bytes_per_s=2 * nbytes / sum(timed), disk_measured=True)

    return _probed("swap file's disk", probe, known)


def _timed_rate(work: tuple[int, float]) -> float | None:
    """Elements per second over ``(elements, seconds)``, or None where that is too little work to time."""
    elements, seconds = work
    return elements / seconds if elements >= MIN_MEASURED_ELEMENTS and seconds > 0 else None


NO_WORK = (0, 0.0)
"""``(elements, seconds)`` of nothing timed."""


def with_timed_work(rates: Rates, *, host_adam: tuple[int, float] = NO_WORK, device_steps: tuple[int, float] = NO_WORK,
                    device_adam: tuple[int, float] = NO_WORK) -> Rates:
    """``rates`` with the rates of the work training steps timed, each as ``(elements, seconds)``, where that is
    enough work to time (:data:`MIN_MEASURED_ELEMENTS`); the others stay as they are:

    - ``host_adam``: the host worker's Adam (``HostUpdater.adam_work``), marked measured;
    - ``device_steps``: host groups stepped on the device, each step's from when they may start to their last copy
      out (``DeviceSteps.timing``); only the step's prediction uses it;
    - ``device_adam``: the device's Adam over the groups it holds, timed where it runs
      (``DeviceGroups.timing``, :mod:`zero_cache.optim.device_groups`); only the step's prediction uses it.
    """
    timed: dict[str, float | bool] = {}
    if (rate := _timed_rate(host_adam)) is not None:
        timed.update(host_adam_elements_per_s=rate, host_adam_measured=True)
    if (rate := _timed_rate(device_steps)) is not None:
        timed["device_step_elements_per_s"] = rate
    if (rate := _timed_rate(device_adam)) is not None:
        timed["device_adam_elements_per_s"] = rate
    return replace(rates, **timed)
