"""``deepspeed`` as another name of ``angelptm``, for libraries that import DeepSpeed themselves.

accelerate and Lightning run ``import deepspeed`` / ``from deepspeed.utils import logging`` inside their own
code, so ``import angelptm as deepspeed`` in a script does not reach them. :func:`install` puts a finder
first on ``sys.meta_path`` that answers every ``deepspeed`` and ``deepspeed.X.Y`` import with the module
``angelptm`` / ``angelptm.X.Y`` itself: the same module objects under two names, so classes compare equal
under either (``isinstance(engine, deepspeed.DeepSpeedEngine)``), and nothing of the real DeepSpeed loads.
A ``deepspeed.X`` that angelptm does not have fails with an ImportError naming it, rather than falling back
to the real package (half of each would mix two engines).

The installed *distribution* is untouched: ``importlib.metadata.version("deepspeed")`` still reads the
DeepSpeed wheel, which accelerate and Lightning compare against their minimum versions.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any, Iterator, Sequence

ALIAS, TARGET = "deepspeed", "angelptm"


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``deepspeed[.X]`` as ``angelptm[.X]``; loading returns the already imported target module."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != ALIAS and not fullname.startswith(ALIAS + "."):
            return None
        target_name = TARGET + fullname[len(ALIAS):]
        try:
            module = importlib.import_module(target_name)
        except ModuleNotFoundError as err:
            if err.name != target_name:
                raise
            raise ModuleNotFoundError(f"{fullname} is not provided by angelptm ({ALIAS!r} is aliased to {TARGET!r} "
                                      f"by angelptm.integrations); docs/deepspeed-compatibility.md lists what is",
                                      name=fullname) from None
        spec = importlib.machinery.ModuleSpec(fullname, self, is_package=hasattr(module, "__path__"))
        spec._angelptm_module = module  # type: ignore[attr-defined]
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return spec._angelptm_module  # type: ignore[attr-defined]

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the target module was imported (and executed) under its own name."""


def installed() -> bool:
    """Whether ``deepspeed`` resolves to ``angelptm`` in this process."""
    return sys.modules.get(ALIAS) is importlib.import_module(TARGET) or any(
        isinstance(finder, _AliasFinder) for finder in sys.meta_path)


def install() -> None:
    """Make ``import deepspeed`` (and every ``deepspeed.X``) give ``angelptm`` in this process from now on.

    Idempotent. Call it before any library imports DeepSpeed.

    Raises:
        ImportError: the real DeepSpeed was imported already: objects made from it would meet this engine's.
    """
    if any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
        return
    real = sys.modules.get(ALIAS)
    if real is not None and real is not importlib.import_module(TARGET):
        raise ImportError(f"the real DeepSpeed was imported before angelptm.integrations (by {_importer(real)}); "
                          "import angelptm.integrations.accelerate / .lightning first, at the top of the script")
    sys.meta_path.insert(0, _AliasFinder())
    importlib.import_module(ALIAS)  # sys.modules["deepspeed"] is angelptm from here on


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Within the block ``import deepspeed`` gives the installed DeepSpeed, also while it is this alias: what
    ZeRO-Cache's host Adam loads DeepSpeed's C++ Adam in (``zero_cache.attach``'s ``deepspeed_import``). Under the
    alias, accelerate's and Lightning's scripts would reach this engine's ``deepspeed.ops.adam``, a torch Adam without
    the C++ op.

    The alias's modules and finder step aside for the block and come back after it, the finder where it was. The real
    modules are imported once and kept in :data:`_REAL` between blocks: a second block gets the same classes, so
    DeepSpeedCPUAdam's optimizer ids keep counting (a fresh import would start them at 0 again and replace the first
    engine's C++ optimizer).
    """
    finders = [(index, finder) for index, finder in enumerate(sys.meta_path) if isinstance(finder, _AliasFinder)]
    if not installed():
        yield
        return
    hidden = {name: sys.modules.pop(name) for name in [n for n in sys.modules if _is_alias(n)]}
    for _, finder in finders:
        sys.meta_path.remove(finder)
    sys.modules.update(_REAL)
    try:
        yield
    finally:
        _REAL.update({name: sys.modules.pop(name) for name in [n for n in sys.modules if _is_alias(n)]})
        sys.modules.update(hidden)
        for index, finder in finders:  # (ascending: each goes back to its old place)
            sys.meta_path.insert(index, finder)


def _is_alias(name: str) -> bool:
    return name == ALIAS or name.startswith(ALIAS + ".")


_REAL: dict = {}
"""The real DeepSpeed's modules, by name, imported by :func:`suspended` while ``deepspeed`` was the alias."""


def _importer(module: Any) -> str:
    return getattr(module, "__file__", None) or repr(module)
