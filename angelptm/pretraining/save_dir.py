"""``pretrain.py`` and its ``train.save_dir``: go on from what is there, never start over it, prune old checkpoints.

A new run numbers its checkpoints ``global_stepN`` from step 0, so starting one in a directory that holds
another run's checkpoints writes over those of the same names (``save_interval`` steps later the first one is
gone). ``latest`` is only the pointer: when it is damaged, a directory, a symlink or missing, the checkpoints
are still there. So the job resumes whenever the directory holds anything a run could have saved
(:func:`angelptm.checkpoints.selection.saved_checkpoints`): the checkpoint ``latest`` names, else the newest one
that verifies; if none verifies it stops and names them. With resume off it refuses such a directory.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from angelptm.checkpoints import paths, selection
from angelptm.checkpoints.paths import LATEST
from angelptm.errors import CheckpointError
from angelptm.launch.distributed import DistContext
from angelptm.pretraining import health
from angelptm.pretraining.health import step_of

logger = logging.getLogger("pretrain")


def refuse_fresh_start_over_a_run(save_dir: str, ctx: DistContext) -> None:
    """A fresh start (resume off) must not write into a save_dir that already holds another run's checkpoints.

    Its ``global_stepN`` tags would mix with the old run's: ``latest`` would jump between runs, pruning would
    count (or spare) the wrong run's checkpoints, and same-named ones would be written over.

    Raises:
        CheckpointError: naming the directory, what it holds, and the two ways on.
    """
    root = Path(save_dir)
    saved = selection.saved_checkpoints(root)
    if not ctx.any_rank(os.path.lexists(root / LATEST) or bool(saved)):
        return
    tag, _ = paths.read_latest(root)
    pointer = f"{LATEST} names {tag!r}" if tag is not None else f"{LATEST} is missing or damaged"
    held = ", ".join(saved[:8]) + (f" and {len(saved) - 8} more" if len(saved) > 8 else "")
    raise CheckpointError(
        f"{save_dir!r} already holds a run's checkpoints ({held or 'none listed'}; {pointer}) and resume is off "
        "(--no-resume or train.resume=false); starting a new run there would mix its checkpoints with the old "
        "run's and write over those of the same step. Pass --save-dir with another directory, or drop --no-resume "
        "to continue the old run")


def resume(engine, save_dir: str, ctx: DistContext, *, allow_unsafe_pickle: bool = False) -> str | None:
    """Load the checkpoint the run goes on from into ``engine`` (every rank calls it).

    Returns:
        Its path; None when ``save_dir`` holds nothing a run saved (a fresh start is safe there).

    Raises:
        CheckpointError: ``save_dir`` holds checkpoints but none verifies, or (without ``latest``) only ones the
            run marked untrusted; each is named with what is wrong.
    """
    root = Path(save_dir)
    if ctx.any_rank(os.path.lexists(root / LATEST)):  # damaged or not: the load falls back past a damaged one
        path, _ = engine.load_checkpoint(save_dir, allow_unsafe_pickle=allow_unsafe_pickle)
        return path
    # No `latest` (deleted, lost with a copy, or moved aside by a run that trusted none of its checkpoints): the
    # newest checkpoint that verifies and was not saved unhealthy. It is verified here and again by the load,
    # which only a run that lost its pointer pays for.
    chosen = health.resume_point(save_dir, ctx)
    if chosen is None:  # (nothing saved, as every rank agreed)
        return None
    tag = chosen.name.removeprefix(".old-")  # an interrupted replacement: the load finds the .old- copy by its tag
    path, _ = engine.load_checkpoint(save_dir, tag=tag, allow_unsafe_pickle=allow_unsafe_pickle)
    return path


def prune_checkpoints(save_dir: str, keep_last: int) -> None:
    """Keep the newest ``keep_last`` ``global_stepN`` checkpoints up to the one ``latest`` names; delete older ones.

    Only tags with N <= the step of ``latest`` are candidates: newer ones are not this run's
    checkpoints (another run's, a save that never became ``latest``, or one saved after a non-finite
    loss) and are left alone, as is the ``latest`` one itself and any tag not of the form ``global_stepN``.
    Without a ``latest`` naming a ``global_stepN`` tag nothing is deleted. An entry that leads outside
    ``save_dir`` (a symlink) is never followed.
    """
    root = Path(save_dir)
    latest, _ = paths.read_latest(root)
    latest_step = step_of(latest) if latest is not None else None
    if latest_step is None:
        return
    steps = sorted((step, p) for p in root.glob("global_step*")
                   if p.is_dir() and paths.is_inside(root, p) and (step := step_of(p.name)) is not None
                   and step <= latest_step)
    pruned = steps[:max(len(steps) - keep_last, 0)]
    # A checkpoint saved while the run was unhealthy never displaces the newest healthy one.
    spared = health.newest_healthy([p for _, p in steps]) if pruned else None
    for _, path in pruned:
        if path.name != latest and path != spared:
            shutil.rmtree(path, ignore_errors=True)
