"""Atomic, resumable checkpoints in DeepSpeed's directory layout (``save_dir/tag/`` + ``save_dir/latest``).

Writing protocol (rank 0 coordinates, every rank writes its own RNG/data-position file):

0. take ``save_dir``'s writer lock (one writing process per directory: ``angelptm.checkpoints.writer_lock``) and
   remove the leftovers of saves whose process is gone;
1. write every file into ``save_dir/.tmp-<pid>-<host>-<random>-<tag>/`` and fsync each one, hashing it on the way
   out; rank 0 gathers every rank's file records and writes ``manifest.json`` (``angelptm.checkpoints.manifest``).
   Ranks given different ``save_dir``s each write into their own: there the lowest such rank creates the
   temporary directory and does steps 1-3 for the files written into it;
2. rename the temporary directory to ``save_dir/<tag>`` (an existing tag is first moved aside
   to ``.old-<tag>`` and removed only after the new one is in place);
3. fsync ``save_dir``, then replace ``latest`` atomically (write a new ``.latest.tmp``, fsync, ``os.replace``).

A crash at any point leaves ``latest`` naming a complete checkpoint: before step 2 the new files
sit in a temporary directory that the next save removes; between the two renames of step 2 the
loader falls back to ``.old-<tag>``.

Nothing outside ``save_dir`` is written or removed through a name inside it: the lock file and
``.latest.tmp`` are opened with ``O_NOFOLLOW`` (the temporary file is always created anew, with ``O_EXCL``),
renames and removals act on a symlink's name, never on what it leads to, and a ``latest`` that is a
directory stops the save at its start, naming it, instead of failing at the rename.

Loading is :mod:`angelptm.checkpoints.selection`'s (verify, fall back; ``resolve`` is re-exported here). Files
are read without running code from them (``angelptm.checkpoints.safe_pickle``), and only from inside the
checkpoint directory: ``latest``, tags and manifest entries are checked as ``angelptm.checkpoints.paths`` says.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed  # noqa: F401  (all_gather of the save outcome)

from angelptm.checkpoints import lazy_states, manifest, paths, writer_lock
from angelptm.checkpoints import safe_pickle as checkpoint_pickle
from angelptm.checkpoints.paths import LATEST, MODEL_FILE, OPTIM_FILE  # noqa: F401  (re-exported to callers)
from angelptm.checkpoints.selection import resolve  # noqa: F401  (callers load through files.resolve)
from angelptm.errors import CheckpointError, DiskFullError
from angelptm.launch.distributed import DistContext
from zero_cache import format_bytes

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2
"""2: a manifest, and nothing that needs unsafe unpickling (1: numpy RNG state as a pickled array)."""


def rank_file(rank: int) -> str:
    """Name of the per-rank file (RNG state and data position)."""
    return f"rank_{rank:05d}_states.pt"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_durably(obj: Any, path: Path) -> manifest.FileRecord:
    """``torch.save`` then fsync, so a completed save survives a power cut; returns its manifest record.

    Raises:
        CheckpointError: ``obj`` holds objects that loading could only rebuild by running code.
    """
    record = manifest.write_hashed(obj, path)
    checkpoint_pickle.refuse_unsafe_objects(path)
    return record


def point_latest(save_dir: str | os.PathLike, tag: str) -> None:
    """Make ``latest`` name ``tag``, an existing checkpoint (e.g. the last healthy one of a run that diverged)."""
    root = Path(save_dir)
    problem = paths.checkpoint_dir_problem(root, tag)
    if problem is not None:
        raise CheckpointError(f"cannot point latest at {tag!r}: {problem}")
    _write_latest(root, tag)


LATEST_TMP = f".{LATEST}.tmp"
"""The temporary file ``latest`` is written to before it is renamed over ``latest``."""


def _write_latest(save_dir: Path, tag: str) -> None:
    """Replace ``latest`` atomically: a new temporary file (``O_EXCL | O_NOFOLLOW``: never one already there,
    which could be a symlink carrying the write to a file outside the run), fsynced, then renamed over
    ``latest`` (a rename replaces a symlink there, not the file it leads to)."""
    tmp = save_dir / LATEST_TMP
    if os.path.isdir(tmp) and not os.path.islink(tmp):
        raise CheckpointError(f"cannot update {save_dir / LATEST}: {tmp} is a directory, and the engine writes a "
                              "temporary file of that name first; move that directory out of the save directory")
    _remove_entry(tmp)  # a leftover of a crashed save, or something planted: only the name is removed
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except FileExistsError:  # put back between the removal and the open, or not removable by this user
        raise CheckpointError(f"cannot update {save_dir / LATEST}: {tmp} is in the way and could not be removed; "
                              "remove it (the engine writes that temporary file itself), then save again") from None
    try:
        os.write(fd, tag.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, save_dir / LATEST)
    _fsync_dir(save_dir)


def _remove_entry(path: Path) -> None:
    """Remove ``path`` itself: a real directory with its contents, anything else (a symlink included) by its name
    alone, so nothing a symlink leads to is touched. Missing or not removable: left as it is."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except OSError:
        pass


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike,
                     metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file``, then the mode ``open()`` would have given the file: 0666 less the umask.

    safetensors creates its file 0600, so an exported model was unreadable to the group and others who can read
    the user's other files (a shared model directory, a serving job under another user).
    """
    from safetensors.torch import save_file

    save_file(tensors, path, metadata=metadata)
    os.chmod(path, 0o666 & ~current_umask())


def current_umask() -> int:
    """The process's umask, read without changing it where Linux says it (``/proc/self/status``): setting it to
    read it back, the only portable way, changes it for every thread meanwhile (a file another thread creates in
    that moment, a writer of a checkpoint in the background, would get the wrong mode)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # (elsewhere: set and put straight back)
    os.umask(mask)
    return mask


