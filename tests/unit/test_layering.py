"""The import rules of DESIGN.md ("Layers and the rule of imports"), read from the source with ``ast``.

``zero_cache``, ``moe`` and ``autopipe`` never import ``angelptm`` or each other, at any depth (a function-level
import counts: it runs the same code); and no ``angelptm`` modules import each other in a circle, not even through
a function-level import (which only hides the circle: ``api`` <-> ``pipe.engine`` was one).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LIBRARIES = ("zero_cache", "moe", "autopipe")


def module_name(path: Path, root: Path = REPO) -> str:
    """``angelptm/engine/engine.py`` -> ``angelptm.engine.engine``; a package's ``__init__.py`` -> the package."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


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
    (fake / "b.py").write_text("import torch\nfrom moe import a\nfrom zero_cache.chunks import Chunk\n")
    assert library_violations(sorted(fake.glob("*.py")), tmp_path) == ["moe/a.py: imports angelptm.engine",
                                                                       "moe/b.py: imports zero_cache.chunks"]
    circle = {"pkg": "from pkg import w\n", "pkg.x": "from pkg import y\n", "pkg.y": "import pkg.z\n",
              "pkg.z": "from . import x\n", "pkg.w": "def late():\n    import pkg.x\n"}
    assert import_circles(circle, {"pkg"}, top_level_only=True) == [["pkg.x", "pkg.y", "pkg.z"]]
    hidden = {**circle, "pkg.z": "def late():\n    from . import x\n"}
    assert import_circles(hidden, {"pkg"}, top_level_only=True) == []
    assert import_circles(hidden, {"pkg"}, top_level_only=False) == [["pkg.x", "pkg.y", "pkg.z"]]
