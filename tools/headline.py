"""Copy BENCHMARKS.md's headline table into the README, so the two cannot drift.

    python tools/headline.py            # rewrite the README's headline table from BENCHMARKS.md's
    python tools/headline.py --check    # exit 1 if the README's table is not BENCHMARKS.md's

BENCHMARKS.md is where a figure is measured and kept (with its card, date and commit); the README shows the same
rows. The table of each page is the first Markdown table after its ``## Headline`` heading.
``tests/unit/test_docs_headline.py`` fails when the README's copy is stale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BENCHMARKS = ROOT / "BENCHMARKS.md"
HEADING = "## Headline"
REGENERATE = "python tools/headline.py"


def table_span(text: str, page: str) -> tuple[int, int]:
    """The line range [start, end) of the first table after the page's ``## Headline`` heading."""
    lines = text.split("\n")
    try:
        heading = lines.index(HEADING)
    except ValueError:
        raise ValueError(f"{page}: no line {HEADING!r}; the headline table must follow that heading") from None
    start = heading + 1
    while start < len(lines) and not lines[start].startswith("|"):
        if lines[start].startswith("## "):
            raise ValueError(f"{page}: no table between {HEADING!r} and the next section {lines[start]!r}")
        start += 1
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    if end - start < 3:
        raise ValueError(f"{page}: the headline table has {max(end - start - 2, 0)} rows; it needs at least one")
    return start, end


def headline_table(text: str, page: str) -> list[str]:
    """The headline table's lines (header, rule and rows) as written on the page."""
    start, end = table_span(text, page)
    return text.split("\n")[start:end]


def rows(table: list[str]) -> list[list[str]]:
    """The table's cells, row by row, stripped (the header included, the ``|---|`` rule left out)."""
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in table
            if not set(line.replace("|", "").strip()) <= set("-: ")]


def with_headline(readme: str, benchmarks: str) -> str:
    """The README text with its headline table replaced by BENCHMARKS.md's."""
    start, end = table_span(readme, "README.md")
    lines = readme.split("\n")
    return "\n".join(lines[:start] + headline_table(benchmarks, "BENCHMARKS.md") + lines[end:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the README's table is stale")
    args = parser.parse_args(argv)
    readme, benchmarks = README.read_text(), BENCHMARKS.read_text()
    updated = with_headline(readme, benchmarks)
    if args.check:
        if updated != readme:
            print(f"README.md's headline table differs from BENCHMARKS.md's: run {REGENERATE}", file=sys.stderr)
            return 1
        return 0
    if updated != readme:
        README.write_text(updated)
        print("README.md: headline table copied from BENCHMARKS.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
