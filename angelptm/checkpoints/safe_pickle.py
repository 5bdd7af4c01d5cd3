"""What a checkpoint file may hold, and reading one without running code from it.

Unpickling can call any function a file names, so a checkpoint downloaded from anyone could run its
author's code. Every checkpoint file is therefore read by an unpickler that resolves only the globals
on an allowlist (:data:`ENGINE_GLOBALS`): the ones this engine's own checkpoints need (tensors and
parameters, OrderedDict, torch.Size, dtypes, devices, sets, bytes) and nothing else, whatever other
modules are installed or registered with torch. A file naming anything else is refused by name before
anything is built, and nothing it names runs. Saving checks the same rule, so a checkpoint that could
not be loaded is refused when it is written, not a week later when it is resumed.

``allow_unsafe_pickle=True`` (``load_checkpoint``; ``--allow-unsafe-pickle`` for ``pretrain.py`` and
``python -m angelptm.checkpoints.export``) adds one further fixed list (:data:`LEGACY_GLOBALS`): numpy
arrays (format-1 checkpoints pickled numpy's RNG key array) and ``argparse.Namespace`` (a common
``client_state``). It never admits arbitrary callables: ``os.system``, ``eval``, ``subprocess``,
``timeit.timeit``, ``pydoc.pipepager`` and the like are refused with or without it. (The name is kept for
DeepSpeed-style scripts that pass it; the option no longer unpickles without an allowlist.)

Why an allowlist: a denylist of "dangerous" modules was tried and failed (``timeit.timeit``, ``cProfile.run``
and ``pydoc.pipepager`` all run code and were not on it); the list of what a checkpoint holds is short
and known. It was found by saving each kind of checkpoint (plain engine, ZeRO-Cache, pipeline, with every
RNG state and a client_state of plain types) and listing every global their pickles name
(``tests/unit/test_checkpoint_safety.py`` does it again on every CI run).
"""

from __future__ import annotations

import _compat_pickle
import io
import logging
import pickle
import pickletools
import stat
import types
import zipfile
from pathlib import Path
from typing import Any, Mapping

import torch

from angelptm.errors import CheckpointError

logger = logging.getLogger(__name__)

OPT_IN = ("load_checkpoint(..., allow_unsafe_pickle=True), or --allow-unsafe-pickle for pretrain.py and "
          "python -m angelptm.checkpoints.export")
OPT_IN_HELP = ("also load numpy arrays and argparse.Namespace from a checkpoint (the previous format pickled numpy's "
               "RNG state as an array). Nothing else: a file naming any other Python class or function (os.system, "
               "eval, subprocess, timeit, ...) is refused with or without this option, and nothing in it runs")

_TORCH_DTYPES = frozenset(f"torch.{name}" for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype))
_TORCH_STORAGES = frozenset(f"torch.{name}" for name in dir(torch) if name.endswith("Storage"))
"""Storage types name a tensor's element type in its persistent id (torch.load maps them to dtypes itself)."""
ENGINE_GLOBALS = frozenset({
    "torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_parameter", "torch._utils._rebuild_parameter_with_state",
    "collections.OrderedDict", "torch.Size", "torch.device", "builtins.set", "builtins.frozenset",
    "builtins.bytearray", "builtins.complex", "builtins.slice", "builtins.range", "_codecs.encode",
}) | _TORCH_DTYPES | _TORCH_STORAGES
"""Every global this engine's checkpoints name (tensors, parameters, containers, dtypes, devices, bytes)."""
LEGACY_GLOBALS = frozenset({
    "numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct", "numpy.ndarray", "numpy.dtype",
    "numpy.core.multiarray.scalar", "numpy._core.multiarray.scalar", "argparse.Namespace",
}) | frozenset(f"numpy.dtypes.{kind}DType" for kind in (
    "UInt8", "UInt16", "UInt32", "UInt64", "Int8", "Int16", "Int32", "Int64", "Float16", "Float32", "Float64", "Bool"))
"""What ``allow_unsafe_pickle`` adds: numpy arrays and scalars (format-1 RNG state) and ``argparse.Namespace``."""


def _canonical(module: str, name: str) -> str:
    """``module.name`` with Python 2's names mapped as unpickling maps them (``__builtin__`` -> ``builtins``)."""
    module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
    return f"{_compat_pickle.IMPORT_MAPPING.get(module, module)}.{name}"


