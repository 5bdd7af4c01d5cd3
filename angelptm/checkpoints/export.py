"""Offline export of a checkpoint's fp32 weights to one safetensors file.

    angelptm-export CHECKPOINT_DIR OUTPUT.safetensors [--tag TAG] [--allow-unsafe-pickle]
    angelptm-export CHECKPOINT_DIR --hf OUTPUT_DIR [--max-shard-size 5GB]

(``python -m angelptm.checkpoints.export`` is the same command.) The files are written with the mode any new file
gets (0666 less the umask), not safetensors' 0600.

``--hf`` writes a ``save_pretrained`` directory instead (``config.json`` + safetensors shards, see
``angelptm.checkpoints.hf_export``): a transformers model trained here under its own names, our reference GPT as
``LlamaForCausalLM`` or ``GPT2LMHeadModel``.

Runs on CPU from the files alone (no model code, no GPU): the fp32 master weights come from
``optim_states.pt``; buffers and the names of tied weights from ``model_states.pt``. The result
loads into the plain model with ``model.load_state_dict(safetensors.torch.load_file(path))``. A
checkpoint saved with experts spread over ranks (``moe.ep_size > 1``) is gathered into every expert,
so it loads into the same model built with ``ep_size: 1``. A checkpoint DeepSpeed wrote (ZeRO stages 0-3) is read
too, its fp32 masters by name (:mod:`angelptm.checkpoints.deepspeed_format`).

The other way round, DeepSpeed's ``load_checkpoint`` does not read this engine's checkpoints (with or without
``load_module_only``, it stops with a bare ``AssertionError`` in its ``state_dict_factory.py``): the exported file is
how their weights reach a DeepSpeed run, ``model.load_state_dict(safetensors.torch.load_file(path))`` before
``deepspeed.initialize``, the optimizer starting afresh (:data:`DEEPSPEED_HINT`, printed after each export).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError

from angelptm.checkpoints import deepspeed_format, paths
from angelptm.checkpoints import files as checkpoint
from angelptm.checkpoints.safe_pickle import OPT_IN_HELP
from angelptm.errors import CheckpointError


def consolidated_fp32_state_dict(load_dir: str | Path, tag: str | None = None, *,
                                 allow_unsafe_pickle: bool = False) -> dict[str, torch.Tensor]:
    """The module state dict with fp32 master weights, read from a checkpoint directory.

    Args:
        load_dir: the ``save_dir`` given to ``save_checkpoint``.
        tag: a checkpoint tag; None follows ``latest`` (or the newest older checkpoint that verifies).
        allow_unsafe_pickle: see :func:`angelptm.checkpoints.files.load_file` (previous-format checkpoints).

    Returns:
        Every key of the module's state dict; tied weights appear under each of their names.
    """
    return _read(load_dir, tag, allow_unsafe_pickle)[1]


def _read(load_dir: str | Path, tag: str | None, unsafe: bool) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(model_states, consolidated fp32 state dict)`` of a checkpoint (of DeepSpeed's: ``({}, state dict)``)."""
    foreign = deepspeed_format.find(load_dir, tag)
    if foreign is not None:  # written by DeepSpeed itself: its layout, read by parameter name
        return {}, deepspeed_format.read(foreign, optimizer_states=False).module
    path = checkpoint.resolve(load_dir, tag)
    if path is None:
        raise CheckpointError(f"{load_dir} holds no checkpoint (no 'latest' file); pass --tag")
    model_states = checkpoint.load_file(path / checkpoint.MODEL_FILE, allow_unsafe_pickle=unsafe)
    if "module" not in model_states:  # a pipeline's (each rank file holds one stage) or AutoPipe's checkpoint
        raise CheckpointError(f"{path} is a pipeline checkpoint ({model_states.get('format', 'autopipe')}): each "
                              "rank's file holds one stage, and exporting one is not built. Load it into the same "
                              "pipeline layout to go on training")
    module, masters = model_states["module"], {}
    if (path / checkpoint.OPTIM_FILE).is_file():
        optimizer = checkpoint.load_file(path / checkpoint.OPTIM_FILE, allow_unsafe_pickle=unsafe)["optimizer"]
        shards = model_states.get("zero_cache_shards", 1)
        masters = optimizer["masters"] if shards == 1 else \
            checkpoint.merge_zero_cache_shards(path, optimizer, shards, allow_unsafe_pickle=unsafe)["masters"]
    if model_states.get("ep_size", 1) > 1:
        module, masters = _gather_experts(path, model_states, masters, allow_unsafe_pickle=unsafe)
    return model_states, checkpoint.consolidate(module, masters, model_states["param_aliases"])


