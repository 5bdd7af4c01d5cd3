"""``python -m angelptm.telemetry.trace_png TRACE.json [OUT.png]``: draw a step trace as a PNG (e.g. a trace written
on a GPU machine without matplotlib; needs ``pip install -e ".[plot]"`` here)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from angelptm.telemetry.step_trace import render_png
from zero_cache import Interval, overlap_shares


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split(":")[0].strip("`"))
    parser.add_argument("trace", type=Path, help="a step<N>.trace.json written by engine.trace_next_step")
    parser.add_argument("png", type=Path, nargs="?", help="output (default: the trace's name with .png)")
    args = parser.parse_args(argv)
    events = json.loads(args.trace.read_text())["traceEvents"]
    intervals = [Interval(e["cat"], e["name"], e["ts"], e["ts"] + e["dur"]) for e in events if e["ph"] == "X"]
    png = args.png or args.trace.with_name(args.trace.name.removesuffix(".trace.json") + ".png")
    render_png(intervals, overlap_shares(intervals), png, title=args.trace.name.removesuffix(".trace.json"))
    print(png)


if __name__ == "__main__":
    main()