def _remove_leftovers(root: Path) -> None:
    """Delete what crashed saves left: temporary directories whose process is gone (never a live save's), and
    old copies whose replacement landed."""
    for path in root.iterdir():
        stale_tmp = path.name.startswith(".tmp-") and writer_lock.temporary_is_stale(path.name)
        replaced_old = path.name.startswith(".old-") and (root / path.name.removeprefix(".old-")).is_dir()
        if path.is_dir() and (stale_tmp or replaced_old):
            shutil.rmtree(path, ignore_errors=True)


def save(save_dir: str | os.PathLike, tag: str, ctx: DistContext, *, shared: dict[str, Any] | Callable[[], dict],
         per_rank: Any, save_latest: bool = True) -> Path:
    """Write one checkpoint atomically.

    Args:
        save_dir: the checkpoint root (shared by the ranks, or different ones: see the module docstring).
        tag: sub-directory name, e.g. ``global_step100``.
        ctx: this rank's place in the world.
        shared: file name -> object, written by rank 0 only (a callable is evaluated there only).
        per_rank: this rank's object, written by every rank.
        save_latest: point ``latest`` at this tag.

    Returns:
        The final checkpoint directory.
    """
    target = prepare_save(save_dir, tag, ctx)
    records: list[manifest.FileRecord] = []
    files: dict[str, Any] | None = None
    error: BaseException | None = None
    try:
        if ctx.is_main:
            files = shared() if callable(shared) else shared
            for name, obj in files.items():
                records.append(write_file_durably(obj, target.tmp / name))
        records.append(write_file_durably(per_rank, target.tmp / rank_file(ctx.rank)))
    except Exception as err:  # every rank must learn of it, or the others wait at the next barrier
        error = err
    except BaseException:  # an interrupt: the process stops here, so its staging directory goes now
        remove_staging(target, ctx)
        raise
    return publish_save(target, ctx, records, error, payload=(files, per_rank) if ctx.is_main else None,
                        save_latest=save_latest)


def remove_staging(target: SaveTarget, ctx: DistContext) -> None:
    """Remove a failed save's temporary directory, on the rank that created it: that directory alone, as
    :func:`_remove_entry` removes a name (a symlink found there is unlinked, never followed; ``shutil.rmtree`` does
    not follow the symlinks inside). Nothing is left for the next save's cleanup, which skips a live process's."""
    if target.sharing[0] == ctx.rank:
        _remove_entry(target.tmp)


@dataclass(frozen=True, slots=True)
class SaveTarget:
    """Where one save writes: its temporary directory, the final name, and the ranks publishing it."""

    root: Path
    tag: str
    tmp: Path
    sharing: list[int]
    """The ranks writing into this rank's ``root`` (ascending); the first prepares and publishes it."""

    @property
    def final(self) -> Path:
        return self.root / self.tag


