"""What a checkpoint file may hold, and reading one without running code from it.

``torch.load(weights_only=False)`` unpickles arbitrary objects, and unpickling can call any function
the file names: a checkpoint downloaded from anyone would run its author's code. Every checkpoint file
is therefore read with ``weights_only=True``, whose unpickler builds only tensors, numbers, strings,
``None`` and the containers (dict, list, tuple, OrderedDict, ...) that torch allowlists, plus types
registered with :func:`torch.serialization.add_safe_globals`. Saving checks the same rule, so a
checkpoint that would need unsafe loading is refused when it is written, not a week later when it is
resumed.

Checkpoints written before this rule (format 1: numpy RNG state, and whatever ``client_state``
held) load only with the explicit opt-in ``allow_unsafe_pickle=True`` (``load_checkpoint``), or
``--allow-unsafe-pickle`` (``pretrain.py``, ``python -m angelptm.checkpoints.export``), after a warning.
"""

from __future__ import annotations

import logging
import pickle
import pickletools
import zipfile
from pathlib import Path
from typing import Any

import torch

from angelptm.errors import CheckpointError

logger = logging.getLogger(__name__)

OPT_IN = ("load_checkpoint(..., allow_unsafe_pickle=True), or --allow-unsafe-pickle for pretrain.py and "
          "python -m angelptm.checkpoints.export")
OPT_IN_HELP = ("resume from a checkpoint of the previous format (numpy RNG state pickled as an array) by full "
               "unpickling: the file may then name any Python class or function and it is called while loading, so "
               "use it only for checkpoints whose origin you trust. Files naming functions that run commands or "
               "code (os.system, subprocess, eval, getattr, ...) are refused even so")

CODE_RUNNERS = frozenset({
    "os", "posix", "nt", "subprocess", "_posixsubprocess", "pty", "runpy", "importlib", "code", "codeop", "ctypes",
    "sys", "shutil", "socket", "pickle", "_pickle", "marshal", "types", "webbrowser", "multiprocessing", "signal",
    "pdb", "asyncio", "platform", "torch.hub", "torch.utils.cpp_extension",
})
"""Modules a pickle's globals must never come from: their functions run commands or code, or fetch more of it."""
CODE_RUNNING_NAMES = frozenset({
    "builtins.eval", "builtins.exec", "builtins.compile", "builtins.getattr", "builtins.setattr", "builtins.delattr",
    "builtins.__import__", "builtins.open", "builtins.breakpoint", "builtins.input", "builtins.globals",
    "builtins.vars", "operator.attrgetter", "operator.methodcaller", "functools.partial", "functools.reduce",
})
"""Single callables that reach any other (``getattr(os, "system")``): as dangerous as the modules above."""


def runs_code(name: str) -> bool:
    """Whether the pickle global ``module.name`` is a callable that can run commands or arbitrary code."""
    return name in CODE_RUNNING_NAMES or any(name == module or name.startswith(module + ".")
                                             for module in CODE_RUNNERS)


def unsafe_globals(path: Path) -> list[str]:
    """The classes and functions in ``path``'s pickle that a ``weights_only`` load refuses (read statically)."""
    try:
        return torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # a damaged file: the load itself reports it
        return []


def refuse_unsafe_objects(path: Path) -> None:
    """Raise when a just-written checkpoint file could only be loaded by running code.

    Raises:
        CheckpointError: naming the file and the offending types, and how to store them instead.
    """
    refused = unsafe_globals(path)
    if refused:
        raise CheckpointError(
            f"{path} would hold Python objects that a safe load cannot rebuild ({', '.join(refused)}). Checkpoints "
            "store tensors, numbers, strings, None, lists, tuples and dicts; convert the rest (e.g. client_state="
            "{'args': vars(args)} for an argparse.Namespace), or register the type with "
            "torch.serialization.add_safe_globals in both the saving and the loading program")


def load(path: Path, *, allow_unsafe_pickle: bool = False) -> Any:
    """Read one checkpoint file onto the CPU without running code from it.

    Args:
        path: the file.
        allow_unsafe_pickle: when the file holds objects beyond the safe types (a checkpoint of the
            previous format, or one from elsewhere), unpickle it fully after a warning. Only for
            files whose origin you trust: unpickling can execute arbitrary code.

    Raises:
        CheckpointError: missing or unreadable file, or unsafe objects without the opt-in.
    """
    if path.is_file() and not zipfile.is_zipfile(path):  # torch would answer with its mmap advice
        raise CheckpointError(_not_an_archive(path))
    try:
        # mmap: a tensor is read from disk when used, so a rank merging every rank's shard reads only its own.
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    except pickle.UnpicklingError as err:
        if "Weights only load failed" not in str(err):
            raise CheckpointError(f"cannot read checkpoint file {path}: {err}") from None
        refused = unsafe_globals(path) or [str(err).splitlines()[0]]
    except Exception as err:  # a truncated or foreign file; say which one
        raise CheckpointError(f"cannot read checkpoint file {path}: {err}") from None
    dangerous = [name for name in refused if runs_code(name)]
    if dangerous:  # no checkpoint needs these: never offer the opt-in, and refuse it
        raise CheckpointError(
            f"{path} names {', '.join(dangerous)}, which run{'s' if len(dangerous) == 1 else ''} commands or code "
            "when unpickled: no checkpoint needs that, so the file is hostile or not a checkpoint. It was not "
            "loaded, and allow_unsafe_pickle / --allow-unsafe-pickle will not load it either; delete it, or resume "
            "from another checkpoint")
    if not allow_unsafe_pickle:
        raise CheckpointError(
            f"{path} holds Python objects whose unpickling can run code ({', '.join(refused)}), so it was not loaded. "
            "Checkpoints written by earlier versions of this engine hold numpy RNG state this way. If you trust "
            f"where this checkpoint comes from, opt in with {OPT_IN}")
    logger.warning("loading %s with allow_unsafe_pickle: unpickling %s runs code named by the file; do this only "
                   "for checkpoints whose origin you trust", path, ", ".join(refused))
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as err:
        raise CheckpointError(f"cannot read checkpoint file {path}: {err}") from None


def _not_an_archive(path: Path) -> str:
    """Why a file that is not a ``torch.save`` zip archive (a raw pickle, or anything else) is not read."""
    named = [name for name in _raw_pickle_globals(path) if runs_code(name)]
    what = (f"; it is a raw pickle naming {', '.join(named)}, which run commands or code when unpickled: treat it "
            "as hostile" if named else "")
    return (f"{path} is not a torch.save archive (checkpoints of this engine are zip archives; this is a raw pickle "
            f"or another format), so it was not read{what}. Resume from another checkpoint, or save this one again "
            "with the engine")


def _raw_pickle_globals(path: Path, limit_bytes: int = 1 << 20) -> list[str]:
    """The ``module.name`` globals a raw pickle's opcodes import, read statically (nothing is unpickled)."""
    names, strings = [], []
    try:
        with open(path, "rb") as handle:
            for opcode, arg, _ in pickletools.genops(handle.read(limit_bytes)):
                if opcode.name in ("GLOBAL", "INST"):
                    names.append(str(arg).replace(" ", "."))
                elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
                    names.append(f"{strings[-2]}.{strings[-1]}")
                elif isinstance(arg, str):
                    strings.append(arg)
    except Exception:  # not a pickle, or cut short: what was read so far is all there is to name
        pass
    return names
