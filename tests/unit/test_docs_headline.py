"""The README's headline is BENCHMARKS.md's: the same rows, the same figures, each with its card, date and commit.

``tools/headline.py`` copies the table; these tests fail when the copy is stale, and show that a changed figure on
either page is caught. The README keeps no hand-kept test count (it went stale)."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
from launch import load_script

ROOT = Path(__file__).resolve().parents[2]
CARDS = {"CPU", "H100", "H200", "2x H200", "4x H200"}
MEASURED = re.compile(r"^20\d\d-\d\d-\d\d, `[0-9a-f]{7,40}`(, `[0-9a-f]{7,40}`)*$")


def _tool():
    return load_script("tools/headline.py")


def _pages() -> tuple[str, str]:
    return (ROOT / "README.md").read_text(), (ROOT / "BENCHMARKS.md").read_text()


def test_the_readme_headline_rows_are_benchmarks_rows():
    tool = _tool()
    readme, benchmarks = _pages()
    ours = tool.rows(tool.headline_table(readme, "README.md"))
    theirs = tool.rows(tool.headline_table(benchmarks, "BENCHMARKS.md"))
    assert len(theirs) >= 6, "BENCHMARKS.md's headline table should hold the header and at least five rows"
    assert ours == theirs, f"README.md's headline differs from BENCHMARKS.md's; run `{tool.REGENERATE}`"
    assert tool.with_headline(readme, benchmarks) == readme, f"run `{tool.REGENERATE}`"


def test_every_headline_row_names_its_card_date_and_commit():
    tool = _tool()
    header, *body = tool.rows(tool.headline_table(_pages()[1], "BENCHMARKS.md"))
    assert header[1] == "card" and header[-1] == "measured", header
    for row in body:
        assert len(row) == len(header), row
        assert row[1] in CARDS, f"{row[0]!r}: card {row[1]!r} is not one of {sorted(CARDS)}"
        assert MEASURED.match(row[-1]), f"{row[0]!r}: 'measured' should read 'YYYY-MM-DD, `commit`', not {row[-1]!r}"


def test_a_changed_figure_on_either_page_is_caught_and_the_tool_restores_the_copy():
    """Change one random figure of the README's table, then of BENCHMARKS.md's: the rows differ, and the tool's copy
    makes the README equal BENCHMARKS.md's table again (so the first test can fail, and ``--check`` with it)."""
    tool = _tool()
    readme, benchmarks = _pages()
    start, end = tool.table_span(readme, "README.md")
    lines = readme.split("\n")
    rng = random.Random()
    row = rng.randrange(start + 2, end)
    figures = list(re.finditer(r"\d+\.\d+", lines[row]))
    assert figures, lines[row]
    hit = rng.choice(figures)
    decimals = len(hit.group().split(".")[1])
    changed = f"{float(hit.group()) + 10 ** -decimals:.{decimals}f}"  # one unit more in the last digit shown
    lines[row] = lines[row][:hit.start()] + changed + lines[row][hit.end():]
    stale = "\n".join(lines)
    benchmark_rows = tool.rows(tool.headline_table(benchmarks, "BENCHMARKS.md"))
    assert tool.rows(tool.headline_table(stale, "README.md")) != benchmark_rows
    assert tool.with_headline(stale, benchmarks) == readme
    edited_benchmarks = tool.with_headline(benchmarks, stale)  # BENCHMARKS.md carrying the changed figure
    assert edited_benchmarks != benchmarks
    assert tool.rows(tool.headline_table(edited_benchmarks, "BENCHMARKS.md")) != benchmark_rows
    assert tool.with_headline(readme, edited_benchmarks) == stale


def test_a_page_without_its_headline_table_is_named():
    tool = _tool()
    with pytest.raises(ValueError, match="README.md: no line '## Headline'"):
        tool.table_span("# AngelPTM\n\n| a | b |\n|---|---|\n| 1 | 2 |\n", "README.md")
    with pytest.raises(ValueError, match="no table between"):
        tool.table_span("## Headline\n\nprose\n\n## Two commands\n\n| a |\n|---|\n| 1 |\n", "README.md")


def test_the_readme_keeps_no_hand_kept_test_count():
    readme = _pages()[0]
    counts = re.findall(r"\b\d[\d,]*\s+(?:unit\s+|CPU\s+|GPU\s+)?(?:tests|passed|test cases)\b", readme)
    assert not counts, f"README.md states a test count that will go stale: {counts}"
