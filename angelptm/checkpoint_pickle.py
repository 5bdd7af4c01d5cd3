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
``--allow-unsafe-pickle`` (``pretrain.py``, ``python -m angelptm.export``), after a warning.
"""

from __future__ import annotations

import logging
import pickle
from pathlib import Path
from typing import Any

import torch

from angelptm.errors import CheckpointError

logger = logging.getLogger(__name__)

OPT_IN = ("load_checkpoint(..., allow_unsafe_pickle=True), or --allow-unsafe-pickle for pretrain.py and "
          "python -m angelptm.export")


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
