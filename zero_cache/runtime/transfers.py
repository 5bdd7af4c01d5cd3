"""Copies between the device and pinned host memory, on their own CUDA streams, counted and traced."""

from __future__ import annotations

import torch

from zero_cache.base.timeline import D2H, H2D, Timeline
from zero_cache.storage.tiers import TrafficCounter


class Transfers:
    """Copies between the device and pinned host memory on their own CUDA streams (plain copies on CPU).

    Every copy returns the event that marks its completion (None on CPU, where copies are synchronous).
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.d2h = torch.cuda.Stream(device) if self.cuda else None
        self.h2d = torch.cuda.Stream(device) if self.cuda else None
        self.traffic = TrafficCounter("d2h", "h2d")
        self.timeline = Timeline(device)
        """Where copies (and the optimizer's host jobs and waits) are recorded while a step is traced."""

    def mark(self) -> torch.cuda.Event | None:
        """An event after everything issued so far on the calling thread's current stream."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def copy(self, destination: torch.Tensor, source: torch.Tensor, direction: str,
             after: torch.cuda.Event | None = None, stream: torch.cuda.Stream | None = None
             ) -> torch.cuda.Event | None:
        """``destination.copy_(source)`` on the ``direction`` ("d2h" or "h2d") stream (or ``stream``), after
        ``after``."""
        num_bytes = source.numel() * source.element_size()
        self.traffic.add(direction, num_bytes)
        track = D2H if direction == "d2h" else H2D
        name = f"{num_bytes / 2**20:.0f} MiB" if self.timeline.recording else ""  # (no formatting off the trace)
        if not self.cuda:
            with self.timeline.on_stream(track, name, None):
                destination.copy_(source)
            return None
        stream = stream or (self.d2h if direction == "d2h" else self.h2d)
        with torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            with self.timeline.on_stream(track, name, stream):
                destination.copy_(source, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        if direction == "d2h" and source.device.type == "cuda":
            source.record_stream(stream)  # an autograd gradient must outlive the copy
        return done
