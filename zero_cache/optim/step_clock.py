"""How long a step and its backward take, as they run: what the device-step count's tuning is fed.

A step's one sync with the device is its gradient norm reaching the host, so the time from one norm to the next is
a whole step. The backward is timed where it runs: on CUDA by events on the compute stream (read only once the
device has passed them, so the step never waits for a timing), on the CPU by the clock itself.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from zero_cache.runtime.rates import Throughput


def stream_mark(stream: torch.cuda.Stream) -> torch.cuda.Event:
    """A timing event recorded on ``stream``: when the device reaches this point of it."""
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


def seconds_between(start: torch.cuda.Event | float, end: torch.cuda.Event | float) -> float | None:
    """Seconds from one mark (a :func:`stream_mark`, or a host clock's reading on CPU) to a later one; None where
    the device has not reached ``end`` yet (waiting for it here would stall the step)."""
    if not isinstance(start, torch.cuda.Event):
        return end - start
    return start.elapsed_time(end) / 1e3 if end.query() else None


class TimedSpans:
    """Work timed where it runs, a span a step, without waiting for the device: a span (from its first mark to its
    last, and the elements done between) is added to :attr:`work` once the device has passed its end. One still
    running at the next step (a step that leaves work to the next: the slow ones) is added at a later step, not
    dropped: dropping it biased the rate fast."""

    def __init__(self) -> None:
        self.work = Throughput()
        """Elements and the seconds their spans took, once finished."""
        self._span: tuple[Any, Any, int] | None = None  # this step's: (started, ended, elements), once it has work
        self._unfinished: list[tuple[Any, Any, int]] = []  # earlier steps' still running when the next began

    @property
    def open(self) -> bool:
        """Whether this step's span has started."""
        return self._span is not None

    def start(self, mark: torch.cuda.Event | float) -> None:
        """This step's span starts at ``mark`` (a :func:`stream_mark`, or the host clock on CPU)."""
        self._span = (mark, None, 0)

    def extend(self, mark: torch.cuda.Event | float, elements: int) -> None:
        """This step's span now ends at ``mark``, with ``elements`` more done in it."""
        started, _, done = self._span
        self._span = (started, mark, done + elements)

    def close_step(self) -> None:
        """A new step begins: add the spans the device has finished to :attr:`work`; keep the others for later."""
        if self._span is not None and self._span[1] is not None:
            self._unfinished.append(self._span)
        self._span = None
        running = []
        for started, ended, elements in self._unfinished:
            seconds = seconds_between(started, ended)
            if seconds is None:
                running.append((started, ended, elements))
            else:
                self.work.add(elements, seconds)
        self._unfinished = running

    def restart(self) -> None:
        """Drop what :attr:`work` holds and the spans not yet added to it."""
        self._span, self._unfinished = None, []
        self.work.take()


class StepClock:
    """Times each step (norm to norm) and each window's last engine backward (its start to the gradients' norm).

    Args:
        device: the compute device (CUDA: backward timed by stream events; otherwise by :attr:`clock`).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.clock: Callable[[], float] = time.perf_counter
        """What step times are read from (a fake one in tests)."""
        self._synced_at: float | None = None  # when the last step's norm reached the host
        self._backward_started: torch.cuda.Event | float | None = None  # the window's last engine backward's start
        self.last_backward_seconds: float | None = None
        """The last step's backward, from the start of the window's last engine backward to the gradients' norm,
        timed where it runs (the step's prediction, :meth:`~zero_cache.plan.step_cost.StepTraffic.predicted_step`)."""

    def mark(self) -> torch.cuda.Event | float:
        """Now, where the work runs: a timing event on the current stream on CUDA, the step clock on the CPU."""
        if self.device.type != "cuda":
            return self.clock()
        return stream_mark(torch.cuda.current_stream(self.device))

    def backward_starts(self) -> None:
        """An engine backward starts (the window's last one is the one timed)."""
        self._backward_started = self.mark()

    def norm_synced(self, backward_ended: torch.cuda.Event | float) -> float | None:
        """The step's gradient norm has reached the host; ``backward_ended``: a :meth:`mark` taken before the norm.
        Sets :attr:`last_backward_seconds`.

        Returns:
            Seconds since the last step's norm (the last step as it ran); None at the first step.
        """
        now = self.clock()
        step_seconds = None if self._synced_at is None else now - self._synced_at
        self._synced_at = now
        self.last_backward_seconds = (None if self._backward_started is None
                                      else seconds_between(self._backward_started, backward_ended))
        self._backward_started = None
        return step_seconds
