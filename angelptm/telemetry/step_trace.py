"""A picture of one training step: a Chrome/Perfetto trace and a PNG timeline, with the overlap share.

``engine.trace_next_step(directory)`` (or ``pretrain.py --trace DIR``) records the next step from
the start of its forward to the end of the following forward: host updates queued in the step's
backward may still run while the next forward starts, and that overlap is what the picture is for.
The tracks and how they are timed are :mod:`zero_cache.base.timeline`'s.

Writes ``DIR/step<N>.trace.json`` (open it in https://ui.perfetto.dev or chrome://tracing: one row
per track) and ``DIR/step<N>.png`` (needs matplotlib: ``pip install -e ".[plot]"``), and logs the
share of each track's work that ran while compute did.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from zero_cache import TRACKS, Interval, Timeline, overlap_shares

logger = logging.getLogger(__name__)


class StepTracer:
    """The engine's side of a traced step: arms, starts and stops a :class:`Timeline` around one step.

    Args:
        timeline: ZeRO-Cache's timeline (it also records copies, host jobs and disk requests), or one of its
            own for an engine without ZeRO-Cache (compute only).
    """

    def __init__(self, timeline: Timeline) -> None:
        self.timeline = timeline
        self._directory: Path | None = None
        self._phase = "idle"  # idle -> armed -> recording -> closing (the next forward) -> idle
        self._step = 0

    def arm(self, directory: str | Path, step: int) -> None:
        """Trace the step that starts with the next forward (global step ``step``)."""
        self._directory, self._step, self._phase = Path(directory), step, "armed"

    def forward_starts(self) -> None:
        if self._phase == "armed":
            self.timeline.start()
            self._phase = "recording"

    def forward_ended(self) -> list[Path]:
        """After the forward of the step following the traced one: write the files (returns their paths)."""
        if self._phase != "closing":
            return []
        self._phase = "idle"
        intervals = self.timeline.stop()
        return write_trace(intervals, self._directory, self._step)

    def finish(self) -> list[Path]:
        """Write what a trace in progress has recorded so far (the run ended before the next forward)."""
        if self._phase not in ("recording", "closing"):
            self._phase = "idle"
            return []
        self._phase = "closing"
        return self.forward_ended()

    def step_ended(self) -> None:
        if self._phase == "recording":
            self._phase = "closing"

    def phase(self, name: str) -> Any:
        """Context manager timing one phase (forward, backward, optimizer step) on the compute track."""
        return self.timeline.computing(name)


def write_trace(intervals: list[Interval], directory: Path, step: int) -> list[Path]:
    """Write the Chrome trace and (with matplotlib) the PNG of ``intervals``; returns the files written."""
    directory.mkdir(parents=True, exist_ok=True)
    shares = overlap_shares(intervals)
    trace = directory / f"step{step}.trace.json"
    trace.write_text(json.dumps(chrome_trace(intervals, shares)))
    written = [trace]
    logger.info("step %d traced: %s; %s", step, describe_shares(shares), trace)
    try:
        import matplotlib  # noqa: F401  (optional: the `plot` extra)
    except ImportError:
        logger.warning("no PNG of the step: matplotlib is not installed (pip install -e \".[plot]\"); "
                       "open %s in https://ui.perfetto.dev instead", trace)
        return written
    png = directory / f"step{step}.png"
    render_png(intervals, shares, png, title=f"step {step}")
    return [*written, png]


def describe_shares(shares: dict[str, float]) -> str:
    """``host Adam 87% hidden, H2D 99% hidden, ... (all work 91%)``."""
    parts = [f"{track} {share:.0%} hidden" for track, share in shares.items() if track != "all"]
    total = f" (all work {shares['all']:.0%} overlapped compute)" if "all" in shares else ""
    return (", ".join(parts) or "no host or copy work") + total


def chrome_trace(intervals: list[Interval], shares: dict[str, float]) -> dict[str, Any]:
    """The Chrome trace-event format (``X`` complete events, one thread row per track)."""
    tid = {track: index for index, track in enumerate(TRACKS)}
    events: list[dict[str, Any]] = [{"ph": "M", "pid": 0, "tid": tid[t], "name": "thread_name", "args": {"name": t}}
                                    for t in TRACKS]
    events += [{"ph": "M", "pid": 0, "tid": tid[t], "name": "thread_sort_index", "args": {"sort_index": tid[t]}}
               for t in TRACKS]
    events += [{"ph": "X", "pid": 0, "tid": tid[i.track], "name": i.name, "cat": i.track, "ts": i.start_us,
                "dur": max(i.duration_us, 0.0)} for i in intervals]
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"overlap_with_compute": {track: round(share, 4) for track, share in shares.items()}}}


def render_png(intervals: list[Interval], shares: dict[str, float], path: Path, *, title: str) -> None:
    """One row per track with its busy intervals, the overlap share of each written beside it."""
    import matplotlib

    matplotlib.use("Agg")  # no display
    import matplotlib.pyplot as plt

    tracks = [t for t in TRACKS if any(i.track == t for i in intervals)]
    figure, axes = plt.subplots(figsize=(14, 0.6 * len(tracks) + 1.4))
    colours = plt.get_cmap("tab10")
    for row, track in enumerate(tracks):
        spans = [(i.start_us / 1e3, i.duration_us / 1e3) for i in intervals if i.track == track]
        axes.broken_barh(spans, (row - 0.4, 0.8), facecolors=colours(row))
        if track in shares:
            end = max(i.end_us for i in intervals) / 1e3
            axes.text(end * 1.01, row, f"{shares[track]:.0%} hidden", va="center", fontsize=9)
    axes.set_yticks(range(len(tracks)), tracks)
    axes.invert_yaxis()
    axes.set_xlabel("ms since the step's forward started")
    axes.set_title(f"{title}: {describe_shares(shares)}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)

