"""Atomic, resumable checkpoints in DeepSpeed's directory layout (``save_dir/tag/`` + ``save_dir/latest``).

Writing protocol (rank 0 coordinates, every rank writes its own RNG/data-position file):

1. write every file into ``save_dir/.tmp-<tag>/`` and fsync each one;
2. rename the temporary directory to ``save_dir/<tag>`` (an existing tag is first moved aside
   to ``.old-<tag>`` and removed only after the new one is in place);
3. fsync ``save_dir``, then replace ``latest`` atomically (write, fsync, ``os.replace``).

A crash at any point leaves ``latest`` naming a complete checkpoint: before step 2 the new files
sit in a temporary directory that the next save removes; between the two renames of step 2 the
loader falls back to ``.old-<tag>``.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed  # noqa: F401  (all_reduce of the save outcome)

from angelptm.distributed import DistContext
from angelptm.errors import CheckpointError

logger = logging.getLogger(__name__)

LATEST = "latest"
MODEL_FILE = "model_states.pt"
OPTIM_FILE = "optim_states.pt"
FORMAT_VERSION = 1


def rank_file(rank: int) -> str:
    """Name of the per-rank file (RNG state and data position)."""
    return f"rank_{rank:05d}_states.pt"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_durably(obj: Any, path: Path) -> None:
    """``torch.save`` then fsync, so a completed save survives a power cut."""
    with open(path, "wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())


def _write_latest(save_dir: Path, tag: str) -> None:
    tmp = save_dir / f".{LATEST}.tmp"
    with open(tmp, "w") as handle:
        handle.write(tag)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, save_dir / LATEST)
    _fsync_dir(save_dir)


def _remove_leftovers(root: Path) -> None:
    """Delete what crashed saves left: temporary directories, and old copies whose replacement landed."""
    for path in root.iterdir():
        stale_tmp = path.name.startswith(".tmp-")
        replaced_old = path.name.startswith(".old-") and (root / path.name.removeprefix(".old-")).is_dir()
        if path.is_dir() and (stale_tmp or replaced_old):
            shutil.rmtree(path, ignore_errors=True)


def save(save_dir: str | os.PathLike, tag: str, ctx: DistContext, *, shared: dict[str, Any] | Callable[[], dict],
         per_rank: Any, save_latest: bool = True) -> Path:
    """Write one checkpoint atomically.

    Args:
        save_dir: the checkpoint root (shared by all ranks).
        tag: sub-directory name, e.g. ``global_step100``.
        ctx: this rank's place in the world.
        shared: file name -> object, written by rank 0 only (a callable is evaluated there only).
        per_rank: this rank's object, written by every rank.
        save_latest: point ``latest`` at this tag.

    Returns:
        The final checkpoint directory.
    """
    if not tag or "/" in tag or tag.startswith("."):
        raise CheckpointError(f"checkpoint tag {tag!r} must be a plain, non-hidden directory name")
    root = Path(save_dir)
    tmp, final, old = root / f".tmp-{tag}", root / tag, root / f".old-{tag}"
    if ctx.is_main:
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise CheckpointError(f"cannot create checkpoint directory {root}: {err}") from None
        _remove_leftovers(root)
        tmp.mkdir()
    ctx.barrier()
    error: BaseException | None = None
    try:
        if ctx.is_main:
            files = shared() if callable(shared) else shared
            for name, obj in files.items():
                write_file_durably(obj, tmp / name)
        write_file_durably(per_rank, tmp / rank_file(ctx.rank))
    except Exception as err:  # every rank must learn of it, or the others wait at the next barrier
        error = err
    if not _all_ranks_ok(ctx, error is None):
        if error is not None:
            raise error
        raise CheckpointError(f"another rank failed while writing checkpoint {final}; the previous checkpoint "
                              "is untouched")
    if ctx.is_main:
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync_dir(root)
        shutil.rmtree(old, ignore_errors=True)
        if save_latest:
            _write_latest(root, tag)
        logger.info("saved checkpoint %s", final)
    ctx.barrier()
    return final


def _all_ranks_ok(ctx: DistContext, ok: bool) -> bool:
    """All-reduce a success flag (doubles as the barrier before the rename)."""
    if ctx.group is None:
        return ok
    flag = torch.tensor([int(ok)], device=ctx.device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=ctx.group)
    return bool(flag.item())


def resolve(load_dir: str | os.PathLike, tag: str | None) -> Path | None:
    """The directory of checkpoint ``tag`` (or of ``latest``), or None when there is no checkpoint."""
    root = Path(load_dir)
    if tag is None:
        latest = root / LATEST
        if not latest.is_file():
            return None
        tag = latest.read_text().strip()
    path = root / tag
    if not path.is_dir() and (root / f".old-{tag}").is_dir():
        logger.warning("checkpoint %s was being replaced when a save was interrupted; loading the previous copy", path)
        path = root / f".old-{tag}"
    if not (path / MODEL_FILE).is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no {MODEL_FILE})")
    return path


def load_file(path: Path) -> Any:
    """Read one checkpoint file onto the CPU."""
    try:
        # weights_only=False: checkpoints carry client_state, which may hold any picklable object.
        # Load only checkpoints you trust, as with torch.load in general. mmap: a tensor is read from
        # disk when it is used, so a rank merging every rank's ZeRO-Cache shard reads only its own.
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    except Exception as err:  # a truncated or foreign file; say which one
        raise CheckpointError(f"cannot read checkpoint file {path}: {err}") from None


ZERO_CACHE_SHARD = "zero_cache_shard"
"""Key of a per-rank file's optimizer shard (ranks 1..W-1 of a sharded ZeRO-Cache run; rank 0's is in the
optimizer file)."""


def merge_zero_cache_shards(path: Path, optimizer_state: dict[str, Any], num_shards: int) -> dict[str, Any]:
    """The whole optimizer state of a checkpoint saved by ``num_shards`` ZeRO-Cache ranks.

    Every state is keyed by parameter name, so merging the per-rank name tables is all a
    resharding load needs: a run at any world size then takes the names it owns.

    Args:
        path: the checkpoint directory.
        optimizer_state: rank 0's (``optim_states.pt``'s ``"optimizer"`` entry), extended in place.
        num_shards: the world size it was saved at.

    Returns:
        ``optimizer_state`` with every rank's masters, exp_avg and exp_avg_sq.
    """
    for rank in range(1, num_shards):
        source = path / rank_file(rank)
        shard = load_file(source).get(ZERO_CACHE_SHARD) if source.is_file() else None
        if shard is None:
            raise CheckpointError(f"{source} is missing or lacks rank {rank}'s ZeRO-Cache shard: the checkpoint "
                                  f"was saved by {num_shards} ranks and needs every rank's file")
        optimizer_state["masters"].update(shard["masters"])
        for field in ("exp_avg", "exp_avg_sq"):
            optimizer_state["optimizer"][field].update(shard["optimizer"][field])
    return optimizer_state


def capture_rng_state() -> dict[str, Any]:
    """Every random generator a training step can touch."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Undo :func:`capture_rng_state`'s snapshot."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def consolidate(module_state: dict[str, torch.Tensor], masters: dict[str, torch.Tensor],
                aliases: dict[str, str]) -> dict[str, torch.Tensor]:
    """The module state dict with each weight replaced by its fp32 master.

    Args:
        module_state: the module's state dict (compute dtype; without the weights when they were sharded).
        masters: fp32 master weights by ``named_parameters`` name.
        aliases: state-dict key -> ``named_parameters`` name (tied weights share one name).

    Returns:
        fp32 tensors on CPU under every state-dict key, each its own storage (safetensors refuses
        shared storage, which tied weights would otherwise have).
    """
    state = {}
    for key in dict.fromkeys([*module_state, *aliases]):  # a module saved with sharded params has no weights
        name = aliases.get(key, key)
        if name not in masters and key not in module_state:
            continue  # a frozen parameter left out of the checkpoint (exclude_frozen_parameters)
        value = (masters[name] if name in masters else module_state[key]).detach().cpu()
        state[key] = (value.float() if value.is_floating_point() else value).contiguous().clone()
    return state
