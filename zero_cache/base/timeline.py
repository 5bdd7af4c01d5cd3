"""A timeline of one training step: when each stream and thread was busy, for a picture of the overlap.

Tracks are named by what runs on them: ``compute`` (the training stream: forward, backward, the
optimizer step), ``H2D`` and ``D2H`` (ZeRO-Cache's copy streams), ``host Adam`` (the host worker's
jobs), ``disk`` (NVMe reads and writes) and ``waits`` (the training thread blocked on a chunk).

Times are taken where the work runs, so the picture is true to the device, not to the launch:

* on CUDA, a stream's interval is a pair of timing events recorded on that stream around its work,
  resolved against one base event recorded on an idle device when the timeline starts;
* on the CPU (the host worker, the training thread, every track of a CPU-only run), an interval is
  ``perf_counter_ns`` around the work on the thread that runs it;
* a disk request runs in the kernel or an IO thread: its interval starts at submission and ends when
  its completion is observed (at the latest when someone waits for it), an upper bound on the IO.

The compute track is the training stream's phases with the training thread's waits cut out of them
(the stream runs dry once it has run what was queued before the wait). A wait the stream itself
makes (on a copy's event) stays inside its phase: the picture then shows the copy overlapping
compute although compute was stalled on it, so shares of copy time hidden are upper bounds.

Recording costs two events per interval and is off unless a timeline is started.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch

COMPUTE, H2D, D2H, HOST_ADAM, DISK, WAITS = "compute", "H2D", "D2H", "host Adam", "disk", "waits"
TRACKS = (COMPUTE, H2D, D2H, HOST_ADAM, DISK, WAITS)
"""Every track, in the order they are drawn."""


@dataclass(frozen=True, slots=True)
class Interval:
    """One busy interval of one track, in microseconds since the timeline started."""

    track: str
    name: str
    start_us: float
    end_us: float

    @property
    def duration_us(self) -> float:
        return self.end_us - self.start_us


class Timeline:
    """Records busy intervals per track while started (thread-safe: the host worker records too).

    Args:
        device: the compute device; CUDA intervals are timed by events on their streams.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.recording = False
        self._lock = threading.Lock()
        self._cpu: list[tuple[str, str, int, int]] = []
        self._gpu: list[tuple[str, str, Any, Any]] = []
        self._base_ns = 0
        self._base_event: Any = None
        self._open: list[list[Any]] = []  # the training thread's compute phases in progress: [name, start]
        self._compute_thread: int | None = None

    def start(self) -> None:
        """Begin recording; on CUDA the device is synchronised once so the two clocks share an origin."""
        with self._lock:
            self._cpu.clear()
            self._gpu.clear()
        self._open.clear()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self._base_event = torch.cuda.Event(enable_timing=True)
            self._base_event.record(torch.cuda.current_stream(self.device))
            torch.cuda.synchronize(self.device)  # the base event has run: its time is now
        self._base_ns = time.perf_counter_ns()
        self.recording = True

    def stop(self) -> list[Interval]:
        """End recording and return every interval, sorted by start (synchronises the device once)."""
        self.recording = False
        if self.cuda:
            torch.cuda.synchronize(self.device)
        with self._lock:
            cpu, gpu = list(self._cpu), list(self._gpu)
        # (an interval begun before this recording started, in a thread, would start before 0: left out)
        intervals = [Interval(track, name, (start - self._base_ns) / 1e3, (end - self._base_ns) / 1e3)
                     for track, name, start, end in cpu if start >= self._base_ns]
        # A copy the host worker queued as recording stopped may still be running: leave it out.
        intervals += [Interval(track, name, 1e3 * self._base_event.elapsed_time(start),
                               1e3 * self._base_event.elapsed_time(end))
                      for track, name, start, end in gpu if start.query() and end.query()]
        return sorted(intervals, key=lambda interval: interval.start_us)

    # ------------------------------------------------------------------ recording
    @contextlib.contextmanager
    def on_thread(self, track: str, name: str) -> Iterator[None]:
        """Time the body on the calling thread (a no-op while not recording)."""
        if not self.recording:
            yield
            return
        start = time.perf_counter_ns()
        try:
            yield
        finally:
            self.add_cpu(track, name, start, time.perf_counter_ns())

    @contextlib.contextmanager
    def on_stream(self, track: str, name: str, stream: Any) -> Iterator[None]:
        """Time the work the body queues on ``stream`` (a copy stream); on the CPU, the body itself, which, run by
        the training thread (a fetch in a forward pre-hook), is not compute: it is cut out of the open phases."""
        if not self.recording:
            yield
            return
        if not self.cuda:
            with self._off_compute(only_on_its_thread=True), self.on_thread(track, name):
                yield
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        try:
            yield
        finally:
            end.record(stream)
            with self._lock:
                self._gpu.append((track, name, start, end))

    @contextlib.contextmanager
    def computing(self, name: str) -> Iterator[None]:
        """Time a phase of the training stream (forward, backward, step) on the ``compute`` track, leaving out
        the time the training thread waits inside it (:meth:`waiting`): the stream runs dry there."""
        if not self.recording:
            yield
            return
        self._compute_thread = threading.get_ident()
        self._open.append([name, self._mark()])
        try:
            yield
        finally:
            phase, start = self._open.pop()
            self._close(phase, start)

    @contextlib.contextmanager
    def waiting(self, name: str) -> Iterator[None]:
        """The training thread blocks (on the host worker): a ``waits`` interval, and a gap in the open compute
        phases. On CUDA the gap starts when the stream has run what was queued before the wait."""
        if not self.recording:
            yield
            return
        # Any thread: on CUDA the backward's hooks run on autograd's device thread, which waits for the step all the
        # same.
        with self._off_compute(only_on_its_thread=False), self.on_thread(WAITS, name):
            yield

    @contextlib.contextmanager
    def _off_compute(self, *, only_on_its_thread: bool) -> Iterator[None]:
        """Close the open compute phases for the body and reopen them after it."""
        if not self._open or (only_on_its_thread and threading.get_ident() != self._compute_thread):
            yield
            return
        for phase in self._open:
            self._close(phase[0], phase[1])
        try:
            yield
        finally:
            restart = self._mark()
            for phase in self._open:
                phase[1] = restart

    def _mark(self) -> Any:
        """Now on the training stream: an event recorded there (CUDA), or the thread's clock."""
        if not self.cuda:
            return time.perf_counter_ns()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _close(self, name: str, start: Any) -> None:
        end = self._mark()
        if self.cuda:
            with self._lock:
                self._gpu.append((COMPUTE, name, start, end))
        else:
            self.add_cpu(COMPUTE, name, start, end)

    def add_cpu(self, track: str, name: str, start_ns: int, end_ns: int) -> None:
        """An interval timed elsewhere with ``time.perf_counter_ns`` (e.g. a disk request's lifetime)."""
        if self.recording:
            with self._lock:
                self._cpu.append((track, name, start_ns, end_ns))

    def timed_request(self, request: Any, name: str) -> Any:
        """A disk request whose completion is recorded on the ``disk`` track when it is first observed."""
        return _TimedRequest(request, self, name) if self.recording else request