def export_hf(load_dir: str | Path, out_dir: str | Path, tag: str | None = None, *, max_shard_size: int | str = "5GB",
              allow_unsafe_pickle: bool = False) -> list[str]:
    """Write a checkpoint as a Hugging Face ``save_pretrained`` directory (fp32 weights).

    Args:
        load_dir, tag, allow_unsafe_pickle: as :func:`consolidated_fp32_state_dict`.
        out_dir: the directory to write (created if missing).
        max_shard_size: largest safetensors file, bytes or e.g. "5GB"; more weights are sharded with an index.

    Returns:
        The names of the files written.

    Raises:
        CheckpointError: unreadable checkpoint, or a model with no Hugging Face equivalent (the message names
            the option).
    """
    from angelptm.checkpoints import hf_export  # needs transformers, which only this path requires

    model_states, state = _read(load_dir, tag, allow_unsafe_pickle)
    if not model_states:
        raise CheckpointError(f"{load_dir} holds a DeepSpeed checkpoint, which records no model architecture, so no "
                              "config.json can be written: export its weights to OUT.safetensors and load them into "
                              "the transformers model (load_state_dict), then save_pretrained")
    config, hf_state = hf_export.pretrained_files(model_states.get("architecture"), state,
                                                  model_states["param_aliases"])
    return hf_export.write_pretrained(out_dir, config, hf_state, max_shard_size=max_shard_size)


_INDEXED_EXPERT = re.compile(r"^(.*\.experts\.)(\d+)(\..+)$")
"""A key of one expert module of a list (``...experts.experts.3.weight``); other expert keys are stacked [L, ...]."""


