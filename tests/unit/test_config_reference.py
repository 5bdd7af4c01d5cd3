"""docs/configuration.md is generated from the config models and must match them; the docs' relative links resolve.

The reference is written by ``tools/config_reference.py``; a config key added, removed, renamed or re-documented
without regenerating it fails here, with the command that fixes it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from launch import load_script

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "configuration.md"


def _generator():
    return load_script("tools/config_reference.py")


def test_the_committed_reference_is_what_the_generator_writes_now():
    generator = _generator()
    expected = generator.render()
    committed = REFERENCE.read_text()
    assert committed == expected, (f"docs/configuration.md is stale: the config models changed. Regenerate it with "
                                   f"`{generator.REGENERATE}` and commit the result")


def test_the_generator_is_deterministic(tmp_path):
    """The same text from another process with another string-hash seed (a set's order leaking into the page would
    make it differ), and from a second render in this one."""
    generator = _generator()
    output = tmp_path / "configuration.md"
    subprocess.run([sys.executable, str(ROOT / "tools" / "config_reference.py"), "--output", str(output)], cwd=ROOT,
                   env={**os.environ, "PYTHONHASHSEED": "12345"}, check=True, capture_output=True, timeout=300)
    assert output.read_text() == generator.render() == generator.render()


def test_the_reference_holds_known_keys_with_their_defaults_and_docstrings():
    text = _generator().render()
    sections = {line[3:].strip() for line in text.splitlines() if line.startswith("## ")}
    for section in ("`zero_cache`", "`zero_optimization`", "`moe`", "`autopipe`", "`model`", "`data`", "`train`",
                    "`comms`", "`fp16`", "`bf16`"):
        assert section in sections, f"no {section} section in the reference"
    rows = {match.group(1): line for line in text.splitlines() if (match := re.match(r"\| `([A-Za-z0-9_]+)`", line))}
    # The zero_cache section's activation memory key, with its "auto" default and its docstring.
    assert "activation_memory" in rows and '`"auto"`' in rows["activation_memory"]
    assert "held back for activations" in rows["activation_memory"]
    assert "device_memory_budget" in rows and "param_home" in rows and "nvme_param_homes" in rows
    assert "timeout_s" in rows and "`600.0`" in rows["timeout_s"]
    assert "stage3_prefetch_bucket_size" in rows
    assert "hierarchical_all_to_all" in rows and "num_microbatches" in rows
    # A nested section and a scheduler's parameters get their own tables.
    assert "### `zero_cache.aio`" in text and "### `zero_optimization.offload_param`" in text
    assert '### `scheduler.params` for `"type": "WarmupCosineLR"`' in text
    assert "`zero_optimization.cpu_offload`" in text  # the deprecated keys' table


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]


LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_every_relative_link_in_the_readme_and_docs_points_to_a_file_that_exists():
    broken = []
    for page in _markdown_files():
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL, or an anchor on the same page
            path = target.split("#", 1)[0]
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "relative links to missing files:\n" + "\n".join(broken)


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives ``page``'s headings: lower case, punctuation but ``-`` and ``_`` dropped, spaces as
    ``-``, and ``-1``, ``-2`` ... after repeats (headings inside code blocks are not headings)."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        heading = None if in_code else re.match(r"#{1,6} (.*)", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return found


def test_every_anchor_of_a_link_to_a_page_names_one_of_its_headings():
    broken = []
    for page in _markdown_files():
        for target in LINK.findall(page.read_text()):
            path, _, anchor = target.partition("#")
            if re.match(r"[a-z]+:", target) or not anchor:
                continue
            linked = page.parent / path if path else page
            if linked.suffix == ".md" and linked.exists() and anchor not in _anchors(linked):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "links to headings that do not exist:\n" + "\n".join(broken)


def test_every_docs_page_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    linked = {Path(target.split("#", 1)[0]).as_posix() for target in LINK.findall(readme)}
    missing = [f"docs/{page.name}" for page in sorted((ROOT / "docs").glob("*.md"))
               if f"docs/{page.name}" not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"
