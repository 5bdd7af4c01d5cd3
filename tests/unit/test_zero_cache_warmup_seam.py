"""The warm-up talks to the optimizer through its named surface and a typed observer, never through its parts (issue
53): read from the source, so a new reach into the host worker, the device steps, the store or the exchange fails
here, as does an attribute written onto the optimizer from outside."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WARMUP_SIDE = ("zero_cache/warmup.py", "zero_cache/tuning.py", "zero_cache/plan/tuning.py")
"""(``attach`` builds the optimizer's parts and registers hooks with it: it is the builder, not the warm-up.)"""
PARTS = {"host", "device_steps", "store", "exchange", "host_adam", "device_adam", "updates", "chunk_steps", "intake"}
"""The optimizer's collaborators, which only the optimizer itself uses."""
OPTIMIZER_NAMES = {"optimizer", "hybrid"}
"""What the warm-up side names a ZeRO-Cache optimizer."""


def reaches(path: Path) -> list[str]:
    """``name.part`` reads and ``name.anything = ...`` writes on an optimizer, as ``file:line: source``."""
    source = path.read_text()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in OPTIMIZER_NAMES:
            written = isinstance(node.ctx, ast.Store)
            if node.attr in PARTS or written:
                found.append((node.lineno, f"{path.name}:{node.lineno}: {ast.get_source_segment(source, node)}"
                                           f"{' =' if written else ''}"))
    return [reach for _, reach in sorted(found)]


def test_the_warm_up_reaches_no_part_of_the_optimizer_and_writes_nothing_onto_it():
    paths = [REPO / name for name in WARMUP_SIDE if (REPO / name).exists()]
    assert any(path.name == "warmup.py" for path in paths)
    assert [reach for path in paths for reach in reaches(path)] == []


def test_the_check_sees_a_reach_and_a_write(tmp_path):
    (tmp_path / "warmup.py").write_text("def f(optimizer, hybrid):\n    optimizer.host.adam_work.take()\n"
                                        "    optimizer.after_step = None\n    optimizer.step_timings()\n"
                                        "    hybrid.store.plan\n")
    assert reaches(tmp_path / "warmup.py") == ["warmup.py:2: optimizer.host", "warmup.py:3: optimizer.after_step =",
                                               "warmup.py:5: hybrid.store"]