def prepare_save(save_dir: str | os.PathLike, tag: str, ctx: DistContext) -> SaveTarget:
    """Step 0 and the temporary directory (a collective with several ranks: every rank learns of a failure).

    Raises:
        CheckpointError: the directory cannot be claimed or the temporary directory created (on every rank).
    """
    paths.check_tag(tag)
    root = Path(save_dir)
    # Ranks may name different directories (HelloDeepSpeed's per-rank timestamps): the lowest rank writing
    # into a directory prepares and publishes it, with the files its ranks wrote, as DeepSpeed has each rank
    # create what it writes.
    sharing, tmp_name = _ranks_sharing_directory(ctx, root, writer_lock.temporary_name(tag))
    tmp = root / tmp_name
    error: BaseException | None = None
    if sharing[0] == ctx.rank:
        try:
            claim_directory(root)
            _remove_leftovers(root)
            tmp.mkdir()
        except CheckpointError as err:
            error = err
        except OSError as err:
            error = CheckpointError(f"cannot create checkpoint directory {tmp}: {err}")
    failed = failed_ranks(ctx, error is None)  # doubles as the barrier before writing
    if failed:
        raise error or CheckpointError(f"rank(s) {failed} could not create their checkpoint directories; the "
                                       "previous checkpoint is untouched")
    return SaveTarget(root=root, tag=tag, tmp=tmp, sharing=sharing)


def publish_save(target: SaveTarget, ctx: DistContext, records: list[manifest.FileRecord],
                 error: BaseException | None, *, payload: Any, save_latest: bool) -> Path:
    """Steps 1 (the manifest) to 3 once this rank wrote its files (``error``: it failed); a collective with several
    ranks. A failure anywhere removes the temporary directory and raises on every rank; ``latest`` is untouched.

    Args:
        payload: what this rank wrote (for a full disk's message: the bytes a checkpoint needs).
    """
    try:
        return _publish(target, ctx, records, error, payload=payload, save_latest=save_latest)
    except BaseException:  # whatever stopped it (a collective broken, an interrupt), the partial must not stay
        remove_staging(target, ctx)  # (gone already where it was renamed into place)
        raise


def _publish(target: SaveTarget, ctx: DistContext, records: list[manifest.FileRecord], error: BaseException | None,
             *, payload: Any, save_latest: bool) -> Path:
    root, tag, tmp, final = target.root, target.tag, target.tmp, target.final
    every_rank = _gather_records(ctx, None if error is not None else records)
    if any(part is None for part in every_rank):
        remove_staging(target, ctx)  # every rank has stopped writing (the gather): no partials filling the disk
        if error is not None:
            raise _explained(error, root, tag, payload=payload)
        raise CheckpointError(f"another rank failed while writing checkpoint {final}; the previous checkpoint "
                              "is untouched")
    error = None
    if target.sharing[0] == ctx.rank:
        try:
            _finalize(root, tmp, final, root / f".old-{tag}", tag if save_latest else None,
                      [record for rank in target.sharing for record in every_rank[rank]])
        except Exception as err:  # the other ranks wait below: tell them, or they would hang there
            error = err
            remove_staging(target, ctx)  # not renamed in: the partial must not fill the disk
            if not os.path.isdir(root / LATEST_TMP):  # a directory of that name is not ours to delete
                _remove_entry(root / LATEST_TMP)
    failed = failed_ranks(ctx, error is None)  # only the ranks publishing a directory can have failed here
    if failed:
        if error is not None:
            raise _explained(error, root, tag, payload=None)
        raise CheckpointError(f"rank(s) {failed} failed to finish checkpoint {tag} (their logs say why); the previous "
                              "checkpoint is untouched")
    return final


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
"""``errno`` values of a full disk (out of space, or out of this user's quota)."""