class _AllowlistUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only allowlisted globals (the Python docs' "Restricting Globals")."""

    allowed: frozenset[str] = ENGINE_GLOBALS
    stand_ins: Mapping[str, Any] = types.MappingProxyType({})

    def find_class(self, module: str, name: str) -> Any:
        canonical = _canonical(module, name)
        if canonical in self.stand_ins:
            return self.stand_ins[canonical]
        if canonical not in self.allowed:
            raise pickle.UnpicklingError(f"refused global {canonical}")
        return super().find_class(module, name)


def _pickle_module(allowed: frozenset[str], stand_ins: Mapping[str, Any] | None = None) -> types.ModuleType:
    """A stand-in ``pickle`` module for ``torch.load(pickle_module=...)`` whose unpickler admits ``allowed`` only
    (and resolves the names in ``stand_ins`` to the objects given there)."""
    module = types.ModuleType("angelptm_allowlist_pickle")
    module.Unpickler = type("Unpickler", (_AllowlistUnpickler,),
                            {"allowed": allowed, "stand_ins": types.MappingProxyType(dict(stand_ins or {}))})
    module.load = pickle.load  # torch reads only Unpickler from it
    module.__name__ = "angelptm_allowlist_pickle"
    return module


def allowlist_unpickler(allowed: frozenset[str]) -> type[pickle.Unpickler]:
    """An unpickler class that resolves only the globals in ``allowed`` (refusing others with
    ``pickle.UnpicklingError("refused global NAME")``)."""
    return _pickle_module(allowed).Unpickler


class _Stub:
    """Stands in for every global during :func:`pickle_globals`'s dry run: accepts any call or state, runs nothing."""

    def __new__(cls, *args: Any, **kwargs: Any) -> "_Stub":
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> "_Stub":
        return _Stub()

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


class _RecordingUnpickler(pickle.Unpickler):
    def __init__(self, handle: Any) -> None:
        super().__init__(handle)
        self.names: list[str] = []

    def find_class(self, module: str, name: str) -> Any:
        self.names.append(_canonical(module, name))
        return type("Stub", (_Stub,), {})

    def persistent_load(self, pid: Any) -> Any:
        return _Stub()


def pickle_globals(path: Path) -> list[str]:
    """Every ``module.name`` global the pickle of a ``torch.save`` archive names, in order, without duplicates.

    Found by a dry run in which each global is a stub that accepts any call (nothing the file names is
    imported or run), so names assembled from memoised strings are found as the real unpickler would.
    """
    # torch's own reader: the engine writes its archives without zip CRCs (angelptm.checkpoints.manifest), which
    # Python's zipfile would reject.
    with open(path, "rb") as handle, torch.serialization._open_zipfile_reader(handle) as archive:
        data = archive.get_record("data.pkl")
    return globals_of_pickle(data)


def globals_of_pickle(data: bytes) -> list[str]:
    """:func:`pickle_globals` of a pickle's bytes (an archive's ``data.pkl``)."""
    unpickler = _RecordingUnpickler(io.BytesIO(data))
    try:
        unpickler.load()
    except Exception:  # a damaged pickle: what was read up to there is all there is to name
        pass
    return list(dict.fromkeys(unpickler.names))


def refused_globals(path: Path, *, allow_unsafe_pickle: bool = False,
                    stand_ins: Mapping[str, Any] | None = None) -> list[str]:
    """The globals of ``path`` that loading refuses (with or without the opt-in; ``stand_ins`` as :func:`load`)."""
    allowed = ENGINE_GLOBALS | LEGACY_GLOBALS if allow_unsafe_pickle else ENGINE_GLOBALS
    allowed |= frozenset(stand_ins or ())
    try:
        return [name for name in pickle_globals(path) if name not in allowed]
    except Exception:  # a damaged file (torch's reader raises RuntimeError): the load itself reports it
        return []


def refuse_unsafe_objects(path: Path) -> None:
    """Raise when a just-written checkpoint file names globals that loading would refuse.

    Raises:
        CheckpointError: naming the file and the offending types, and how to store them instead.
    """
    refuse_unsafe_globals(refused_globals(path), path)


def refuse_unsafe_globals(names: list[str], path: Path) -> None:
    """Raise when ``names`` (the globals a file for ``path`` names) has any loading would refuse.

    Raises:
        CheckpointError: as :func:`refuse_unsafe_objects`.
    """
    refused = [name for name in names if name not in ENGINE_GLOBALS]
    if refused:
        raise CheckpointError(
            f"{path} would hold Python objects that loading refuses ({', '.join(refused)}). Checkpoints store "
            "tensors, numbers, strings, None, lists, tuples, sets and dicts; convert the rest (e.g. client_state="
            "{'args': vars(args)} for an argparse.Namespace, a numpy array as torch.from_numpy(array))")


def check_regular_file(path: Path) -> None:
    """Raise unless ``path`` is a regular file (a FIFO or /dev/zero would be read forever)."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    except OSError as err:
        raise CheckpointError(f"checkpoint file {path} cannot be read: {err}") from None
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"checkpoint file {path} is not a regular file (a directory, device or pipe): the "
                              "checkpoint is damaged or was tampered with")


def load(path: Path, *, allow_unsafe_pickle: bool = False, stand_ins: Mapping[str, Any] | None = None) -> Any:
    """Read one checkpoint file onto the CPU; only allowlisted globals are resolved, so nothing in it runs.

    Args:
        path: the file.
        allow_unsafe_pickle: also admit :data:`LEGACY_GLOBALS` (numpy arrays, ``argparse.Namespace``).
        stand_ins: ``module.name`` -> the object to build in its place: for files of another program (DeepSpeed's
            checkpoints name a few of its classes), read as plain data without importing that program.

    Raises:
        CheckpointError: missing, unreadable or not regular file, or a global off the allowlist (named).
    """
    check_regular_file(path)
    if not zipfile.is_zipfile(path):  # torch would answer with its mmap advice
        raise CheckpointError(_not_an_archive(path))
    allowed = ENGINE_GLOBALS | LEGACY_GLOBALS if allow_unsafe_pickle else ENGINE_GLOBALS
    try:
        # mmap: a tensor is read from disk when used, so a rank merging every rank's shard reads only its own.
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True,
                          pickle_module=_pickle_module(allowed, stand_ins))
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    except pickle.UnpicklingError as err:
        if "refused global" not in str(err):
            raise CheckpointError(f"cannot read checkpoint file {path}: {err}") from None
        refused = refused_globals(path, allow_unsafe_pickle=allow_unsafe_pickle, stand_ins=stand_ins) or \
            [str(err).split()[-1]]
    except Exception as err:  # a truncated or foreign file; say which one
        raise CheckpointError(f"cannot read checkpoint file {path}: {err}") from None
    raise CheckpointError(_refusal(path, refused, allow_unsafe_pickle))


def _refusal(path: Path, refused: list[str], allow_unsafe_pickle: bool) -> str:
    """Why ``path`` was not loaded, naming the globals; the opt-in is offered only when it would help."""
    names = ", ".join(refused)
    if not allow_unsafe_pickle and all(name in LEGACY_GLOBALS for name in refused):
        numpy = any(name.startswith("numpy.") for name in refused)
        why = ("numpy arrays, as checkpoints of the previous format hold numpy's RNG state" if numpy
               else "an argparse.Namespace")
        return (f"{path} holds {why} ({names}), which a checkpoint of this engine does not, so it was not loaded. "
                f"If you trust where this checkpoint comes from, opt in with {OPT_IN} (it admits numpy arrays and "
                "argparse.Namespace, nothing else)")
    return (f"{path} names {names}, which no checkpoint of this engine holds: loading resolves only an allowlist of "
            "tensor, container and dtype types, so the file was not loaded and nothing in it ran (it is hostile, "
            "damaged or not a checkpoint of this engine). allow_unsafe_pickle / --allow-unsafe-pickle will not load "
            "it either (it admits numpy arrays and argparse.Namespace only); resume from another checkpoint")


def _not_an_archive(path: Path) -> str:
    """Why a file that is not a ``torch.save`` zip archive (a raw pickle, or anything else) is not read."""
    named = [name for name in _raw_pickle_globals(path) if name not in ENGINE_GLOBALS]
    what = (f"; it is a raw pickle naming {', '.join(named)}, which no checkpoint holds: treat it as hostile"
            if named else "")
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
                    names.append(_canonical(*str(arg).split(" ", 1)))
                elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
                    names.append(_canonical(strings[-2], strings[-1]))
                elif isinstance(arg, str):
                    strings.append(arg)
    except Exception:  # not a pickle, or cut short: what was read so far is all there is to name
        pass
    return names
