"""The tracked files speak of the project alone: of dates, commits and cards, never of the work periods a change was
made in, the provisioning names of the machines it was measured on, or which machines could be had. A result is
named by its date, card and commit (``bench/results/<date>-<card>-<what>-<commit>.<ext>``), a card as "1x H200".

The patterns are narrow on purpose: "session" alone (pytest's session, an HTTP session) and the buffers the NVMe
tier hands out for a probe (``ChunkStore``'s bounce-buffer accessor) are the project's own words and pass. The
examples the patterns must find are written below with a ``|`` inside a word, taken out before they are matched,
so that this file is scanned like every other."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = {
    "a work period": re.compile(r"\bsessions?[ _-]?\d+|\b(?:this|next|last|earlier|later|previous)\s+sessions?\b",
                                re.I),
    "a machine kind": re.compile(r"\bnvidia-[a-z]+\d+[a-z0-9-]*|\b[abh]\d00-x\d+\b", re.I),
    "where a machine came from": re.compile(
        r"\blent\s+(?:an?\s+|the\s+)?(?:[abh]\d00|gpus?\b|machines?\b|cards?\b|nodes?\b|image\b)"
        r"|\bthe\s+lent\s+[a-z0-9]|\b(?:was|were|been|not)\s+lent\b|\bloan(?:s|ed)?\b"
        r"|\bborrowed\s+(?:machines?|gpus?|cards?|nodes?)\b", re.I),
}
NAME_ONLY = {"a machine kind": re.compile(r"(?:^|[/_.-])[abh]\d00x\d+(?:[/_.-]|$)", re.I)}
"""A file name's card is written ``2xh200``, as "2x H200" reads; ``h200x2`` is the provisioning name's order."""


def offences(text: str, patterns: dict[str, re.Pattern]) -> list[str]:
    """Each forbidden phrase in ``text`` with what it speaks of, in order."""
    return [f"{what}: {match.group(0)!r}" for what, pattern in patterns.items() for match in pattern.finditer(text)]


def _tracked() -> list[str]:
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        pytest.skip(f"git is not usable here ({error})")
    if listed.returncode != 0:
        pytest.skip("not a git checkout: no tracked files to read")
    names = [name for name in listed.stdout.decode().split("\0") if name]
    assert len(names) > 100, names
    return names


def test_no_tracked_file_name_speaks_of_work_periods_machine_kinds_or_loans():
    bad = [f"{name}: {found}" for name in _tracked()
           for found in offences(name, {**FORBIDDEN, **NAME_ONLY})]
    assert not bad, "rename these by date, card and commit:\n" + "\n".join(bad)


def test_no_tracked_file_speaks_of_work_periods_machine_kinds_or_loans():
    bad = []
    for name in _tracked():
        path = ROOT / name
        if not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # an image, an archive
        for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), start=1):
            bad += [f"{name}:{number}: {found}" for found in offences(line, FORBIDDEN)]
    assert not bad, "say it with dates, commits and cards (\"1x H200\"):\n" + "\n".join(bad[:50])


@pytest.mark.parametrize("text", [
    "ses|sion 44", "Ses|sion 47: the H200 only", "ses|sions 38, 43, 44", "h100-matrix-10b-ses|sion46.out",
    "measured this ses|sion", "in the next ses|sion's run", "nvi|dia-h200", "`nvi|dia-h1|00-x1`",
    "device kind h2|00-x4",
    "the le|nt H200", "on the le|nt machines", "no H100 or 2x H200 was le|nt", "was not le|nt", "machine lo|ans",
    "a bor|rowed machine", "le|nt GPU image",
])
def test_the_patterns_find_each_way_of_saying_it(text):
    text = text.replace("|", "")
    assert offences(text, FORBIDDEN), text


@pytest.mark.parametrize("text", [
    "======== test session starts ========", '@pytest.fixture(scope="session")', "an HTTP session",
    "ends the whole session", "nvidia-smi", "def lent_bounce_buffer(self)", "which keeps its slots once lent them",
    "the NVMe tier's budget to lend one", "borrowed=True", "the probe borrows it", "1x H200, 2026-11-29, `561228c`",
    "2026-11-27-2xh200-matrix-6p9b-scaling-72e71da.out", "h200x2_6p9b_scaling",
])
def test_the_patterns_pass_the_projects_own_words(text):
    assert not offences(text, FORBIDDEN), text


def test_a_file_name_in_the_provisioning_order_is_caught():
    assert offences("bench/results/h200x4-moe-layer-4gpu.log", NAME_ONLY)
    assert not offences("bench/results/2026-11-27-4xh200-moe-layer-4gpu-cbc6809.log", NAME_ONLY)
