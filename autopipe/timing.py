"""Timers for the profiler and the runtime: whole calls, and per-call cost of back-to-back repeats.

:func:`sample_times_s` times one call per sample, for a whole graph or a stage (what the pipeline runs).
:func:`per_call_time_s` times one small op: ``calls`` back-to-back runs between two timestamps with no
synchronisation between them, divided by ``calls``. On a GPU the stream is first held by a spin kernel
(``torch.cuda._sleep``) long enough for the host to queue all the runs, so the events see the kernels back
to back, as in a real fused run where the host runs ahead of the GPU, and not the host's per-call Python and
launch cost.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

_MAX_HOLD_S = 0.05
"""Longest spin before one sample (the host queues at most this much work ahead)."""


def sample_times_s(run: Callable[[], Any], device: torch.device, *, warmup: int, repeats: int) -> list[float]:
    """Wall time of each of ``repeats`` timed calls of ``run()`` after ``warmup`` untimed ones.

    Args:
        run: the work to time.
        device: CUDA events are used for a CUDA device, a monotonic clock otherwise.
        warmup: untimed calls first.
        repeats: timed calls (>= 1).

    Returns:
        Seconds per call, in call order.
    """
    for _ in range(warmup):
        run()
    if device.type == "cuda":
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
        for start, end in pairs:
            start.record()
            run()
            end.record()
        torch.cuda.synchronize(device)
        return [start.elapsed_time(end) / 1e3 for start, end in pairs]
    samples = []
    for _ in range(repeats):
        begin = time.perf_counter()
        run()
        samples.append(time.perf_counter() - begin)
    return samples


def median_time_s(run: Callable[[], Any], device: torch.device, *, warmup: int, repeats: int) -> float:
    """Median of :func:`sample_times_s` (same arguments), in seconds."""
    return statistics.median(sample_times_s(run, device, warmup=warmup, repeats=repeats))


def spin_cycles_per_s(device: torch.device) -> float:
    """Clock rate of ``torch.cuda._sleep`` on ``device`` (cycles per second), measured once.

    Args:
        device: a CUDA device.

    Returns:
        Cycles per second.
    """
    cycles = 2_000_000
    torch.cuda._sleep(cycles)  # first launch loads the kernel
    seconds = median_time_s(lambda: torch.cuda._sleep(cycles), device, warmup=1, repeats=3)
    return cycles / max(seconds, 1e-9)


def per_call_time_s(run: Callable[[], Any], device: torch.device, *, warmup: int, repeats: int, calls: int,
                    cycles_per_s: float | None = None) -> float:
    """Per-call time of ``calls`` back-to-back runs of ``run()``: the fastest of ``repeats`` samples.

    The fastest, not the median: on a shared host another process only ever adds time, and it comes in
    bursts longer than one op's samples.

    Args:
        run: the op to time.
        device: CUDA events (with the stream held while the runs are queued) on a CUDA device, a monotonic
            clock otherwise.
        warmup: untimed runs first (at least one is made on CUDA, to size the hold).
        repeats: timed samples (>= 1); the fastest is kept.
        calls: runs per sample (>= 1).
        cycles_per_s: from :func:`spin_cycles_per_s`; CUDA only (measured here when None).

    Returns:
        Seconds per call.
    """
    if device.type != "cuda":
        for _ in range(warmup):
            run()
        samples = []
        for _ in range(repeats):
            begin = time.perf_counter()
            for _ in range(calls):
                run()
            samples.append((time.perf_counter() - begin) / calls)
        return min(samples)
    for _ in range(max(warmup - 1, 0)):
        run()
    torch.cuda.synchronize(device)
    begin = time.perf_counter()
    run()  # the host's cost of one call, with an idle queue
    host_s = time.perf_counter() - begin
    hold_cycles = int(min(2 * calls * host_s + 1e-4, _MAX_HOLD_S) * (cycles_per_s or spin_cycles_per_s(device)))
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in pairs:
        torch.cuda._sleep(hold_cycles)
        start.record()
        for _ in range(calls):
            run()
        end.record()
    torch.cuda.synchronize(device)
    return min(start.elapsed_time(end) / 1e3 / calls for start, end in pairs)