def _gather_experts(path: Path, model_states: dict, masters: dict[str, torch.Tensor], *,
                    allow_unsafe_pickle: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The module state and masters of a checkpoint saved with experts over W ranks, with every expert.

    Rank 0's slice is in the shared files, slice p in ``rank_<p>``'s file. Stacked expert tensors
    ([L, ...], ``GroupedExperts``) are concatenated in rank order; an expert list's keys are
    renumbered p L + i. The result loads into the same model built with ep_size 1.
    """
    ep_size, expert_keys = model_states["ep_size"], model_states["expert_state_keys"]
    slices = [(model_states["module"], masters)]
    for rank in range(1, ep_size):
        source = path / checkpoint.rank_file(rank)
        saved = checkpoint.load_file(source, allow_unsafe_pickle=allow_unsafe_pickle).get("experts") \
            if source.is_file() else None
        if saved is None:
            raise CheckpointError(f"{source} is missing or lacks the experts of expert-parallel rank {rank}")
        slices.append((saved["module"], (saved["optimizer"] or {}).get("masters", {})))  # None: saved without one
    module = {k: v for k, v in model_states["module"].items() if k not in expert_keys}
    merged_masters = {k: v for k, v in masters.items() if k not in expert_keys}
    local_count: dict[str, set[str]] = {}
    for key in expert_keys:
        match = _INDEXED_EXPERT.match(key)
        if match:
            local_count.setdefault(match.group(1), set()).add(match.group(2))
    for key in expert_keys:
        match = _INDEXED_EXPERT.match(key)
        for rank, (rank_module, rank_masters) in enumerate(slices):
            if match:  # one module per expert: expert i of rank p is global expert p L + i
                index = rank * len(local_count[match.group(1)]) + int(match.group(2))
                target = f"{match.group(1)}{index}{match.group(3)}"
                module[target] = rank_module[key]
                if key in rank_masters:
                    merged_masters[target] = rank_masters[key]
        if not match:
            module[key] = torch.cat([rank_module[key] for rank_module, _ in slices])
            if key in masters:
                merged_masters[key] = torch.cat([rank_masters[key] for _, rank_masters in slices])
    return module, merged_masters


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=_prog(), description=__doc__.split("\n\n")[0])
    parser.add_argument("load_dir", help="checkpoint directory (the save_dir given to save_checkpoint)")
    parser.add_argument("output", nargs="?", help="the .safetensors file to write (or give --hf DIR)")
    parser.add_argument("--hf", metavar="DIR", default=None,
                        help="write a Hugging Face save_pretrained directory (config.json + safetensors shards) "
                             "instead of one file")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="with --hf: largest safetensors file, e.g. 5GB or bytes (default 5GB)")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: the one named in 'latest')")
    parser.add_argument("--allow-unsafe-pickle", action="store_true",
                        help=OPT_IN_HELP)
    args = parser.parse_args(argv)
    if (args.output is None) == (args.hf is None):
        parser.error("give either OUTPUT.safetensors or --hf DIR")
    problem = _writes_into_checkpoints(Path(args.load_dir), Path(args.hf if args.hf is not None else args.output))
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    if args.hf is not None:
        return _main_hf(args)
    parent = Path(args.output).parent
    if not parent.is_dir():  # checked first: no point reading a large checkpoint that cannot be written out
        problem = "is not a directory" if parent.exists() else "does not exist"
        print(f"error: cannot write {args.output}: the directory {str(parent)!r} {problem}", file=sys.stderr)
        return 1
    try:
        state = consolidated_fp32_state_dict(args.load_dir, args.tag, allow_unsafe_pickle=args.allow_unsafe_pickle)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    try:
        checkpoint.save_safetensors(state, args.output)
    except (OSError, SafetensorError) as err:  # e.g. no permission, disk full
        print(f"error: cannot write {args.output}: {err}", file=sys.stderr)
        return 1
    numel = sum(t.numel() for t in state.values())
    print(f"wrote {len(state)} tensors ({numel:,} elements, fp32) to {args.output}")
    print(DEEPSPEED_HINT.format(path=args.output))
    return 0


DEEPSPEED_HINT = ("load it with model.load_state_dict(safetensors.torch.load_file({path!r})); to go on with DeepSpeed, "
                  "do that before deepspeed.initialize() (DeepSpeed's load_checkpoint does not read angelptm "
                  "checkpoints, and the optimizer starts afresh)")
"""What the export prints after the file: how the weights load, and the way to DeepSpeed."""


SCRIPT = "angelptm-export"
"""The installed command (``[project.scripts]``); ``python -m angelptm.checkpoints.export`` runs the same."""


def _prog() -> str:
    """The command as the user typed it, for ``usage:``: the installed script, else the module form."""
    invoked = os.path.basename(sys.argv[0]) if sys.argv else ""
    return SCRIPT if invoked == SCRIPT else "python -m angelptm.checkpoints.export"


def _writes_into_checkpoints(load_dir: Path, target: Path) -> str | None:
    """Why writing ``target`` would damage the checkpoints in ``load_dir`` (None when it would not): a path inside
    a checkpoint (it once overwrote the newest one's model_states.pt), or one of ``load_dir``'s own names."""
    if not load_dir.is_dir():
        return None
    real_dir, real = os.path.realpath(load_dir), os.path.realpath(target)
    if real == real_dir:
        return f"cannot write {target}: it is the checkpoint directory itself; write the export elsewhere"
    if not paths.is_inside(load_dir, target):
        return None
    relative = Path(os.path.relpath(real, real_dir))
    first = relative.parts[0]
    if len(relative.parts) > 1 or paths.tag_problem(first) is not None or (load_dir / first).is_dir():
        return (f"cannot write {target}: it lies inside the checkpoint directory {load_dir} (in {first!r}), and the "
                "export never writes into checkpoints; write it elsewhere (e.g. next to the checkpoint directory)")
    return None


def _main_hf(args: argparse.Namespace) -> int:
    shard_size = int(args.max_shard_size) if args.max_shard_size.isdigit() else args.max_shard_size
    try:
        written = export_hf(args.load_dir, args.hf, args.tag, max_shard_size=shard_size,
                            allow_unsafe_pickle=args.allow_unsafe_pickle)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except (OSError, SafetensorError) as err:
        print(f"error: cannot write {args.hf}: {err}", file=sys.stderr)
        return 1
    print(f"wrote {', '.join(written)} to {args.hf} (fp32; load with from_pretrained({args.hf!r}))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