def _explained(error: BaseException, root: Path, tag: str, payload: Any) -> BaseException:
    """A full disk as one line (room needed, room free, what is kept, the fix); any other error as it is."""
    if not isinstance(error, OSError) or error.errno not in DISK_FULL:
        return error
    previous = _latest_complete(root)
    if previous is not None:
        need = f"the last one, {previous.name}, takes {format_bytes(_dir_bytes(previous))}"
        kept = f"{previous.name} is kept and stays `latest`"
    else:
        tensor_bytes = _tensor_bytes(payload)
        need = (f"this one holds {format_bytes(tensor_bytes)} of tensors" if tensor_bytes
                else "about the size of the model's weights and optimizer states")
        kept = "there was no earlier checkpoint"
    try:
        free = format_bytes(shutil.disk_usage(root).free)
    except OSError:
        free = "unknown"
    message = (f"no space left on the disk of {root} while writing {error.filename or 'checkpoint ' + tag} "
               f"({os.strerror(error.errno)}): a checkpoint needs room for all its files ({need}); {free} is free "
               f"there now. The partial checkpoint was removed and {kept}. Free space under {root}, point the "
               f"checkpoints at a larger disk, or keep fewer of them (pretrain.py: train.keep_last)")
    exc = DiskFullError(message, error.errno, error.filename)
    exc.__cause__ = error
    return exc


def _latest_complete(root: Path) -> Path | None:
    tag, _ = paths.read_latest(root)
    return root / tag if tag is not None and paths.checkpoint_dir_problem(root, tag) is None else None


def _dir_bytes(path: Path) -> int:
    return sum(item.stat().st_size for item in path.rglob("*") if item.is_file())


def _tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors inside nested dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(value) for value in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(value) for value in obj)
    return getattr(obj, "num_bytes", 0)  # (a streamed file's plan: its tensors and the states it will hold)


def claim_directory(save_dir: str | os.PathLike) -> None:
    """Create ``save_dir`` if needed, check it can hold checkpoints, and take its writer lock (this process's).

    Raises:
        CheckpointError: it is a file, not writable, another live process writes there (named), its ``latest`` is
            a directory, or its lock file is not a plain file of its own (a symlink, hard link or FIFO).
    """
    root = Path(save_dir)
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"the checkpoint directory {str(root)!r} (train.save_dir / save_dir) is a file, not a "
                              "directory; point it at a directory (it is created if missing)")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CheckpointError(f"cannot create the checkpoint directory {str(root)!r} (train.save_dir / save_dir): "
                              f"{err.strerror or err}; point it at a writable directory") from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise CheckpointError(f"the checkpoint directory {str(root)!r} (train.save_dir / save_dir) is not writable "
                              "by this user; point it at a writable directory")
    latest = root / LATEST
    if os.path.isdir(latest) and not os.path.islink(latest):  # every save would fail when it replaces latest
        raise CheckpointError(f"{latest} is a directory; there the engine keeps a file naming the newest checkpoint "
                              "and cannot replace a directory with it. Move that directory out of the save directory "
                              "(a checkpoint inside it is not lost), then run again")
    writer_lock.LOCKS.hold(root)


def release_directory(save_dir: str | os.PathLike) -> None:
    """Give back ``save_dir``'s writer lock if this process holds it (a job that finished, an engine destroyed), so
    that the next writer takes it without reporting a process that is gone."""
    writer_lock.LOCKS.release(save_dir)


def _ranks_sharing_directory(ctx: DistContext, root: Path, tmp_name: str) -> tuple[list[int], str]:
    """The ranks (ascending) whose checkpoint root is this rank's, and the temporary directory name the lowest of
    them chose (a collective with several ranks)."""
    if ctx.group is None:
        return [ctx.rank], tmp_name
    entries: list[Any] = [None] * ctx.world_size
    torch.distributed.all_gather_object(entries, (os.path.realpath(root), tmp_name), group=ctx.group)
    roots = [entry[0] for entry in entries]  # one name per directory
    if ctx.is_main and len(set(roots)) > 1:
        logger.info("the ranks save checkpoint files into %d directories; each holds what its ranks wrote, with "
                    "its own manifest and latest (load from a directory that holds every rank's files)",
                    len(set(roots)))
    sharing = [rank for rank, other in enumerate(roots) if other == roots[ctx.rank]]
    return sharing, entries[sharing[0]][1]


def _finalize(root: Path, tmp: Path, final: Path, old: Path, latest_tag: str | None,
              records: list[manifest.FileRecord]) -> None:
    """Rank 0, once every file is written: the manifest, the renames, and ``latest``."""
    manifest.write_manifest(tmp, records)
    _fsync_dir(tmp)
    if os.path.lexists(final):  # a symlink there is moved aside as a name; what it leads to is not touched
        _remove_entry(old)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(root)
    _remove_entry(old)
    if latest_tag is not None:
        _write_latest(root, latest_tag)
    logger.info("saved checkpoint %s", final)


