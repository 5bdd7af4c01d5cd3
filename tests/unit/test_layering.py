"""The import rules of DESIGN.md ("Layers and the rule of imports"), read from the source with ``ast``.

``zero_cache``, ``moe`` and ``autopipe`` never import ``angelptm`` or each other, at any depth (a function-level
import counts: it runs the same code); no library's modules import each other in a circle (``angelptm``'s, and
each of the three others'), not even through a function-level import (which only hides the circle: ``api`` <->
``pipe.engine`` was one, ``zero_cache.homes`` <-> ``zero_cache.nvme_home`` another); ``zero_cache``'s floors hold,
each importing only those below it: every module of ``zero_cache/plan/`` imports without torch (it is pure: deciding
is separate from doing) and imports nothing of the other floors; ``base/`` imports nothing of ``zero_cache``;
``config`` nothing of ``storage/`` and above; ``storage/`` nothing of ``runtime/`` or ``optim/``; ``runtime/``
nothing of ``optim/``; and no floor imports the composition on top (``attach``, ``warmup``, ``resolve``, the
package's ``__init__``). And ``angelptm`` and ``bench`` use only ``zero_cache``'s public names.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LIBRARIES = ("zero_cache", "moe", "autopipe")
ZERO_CACHE_LAYERS = ("plan", "base", "storage", "runtime", "optim")
"""zero_cache's sub-packages, lowest first: ``plan`` (pure deciding) and ``base`` (the timeline, ranks, the native
loader) are the two bottom floors, neither importing the other; ``config`` (one module, over them) sits under
``storage``; :data:`COMPOSITION` sits on top."""
COMPOSITION = ("attach", "warmup", "resolve")
"""The modules on top that compose the floors (with the package's ``__init__``, which loads the public names)."""
LAYERS_NOT_IMPORTED = {
    "plan": ("base", "config", "storage", "runtime", "optim", *COMPOSITION),
    "base": ("plan", "config", "storage", "runtime", "optim", *COMPOSITION),
    "config": ("storage", "runtime", "optim", *COMPOSITION),
    "storage": ("runtime", "optim", *COMPOSITION),
    "runtime": ("optim", *COMPOSITION),
    "optim": COMPOSITION,
}
"""Floor (a sub-package of ``zero_cache``, or the module ``config``) -> what its modules never import (function-level
imports included): every floor not below it. None imports the package ``zero_cache`` itself either (its ``__init__``
reaches every floor's public names)."""
ZERO_CACHE_MODULES_IN_USE = {
    "zero_cache.storage.nvme": {"ALIGN_BYTES", "NvmeTier"},  # (bench/nvme_tier.py times the tier)
    "zero_cache.optim.host_adam": {"HostAdam", "torch_fused_adam"},  # (bench/host_adam.py times it)
    "zero_cache.optim.chunk_adam": {"state_gradient"},  # (bench/device_adam.py times the device's Adam
    "zero_cache.optim.device_adam": {"adam_in_one_pass"},  # in four passes and in one)
    "zero_cache.plan.tuning": {"MAX_TRIALS", "MEASURED_STEPS", "RESTARTS", "SETTLE_STEPS"},
    # (bench/host_memory.py sets the re-plan's probe against the host's Adam and copies, alone and at once, through a
    # host tier as the engine's)
    "zero_cache.runtime.rates": {"copy_load", "host_memory_rate", "measured_copies", "measured_host_memory"},
    "zero_cache.plan.step_cost": {"host_adam_bytes_per_element"},
    "zero_cache.storage.tiers": {"Tier"},
    "zero_cache.plan.host_memory": {"describe_host"},  # (pretrain.py --plan's "host use" line, as the logs say it)
}
"""Names ``angelptm`` and ``bench`` import from zero_cache's modules beside the package's ``__all__``: pinned, so
that the surface they use does not grow unnoticed (a new one goes in ``__all__``, or here with its reason)."""


def module_name(path: Path, root: Path = REPO) -> str:
    """``angelptm/engine/engine.py`` -> ``angelptm.engine.engine``; a package's ``__init__.py`` -> the package."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


PLAN_SIDE = tuple(sorted(module_name(path) for path in (REPO / "zero_cache" / "plan").glob("*.py")))
"""zero_cache's deciding modules, every module of ``zero_cache/plan/``: pure functions over plain dataclasses,
importable without torch."""


def imported_modules(source: str, module: str, is_package: bool, *, top_level_only: bool,
                     known: set[str] | frozenset[str] = frozenset()) -> set[str]:
    """Dotted names of the modules ``source`` imports: ``from X import Y`` gives ``X.Y`` where that is one of the
    ``known`` modules, else ``X``. (Importing ``X.Y`` also runs the package ``X``'s ``__init__``; that edge is
    left out, as every module would otherwise reach its package's ``__init__`` and back.)

    Relative imports are resolved against ``module``. With ``top_level_only``, imports inside functions are left
    out (they run at call time, so they cannot close a circle at import time), and so are those under
    ``if TYPE_CHECKING:``.
    """
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if top_level_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if top_level_only and isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[:len(package.split(".")) - (child.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in child.names:
                    found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
            visit(child)

    visit(ast.parse(source))
    return found


def library_violations(paths: list[Path], root: Path = REPO) -> list[str]:
    """``file: imports X`` for each import of ``angelptm`` or of another library by a library's module."""
    violations = []
    for path in paths:
        own = path.relative_to(root).parts[0]
        banned = {"angelptm", *LIBRARIES} - {own}
        imports = imported_modules(path.read_text(), module_name(path, root), path.name == "__init__.py",
                                   top_level_only=False)
        violations += [f"{path.relative_to(root)}: imports {name}" for name in sorted(imports)
                       if name.split(".")[0] in banned]
    return violations


def import_circles(modules: dict[str, str], packages: set[str], *, top_level_only: bool) -> list[list[str]]:
    """Circles among ``modules`` (name -> source; ``packages`` are those that are an ``__init__.py``) through
    their imports (module-level ones only, or all): Tarjan's strongly connected components of two or more."""
    graph = {name: sorted(target for target in imported_modules(source, name, name in packages,
                                                                top_level_only=top_level_only, known=set(modules))
                          if target in modules and target != name)
             for name, source in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in graph:
        if node not in index:
            connect(node)
    return circles


def test_libraries_import_neither_angelptm_nor_each_other() -> None:
    paths = [path for library in LIBRARIES for path in sorted((REPO / library).rglob("*.py"))]
    assert len(paths) > 30  # the three libraries were found
    assert library_violations(paths) == []


def test_angelptm_has_no_import_circle() -> None:
    paths = sorted((REPO / "angelptm").rglob("*.py"))
    modules = {module_name(path): path.read_text() for path in paths}
    assert len(modules) > 60 and "angelptm.engine.initialize" in modules
    assert import_circles(modules, {module_name(path) for path in paths if path.name == "__init__.py"},
                          top_level_only=False) == []


def test_the_checks_see_hidden_imports_and_circles(tmp_path) -> None:
    """The two checks catch what they are for: a function-level import of angelptm in a library, an import of a
    sibling library, and a circle of three modules closed by a ``from . import``, also when a function hides it."""
    fake = tmp_path / "moe"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "a.py").write_text("def f():\n    from angelptm.engine import engine\n")
    (fake / "b.py").write_text("import torch\nfrom moe import a\nfrom zero_cache.storage.chunks import Chunk\n")
    assert library_violations(sorted(fake.glob("*.py")), tmp_path) == ["moe/a.py: imports angelptm.engine",
                                                                       "moe/b.py: imports zero_cache.storage.chunks"]
    circle = {"pkg": "from pkg import w\n", "pkg.x": "from pkg import y\n", "pkg.y": "import pkg.z\n",
              "pkg.z": "from . import x\n", "pkg.w": "def late():\n    import pkg.x\n"}
    assert import_circles(circle, {"pkg"}, top_level_only=True) == [["pkg.x", "pkg.y", "pkg.z"]]
    hidden = {**circle, "pkg.z": "def late():\n    from . import x\n"}
    assert import_circles(hidden, {"pkg"}, top_level_only=True) == []
    assert import_circles(hidden, {"pkg"}, top_level_only=False) == [["pkg.x", "pkg.y", "pkg.z"]]


def test_the_planner_imports_without_torch() -> None:
    """In a fresh interpreter where ``import torch`` fails, every module of ``zero_cache/plan/`` imports, and a plan
    is made."""
    assert len(PLAN_SIDE) > 10 and {"zero_cache.plan", "zero_cache.plan.planner"} <= set(PLAN_SIDE)
    code = f"""
import importlib.abc, sys

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"torch is hidden ({{name}})")
        return None

sys.meta_path.insert(0, NoTorch())
for name in {PLAN_SIDE!r}:
    __import__(name)
from zero_cache import PlanInputs, make_plan
plan = make_plan(PlanInputs(num_chunks=4, chunk_numel=1024, param_bytes_per_element=2, device_budget_bytes=1 << 30,
                            host_budget_bytes=1 << 30))
assert plan.optimizer_tier == ("device",) * 4, plan
from zero_cache.plan.state_costs import STATE_FILL_ORDER
spilled = make_plan(PlanInputs(num_chunks=10, chunk_numel=1000, param_bytes_per_element=2, device_budget_bytes=40_000,
                               host_budget_bytes=100_000, nvme_budget_bytes=10**6, margin_fraction=0.0,
                               grad_bytes_per_element=0, trace=tuple(range(10)) + tuple(range(9, -1, -1))))
assert set(spilled.optimizer_tier) == set(STATE_FILL_ORDER) and spilled.traffic.disk_bytes > 0, spilled
assert "torch" not in sys.modules
print("pure")
"""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "pure", done.stderr


def test_what_the_plan_prices_is_what_the_homes_are() -> None:
    """One registry of home classes, one of their costs, with the same tier names; each class reads its answers from
    its costs (no second copy to drift)."""
    from zero_cache.plan.home_costs import DISK_BLOCK_BYTES, HOME_COSTS, OFF_DEVICE_FILL_ORDER
    from zero_cache.storage.nvme import ALIGN_BYTES
    from zero_cache.storage.param_homes.registry import HOME_CLASSES

    assert set(HOME_CLASSES) == set(HOME_COSTS) and set(OFF_DEVICE_FILL_ORDER) <= set(HOME_COSTS)
    assert ALIGN_BYTES == DISK_BLOCK_BYTES
    for name, cls in HOME_CLASSES.items():
        costs = HOME_COSTS[name]
        assert cls.costs is costs and cls.name == costs.name == name
        assert (cls.streams, cls.in_host_memory, cls.stages_updates, cls.device_steppable) == (
            costs.streams, costs.in_host_memory, costs.stages_updates, costs.device_steppable)
        assert cls.disk_bytes_per_step(6, 3, 5000, 2.0, 5) == costs.disk_bytes_per_step(6, 3, 5000, 2.0, 5)
        assert cls.host_bytes(6, 5000) == costs.host_bytes(6, 5000)


def test_what_the_plan_prices_is_what_the_state_homes_are() -> None:
    """The optimizer-state homes: one registry of classes, one of costs, the same tier names; each class reads its
    flags from its costs, and the planner's fill order names registered homes."""
    from zero_cache.plan.state_costs import STATE_COSTS, STATE_FILL_ORDER
    from zero_cache.storage.state_homes.registry import STATE_HOME_CLASSES

    assert set(STATE_HOME_CLASSES) == set(STATE_COSTS) and set(STATE_FILL_ORDER) <= set(STATE_COSTS)
    for name, cls in STATE_HOME_CLASSES.items():
        costs = STATE_COSTS[name]
        assert cls.costs is costs and cls.name == costs.name == name
        assert (cls.route, cls.resident, cls.device_steppable, cls.owned) == (
            costs.route, costs.resident, costs.device_steppable, costs.owned)


def floor_paths(floor: str, root: Path = REPO) -> list[Path]:
    """The files of a floor: a sub-package's, or the one module's (``config``)."""
    package = root / "zero_cache" / floor
    return sorted(package.rglob("*.py")) if package.is_dir() else [root / "zero_cache" / f"{floor}.py"]


def layer_violations(root: Path = REPO) -> list[str]:
    """``file: imports X`` for each import (function-level ones included) of a zero_cache floor by one below it that
    :data:`LAYERS_NOT_IMPORTED` rules out, and of the package ``zero_cache`` itself by any floor."""
    violations = []
    for layer, above in LAYERS_NOT_IMPORTED.items():
        banned = tuple(f"zero_cache.{name}" for name in above)
        for path in floor_paths(layer, root):
            imports = imported_modules(path.read_text(), module_name(path, root), path.name == "__init__.py",
                                       top_level_only=False)
            violations += [f"{path.relative_to(root)}: imports {name}" for name in sorted(imports)
                           if name in (*banned, "zero_cache") or name.startswith(tuple(f"{b}." for b in banned))]
    return violations


def test_zero_caches_layers_import_only_downwards() -> None:
    """Each floor imports only those below it: ``plan/`` and ``base/`` nothing of the others, ``config`` nothing of
    ``storage/`` and above, ``storage/`` nothing of ``runtime/`` or ``optim/``, ``runtime/`` nothing of ``optim/``,
    none the composition on top."""
    for layer in ZERO_CACHE_LAYERS:
        assert (REPO / "zero_cache" / layer / "__init__.py").is_file(), layer
    assert set(LAYERS_NOT_IMPORTED) == {*ZERO_CACHE_LAYERS, "config"}
    assert all((REPO / "zero_cache" / f"{name}.py").is_file() for name in (*COMPOSITION, "config"))
    assert len(floor_paths("storage")) > 10 and layer_violations() == []


def test_the_layer_check_sees_an_upward_import(tmp_path) -> None:
    """Upward imports from each kind of floor are caught (storage -> runtime included); downward ones are not."""
    for layer in ZERO_CACHE_LAYERS:
        (tmp_path / "zero_cache" / layer).mkdir(parents=True)
        (tmp_path / "zero_cache" / layer / "__init__.py").write_text("")
    (tmp_path / "zero_cache" / "config.py").write_text("from zero_cache.plan.units import AUTO\n"
                                                        "from zero_cache.storage import tiers\n")
    (tmp_path / "zero_cache" / "plan" / "a.py").write_text("def f():\n"
                                                            "    from zero_cache.runtime.jobs import JobQueue\n")
    (tmp_path / "zero_cache" / "base" / "c.py").write_text("from zero_cache.plan.tier_names import HOST\n")
    (tmp_path / "zero_cache" / "storage" / "b.py").write_text("from zero_cache.optim import optimizer\n"
                                                               "from zero_cache.base import timeline\n"
                                                               "from zero_cache.config import AioConfig\n"
                                                               "def f():\n"
                                                               "    from zero_cache.runtime import transfers\n")
    (tmp_path / "zero_cache" / "runtime" / "d.py").write_text("from zero_cache.storage import chunks\n"
                                                               "from zero_cache import attach\n")
    (tmp_path / "zero_cache" / "optim" / "e.py").write_text("import zero_cache.resolve\n")
    assert layer_violations(tmp_path) == ["zero_cache/plan/a.py: imports zero_cache.runtime.jobs",
                                          "zero_cache/base/c.py: imports zero_cache.plan.tier_names",
                                          "zero_cache/config.py: imports zero_cache.storage",
                                          "zero_cache/storage/b.py: imports zero_cache.optim",
                                          "zero_cache/storage/b.py: imports zero_cache.runtime",
                                          "zero_cache/runtime/d.py: imports zero_cache",
                                          "zero_cache/optim/e.py: imports zero_cache.resolve"]


@pytest.mark.parametrize("library", LIBRARIES)
def test_a_library_has_no_import_circle(library: str) -> None:
    """Among one library's modules, counting function-level imports too (they run the same code, later)."""
    paths = sorted((REPO / library).rglob("*.py"))
    modules = {module_name(path): path.read_text() for path in paths}
    assert len(modules) > 5
    assert import_circles(modules, {module_name(path) for path in paths if path.name == "__init__.py"},
                          top_level_only=False) == []


def zero_cache_uses(paths: list[Path], root: Path = REPO) -> list[str]:
    """``file:line: what`` for each use of zero_cache beyond its public names: an import of a module's name not in
    :data:`ZERO_CACHE_MODULES_IN_USE`, a package name (``from zero_cache import X``, ``zero_cache.X``) not in its
    ``__all__``, and a reach into a ZeRO-Cache optimizer's store (``optimizer.store``, ``getattr(x, "store")``)."""
    import zero_cache

    public = set(zero_cache.__all__)
    found = []
    for path in paths:
        tree = ast.parse(path.read_text())
        imports_package = any(isinstance(node, ast.Import) and any(a.name == "zero_cache" for a in node.names)
                              for node in ast.walk(tree))
        where = f"{path.relative_to(root)}"
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "zero_cache":
                allowed = public if node.module == "zero_cache" else ZERO_CACHE_MODULES_IN_USE.get(node.module, set())
                found += [f"{where}:{node.lineno}: from {node.module} import {a.name}" for a in node.names
                          if a.name not in allowed]
            elif isinstance(node, ast.Import):
                found += [f"{where}:{node.lineno}: import {a.name}" for a in node.names
                          if a.name.startswith("zero_cache.")]
            elif isinstance(node, ast.Attribute):
                if (imports_package and isinstance(node.value, ast.Name) and node.value.id == "zero_cache"
                        and node.attr not in public):
                    found.append(f"{where}:{node.lineno}: zero_cache.{node.attr}")
                owner = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(node.value, "id", "")
                if node.attr == "store" and "optimizer" in owner:
                    found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                  and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value == "store"
                  and "optimizer" in ast.unparse(node.args[0])):
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return sorted(found)


def test_angelptm_and_bench_use_only_zero_caches_public_names() -> None:
    paths = [path for top in ("angelptm", "bench") for path in sorted((REPO / top).rglob("*.py"))]
    assert len(paths) > 60
    assert zero_cache_uses(paths) == []


def test_the_public_names_check_sees_reaches(tmp_path) -> None:
    (tmp_path / "user.py").write_text(
        "import zero_cache\nfrom zero_cache import attach, ChunkStore\n"
        "from zero_cache.storage.chunks import ChunkStore\n"
        "def f(engine):\n    from zero_cache.storage.nvme import NvmeTier\n"
        "    zero_cache.make_plan, zero_cache.chunks\n"
        "    engine.optimizer.store.tiers, getattr(engine.optimizer, 'store', None), engine.optimizer.tier_usage()\n")
    assert zero_cache_uses([tmp_path / "user.py"], tmp_path) == [
        "user.py:2: from zero_cache import ChunkStore", "user.py:3: from zero_cache.storage.chunks import ChunkStore",
        "user.py:6: zero_cache.chunks", "user.py:7: engine.optimizer.store",
        "user.py:7: getattr(engine.optimizer, 'store', None)"]
