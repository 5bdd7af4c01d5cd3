"""Which checkpoint a load takes: the one ``latest`` names if it verifies, else the newest older one that does.

Verifying reads the manifest first (sizes and checksums, the files shared out over the ranks). An explicit tag
that fails is a :class:`CheckpointError` naming the file; following ``latest`` falls back, newest first, to
the older checkpoints of the directory, with a warning naming the damaged one. What the ordering reads (a
manifest's time) comes only from inside the directory: a checkpoint directory or manifest that is a symlink
to another run is damaged, and its target's time does not hide the valid older checkpoints.

A job that resumes on its own (``pretrain.py``) also falls back when ``latest`` is missing but checkpoints are
there (:func:`saved_checkpoints`): a fresh start would write ``global_stepN`` over the old run's checkpoints
of the same names. ``load_checkpoint`` keeps DeepSpeed's answer there (no ``latest``: nothing to load).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed  # noqa: F401  (all_gather of the verdicts)

from angelptm.checkpoints import manifest, paths, safe_pickle
from angelptm.checkpoints.paths import LATEST, MODEL_FILE
from angelptm.errors import CheckpointError
from angelptm.launch.distributed import DistContext

logger = logging.getLogger(__name__)

_STEP_TAG = re.compile(r"global_step\d+")
_MAX_NAMED = 8
"""Messages name this many checkpoints, then count the rest."""


def resolve(load_dir: str | os.PathLike, tag: str | None, ctx: DistContext | None = None, *,
            fall_back_without_latest: bool = False,
            untrusted: Callable[[Path], str | None] | None = None) -> Path | None:
    """The directory of a checkpoint that verifies against its manifest, or None when there is no checkpoint.

    Args:
        load_dir: the checkpoint root.
        tag: an explicit tag, which must verify; None follows ``latest`` and falls back, newest first,
            to the older checkpoints in ``load_dir`` when it does not.
        ctx: with several ranks, each checks a share of the files and all agree on the outcome (every
            rank must call it); None checks every file here.
        fall_back_without_latest: with no ``latest`` at all, take the newest checkpoint that verifies (and
            refuse a directory holding checkpoints of which none does) instead of returning None.
        untrusted: in that fallback, why a checkpoint that verifies must not be resumed all the same (None: it
            may), e.g. ``pretrain.py``'s run health marked it saved after the run turned unhealthy; such ones are
            passed over, and when no other verifies, the error names them.

    Raises:
        CheckpointError: the explicit tag, or every candidate, fails; the message names the damaged files.
    """
    root = Path(load_dir)
    if tag is not None:
        paths.check_tag(tag)
        path = _tag_dir(root, tag)
        problem = _verify(path, ctx)
        if problem is not None:
            raise CheckpointError(f"checkpoint {path} does not verify: {problem}")
        return path
    latest_tag, problem = paths.read_latest(root)
    missing = latest_tag is None and problem is None
    if missing and not fall_back_without_latest:
        return None
    problems = [] if problem is None else [problem]
    if problem is not None:
        logger.warning("%s is damaged (%s); trying the newest checkpoint in %s", root / LATEST, problem, root)
    candidates = _candidates(root, latest_tag)
    if missing and candidates:
        logger.warning("%s holds checkpoints but no %s file naming the one to resume; trying the newest", root,
                       LATEST)
    passed_over = []
    for path in candidates:
        problem = _verify(path, ctx)
        reason = untrusted(path) if problem is None and missing and untrusted is not None else None
        if problem is None and reason is None:
            return path
        if reason is not None:
            passed_over.append(f"{path.name} {reason}")
            logger.warning("checkpoint %s %s; not resuming it, trying the newest one before it", path, reason)
            continue
        problems.append(problem)
        logger.warning("checkpoint %s does not verify (%s); trying the newest one before it", path, problem)
    if passed_over:
        damaged = f"; the others do not verify: {'; '.join(problems)}" if problems else ""
        raise CheckpointError(f"{root} has no {LATEST} file and no checkpoint to resume from: "
                              f"{'; '.join(passed_over[:_MAX_NAMED])}{damaged}. Start again in another save "
                              f"directory; to resume one of them anyway, write its tag into {root / LATEST}")
    if missing and not problems:
        saved = saved_checkpoints(root)
        if not saved:
            return None
        raise CheckpointError(f"{root} holds {_named(saved)} but no checkpoint that can be loaded (no {LATEST} file, "
                              "and none of them is a complete checkpoint inside the directory); starting over there "
                              "would write over them. Move them out of the directory, or use another save directory")
    raise CheckpointError(f"no checkpoint in {root} verifies: {'; '.join(problems)}. Move the damaged ones out of "
                          "the directory to inspect them, or start over with another save directory")


def saved_checkpoints(root: Path) -> list[str]:
    """The names in ``root`` that a run could have saved (sorted): a ``global_stepN`` entry of any kind, or a
    non-hidden directory (or symlink to one) holding a model or manifest file. Broader than what loads: these
    are what a fresh start in ``root`` must not write over."""
    try:
        entries = list(root.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for entry in entries:
        name = entry.name
        if name.startswith(".") or name == LATEST:
            continue
        looks_saved = entry.is_dir() and any(os.path.lexists(entry / f) for f in (MODEL_FILE, manifest.MANIFEST_FILE))
        if _STEP_TAG.fullmatch(name) or looks_saved:
            found.append(name)
    return sorted(found)


def _named(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_NAMED])
    more = f" and {len(names) - _MAX_NAMED} more" if len(names) > _MAX_NAMED else ""
    return f"{len(names)} saved checkpoint name{'s' if len(names) > 1 else ''} ({shown}{more})"


def _tag_dir(root: Path, tag: str) -> Path:
    path = root / tag
    if not path.is_dir() and (root / f".old-{tag}").is_dir() and paths.is_inside(root, root / f".old-{tag}"):
        logger.warning("checkpoint %s was being replaced when a save was interrupted; loading the previous copy", path)
        path = root / f".old-{tag}"
    return path


def _saved_at(path: Path) -> float:
    """When a checkpoint was saved: its manifest's time, else (no manifest, a damaged one, or a directory that
    leads elsewhere) the modification time of its directory entry itself, never of what a symlink leads to."""
    try:
        if paths.is_inside(path.parent, path):
            saved = manifest.read_manifest(path)
            if saved is not None:
                return float(saved["saved_at_unix"])
    except Exception:  # a damaged manifest: the directory entry still orders it
        pass
    return os.lstat(path).st_mtime


def _candidates(root: Path, latest_tag: str | None) -> list[Path]:
    """The checkpoint ``latest`` names, then every checkpoint saved before it, newest first (every checkpoint
    when ``latest`` is damaged or missing: ``latest_tag`` None).

    Newer ones are left out: they never became ``latest`` (``save_latest=False``, or a crash between the
    rename and the pointer update), so resuming from them would skip what the user chose. Directories that
    lead outside ``root`` (symlinks) are not checkpoints of it.
    """
    named = _tag_dir(root, latest_tag) if latest_tag is not None else None
    if not root.is_dir():  # (a first run: nothing saved yet, the directory not made)
        return [named] if named is not None else []
    limit = _saved_at(named) if named is not None and os.path.lexists(named) else float("inf")
    others = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and p != named
              and paths.is_inside(root, p) and paths.tag_problem(p.name) is None
              and ((p / MODEL_FILE).is_file() or (p / manifest.MANIFEST_FILE).is_file())]
    older = sorted(((t, p) for p in others if (t := _saved_at(p)) <= limit), key=lambda item: item[0], reverse=True)
    return ([named] if named is not None else []) + [p for _, p in older]


def _verify(path: Path, ctx: DistContext | None) -> str | None:
    """None when the checkpoint at ``path`` is complete and every file matches the manifest, else why not."""
    if not path.is_dir():
        return f"{path} does not exist"
    if not paths.is_inside(path.parent, path):
        return f"{path} leads outside {path.parent} (a symlink)"
    try:
        saved = manifest.read_manifest(path)
    except CheckpointError as err:
        return str(err)
    if saved is None:
        return _check_unverifiable(path)
    if MODEL_FILE not in saved["files"]:
        return f"{path} is not a complete checkpoint (its manifest lists no {MODEL_FILE})"
    rank, world_size = (ctx.rank, ctx.world_size) if ctx is not None and ctx.group is not None else (0, 1)
    problems = [p for name in manifest.share_of_files(saved, rank, world_size)
                if (p := manifest.verify_file(path, name, saved["files"][name])) is not None]
    if world_size > 1:  # every rank must reach the same verdict, or they would load different checkpoints
        parts: list[Any] = [None] * world_size
        torch.distributed.all_gather_object(parts, problems, group=ctx.group)
        problems = [p for part in parts for p in part]
    return "; ".join(problems) or None


def _check_unverifiable(path: Path) -> str | None:
    """A checkpoint without a manifest: acceptable (with a warning) only if it predates manifests (format 1).

    Every checkpoint of format 2 or later was written with its manifest, so one without it lost files on
    the way (a partial copy): it is damaged, whatever else is left of it.
    """
    model_file = path / MODEL_FILE
    if not model_file.is_file():
        deepspeed_files = sorted(p.name for p in path.glob("*_model_states.pt"))
        if deepspeed_files:  # engine.load_checkpoint and the exports take these before verifying
            return (f"{path} is a DeepSpeed checkpoint ({deepspeed_files[0]}, no {MODEL_FILE}): "
                    "engine.load_checkpoint, zero_to_fp32 and angelptm-export read it; a pipeline engine does not")
        return f"{path} is not a complete checkpoint (no {MODEL_FILE})"
    problem = paths.regular_file_problem(path, MODEL_FILE)
    if problem is not None:
        return f"checkpoint file {model_file} is not read: {problem}"
    try:
        version = safe_pickle.load(model_file).get("format_version", 1)
    except CheckpointError as err:
        if "opt in with" not in str(err):  # unreadable, not merely of the old, pickled format
            return str(err)
        version = 1
    if version >= 2:
        return (f"{path / manifest.MANIFEST_FILE} is missing, although {model_file} is of format {version}, "
                "which is always saved with one: files were lost (a partial copy?)")
    logger.warning("%s has no %s (saved before manifests existed): its files cannot be verified",
                   path, manifest.MANIFEST_FILE)
    return None