def failed_ranks(ctx: DistContext, ok: bool) -> list[int]:
    """The ranks whose part of a save or load failed, on every rank (a collective; doubles as a barrier), so that
    all of them stop together instead of some waiting in the next collective for the others."""
    if ctx.group is None:
        return [] if ok else [ctx.rank]
    outcomes: list[Any] = [None] * ctx.world_size
    torch.distributed.all_gather_object(outcomes, ok, group=ctx.group)
    return [rank for rank, fine in enumerate(outcomes) if not fine]


def _gather_records(ctx: DistContext, records: list[manifest.FileRecord] | None
                    ) -> list[list[manifest.FileRecord] | None]:
    """Every rank's file records (None for a rank that failed); doubles as the barrier before the rename."""
    if ctx.group is None:
        return [records]
    parts: list[Any] = [None] * ctx.world_size
    torch.distributed.all_gather_object(parts, records, group=ctx.group)
    return parts


def load_file(path: Path, *, allow_unsafe_pickle: bool = False, lazy: bool = False) -> Any:
    """Read one checkpoint file onto the CPU, without running code from it (see ``angelptm.checkpoints.safe_pickle``).

    Args:
        path: the file.
        allow_unsafe_pickle: fully unpickle a file that holds more than the safe types (a checkpoint of
            the previous format), after a warning; only for files whose origin you trust.
        lazy: ZeRO-Cache's state tables (masters, moments by name) are read one tensor at a time when looked up
            (:mod:`angelptm.checkpoints.lazy_states`), instead of the file being mapped whole.
    """
    problem = paths.regular_file_problem(path.parent, path.name)
    if problem is not None:
        raise CheckpointError(f"checkpoint file {path} is not read: {problem}")
    if lazy:
        return lazy_states.load_lazily(path, allow_unsafe_pickle=allow_unsafe_pickle)
    return checkpoint_pickle.load(path, allow_unsafe_pickle=allow_unsafe_pickle)


ZERO_CACHE_SHARD = "zero_cache_shard"
"""Key of a per-rank file's optimizer shard (ranks 1..W-1 of a sharded ZeRO-Cache run; rank 0's is in the
optimizer file)."""


def merge_zero_cache_shards(path: Path, optimizer_state: dict[str, Any], num_shards: int, *,
                            allow_unsafe_pickle: bool = False, lazy: bool = False) -> dict[str, Any]:
    """The whole optimizer state of a checkpoint saved by ``num_shards`` ZeRO-Cache ranks.

    Every state is keyed by parameter name, so merging the per-rank name tables is all a
    resharding load needs: a run at any world size then takes the names it owns.

    Args:
        path: the checkpoint directory.
        optimizer_state: rank 0's (``optim_states.pt``'s ``"optimizer"`` entry), extended in place.
        num_shards: the world size it was saved at.
        allow_unsafe_pickle: see :func:`load_file`.
        lazy: read the shards' state tables one tensor at a time (:mod:`angelptm.checkpoints.lazy_states`).

    Returns:
        ``optimizer_state`` with every rank's masters, exp_avg and exp_avg_sq.
    """
    for rank in range(1, num_shards):
        source = path / rank_file(rank)
        shard = load_file(source, allow_unsafe_pickle=allow_unsafe_pickle, lazy=lazy).get(ZERO_CACHE_SHARD) \
            if source.is_file() else None
        if shard is None:
            raise CheckpointError(f"{source} is missing or lacks rank {rank}'s ZeRO-Cache shard: the checkpoint "
                                  f"was saved by {num_shards} ranks and needs every rank's file")
        optimizer_state["masters"].update(shard["masters"])
        for field in ("exp_avg", "exp_avg_sq"):
            optimizer_state["optimizer"][field].update(shard["optimizer"][field])
    return optimizer_state


def capture_rng_state() -> dict[str, Any]:
    """Every random generator a training step can touch."""
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    # numpy's key array as a tensor: a numpy array would need unsafe unpickling to load.
    numpy_state = (kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached_gaussian)
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Undo :func:`capture_rng_state`'s snapshot."""
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]  # keys: a tensor, or an array in a format-1 checkpoint
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else keys
    np.random.set_state((kind, keys.astype(np.uint32), *rest))
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