class _TimedRequest:
    """An IO request (``done()``/``wait()``) that records its lifetime once it is seen complete."""

    def __init__(self, request: Any, timeline: Timeline, name: str) -> None:
        self._request, self._timeline, self._name = request, timeline, name
        self._submitted_ns = time.perf_counter_ns()
        self._recorded = False

    def _record(self) -> None:
        with self._timeline._lock:  # two threads may see it complete
            first, self._recorded = not self._recorded, True
        if first:
            self._timeline.add_cpu(DISK, self._name, self._submitted_ns, time.perf_counter_ns())

    def done(self) -> bool:
        finished = self._request.done()
        if finished:
            self._record()
        return finished

    def wait(self) -> None:
        self._request.wait()
        self._record()


# ---------------------------------------------------------------------- interval arithmetic (pure)
def union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The disjoint, sorted union of ``(start, end)`` spans."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def covered(spans: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Length of the union of ``spans`` that lies inside the union of ``cover``."""
    total, mine, theirs = 0.0, union(spans), union(cover)
    j = 0
    for start, end in mine:
        while j < len(theirs) and theirs[j][1] <= start:
            j += 1
        k = j
        while k < len(theirs) and theirs[k][0] < end:
            total += min(end, theirs[k][1]) - max(start, theirs[k][0])
            k += 1
    return total


WORK_TRACKS = (H2D, D2H, HOST_ADAM, DISK)
"""The tracks whose work should hide behind compute (``waits`` is the training thread idle, not work)."""


def overlap_shares(intervals: list[Interval]) -> dict[str, float]:
    """The share of each work track's busy time during which compute was busy too (1.0: all of it hid behind
    compute), and under ``"all"`` the same for the union of the work tracks. Tracks never busy are left out."""
    cover = [(i.start_us, i.end_us) for i in intervals if i.track == COMPUTE]
    shares = {}
    for track in (*WORK_TRACKS, "all"):
        spans = [(i.start_us, i.end_us) for i in intervals
                 if (i.track in WORK_TRACKS if track == "all" else i.track == track)]
        busy = sum(end - start for start, end in union(spans))
        if busy > 0:
            shares[track] = covered(spans, cover) / busy
    return shares
