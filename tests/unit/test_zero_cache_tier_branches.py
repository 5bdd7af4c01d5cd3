"""No branch on a tier's name outside the registries: the runtime and the planner ask a home (DESIGN.md, "A new home is
one new class").

A **tier comparison** is a comparison (``==``, ``!=``, ``is``, ``in``, ``not in``, ...) with a tier name on either
side: one of :mod:`zero_cache.plan.tier_names`' constants (``DEVICE``, ``HOST``, ``NVME``, ``REMOTE``, also as
``TierName.HOST``), one of its tuples (``OFF_DEVICE``, ``MEMORY_TIERS``), a tuple, list or set holding any of these,
or, in ``zero_cache``, the names spelled as strings (``"device"``, ``"host"``, ``"nvme"``, ``"remote"``). In
``angelptm`` the strings are left out: there ``"cpu"`` and ``"nvme"`` are DeepSpeed's JSON words for
``offload_*.device``, read at the config's edge; the tier names reach ``angelptm`` only through
``zero_cache.plan.tier_names``' constants. Subscripts (``tiers[HOST]``) and dict keys are lookups, not branches.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TIER_CONSTANTS = {"DEVICE", "HOST", "NVME", "REMOTE", "OFF_DEVICE", "MEMORY_TIERS"}
TIER_STRINGS = {"device", "host", "nvme", "remote"}
ALLOWED = {
    "angelptm/memory/plan_report.py": "the plan report: a row per tier",
}
"""File -> why it may compare tier names."""


def _names_a_tier(node: ast.AST, strings: bool) -> bool:
    if isinstance(node, ast.Name):
        return node.id in TIER_CONSTANTS
    if isinstance(node, ast.Attribute):  # TierName.HOST, tier_names.NVME
        return node.attr in TIER_CONSTANTS
    if isinstance(node, ast.Constant):
        return strings and isinstance(node.value, str) and node.value in TIER_STRINGS
    if isinstance(node, ast.Starred):
        return _names_a_tier(node.value, strings)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_tier(element, strings) for element in node.elts)
    return False


def tier_comparisons(source: str, *, strings: bool = True) -> list[str]:
    """``line: comparison`` for each comparison in ``source`` with a tier name on either side."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(_names_a_tier(side, strings)
                                                 for side in [node.left, *node.comparators]):
            found.append((node.lineno, node.col_offset, f"{node.lineno}: {ast.unparse(node)}"))
    return [hit for _, _, hit in sorted(found)]


def repo_tier_comparisons(root: Path = REPO) -> dict[str, list[str]]:
    """Relative path -> its tier comparisons, over ``zero_cache`` and ``angelptm`` (the allowed files left out)."""
    found = {}
    for top in ("zero_cache", "angelptm"):
        for path in sorted((root / top).rglob("*.py")):
            where = path.relative_to(root).as_posix()
            if where in ALLOWED:
                continue
            hits = tier_comparisons(path.read_text(), strings=top == "zero_cache")
            if hits:
                found[where] = hits
    return found


def test_no_module_branches_on_a_tier_name_outside_the_registries() -> None:
    assert len(list((REPO / "zero_cache").rglob("*.py"))) > 30  # (the package was found)
    assert repo_tier_comparisons() == {}


def test_every_exempt_file_still_compares_a_tier_name() -> None:
    """An exemption that is no longer used would hide a branch added to that file later."""
    for where in ALLOWED:
        assert tier_comparisons((REPO / where).read_text(), strings=where.startswith("zero_cache")), where


def test_the_scan_sees_every_spelling_of_a_tier_comparison() -> None:
    source = '''
if group.tier == DEVICE: pass
if tier != "nvme": pass
x = HOST if tier == NVME else tier
if group.tier in OFF_DEVICE: pass
if tier in (HOST, NVME): pass
if tier not in {DEVICE, *OFF_DEVICE}: pass
if NVME in tiers: pass
if TierName.REMOTE is tier: pass
if "host" == where: pass
'''
    assert [hit.split(":")[0] for hit in tier_comparisons(source)] == [str(line) for line in range(2, 11)]
    # (angelptm's scan: the constants only)
    assert [hit.split(":")[0] for hit in tier_comparisons(source, strings=False)] == ["2", "4", "5", "6", "7", "8",
                                                                                     "9"]


def test_lookups_and_other_strings_are_not_comparisons() -> None:
    source = '''
device = tiers[DEVICE].device
scratch = {name: 0 for name in (DEVICE, HOST)}
if device.type == "cuda": pass
if route is Route.HOST_ADAM: pass
count = plan.optimizer_tier.count(HOST)
if home.streams: pass
'''
    assert tier_comparisons(source) == []


def test_a_comparison_added_to_a_runtime_module_fails_the_scan(tmp_path) -> None:
    """The scan over the tree reports a new branch in a module it would otherwise pass (a copy of the repository's
    ``chunks.py`` with one comparison added)."""
    package = tmp_path / "zero_cache" / "storage"
    package.mkdir(parents=True)
    (tmp_path / "angelptm").mkdir()
    original = (REPO / "zero_cache" / "storage" / "chunks.py").read_text()
    (package / "chunks.py").write_text(original)
    assert repo_tier_comparisons(tmp_path) == {}
    (package / "chunks.py").write_text(original + "\n\ndef on_disk(group):\n    return group.tier == NVME\n")
    assert repo_tier_comparisons(tmp_path) == {"zero_cache/storage/chunks.py": [
        f"{len(original.splitlines()) + 4}: group.tier == NVME"]}
