"""Offline export of a checkpoint's fp32 weights to one safetensors file.

    python -m angelptm.export CHECKPOINT_DIR OUTPUT.safetensors [--tag TAG]

Runs on CPU from the files alone (no model code, no GPU): the fp32 master weights come from
``optim_states.pt``; buffers and the names of tied weights from ``model_states.pt``. The result
loads into the plain model with ``model.load_state_dict(safetensors.torch.load_file(path))``. A
checkpoint saved with experts spread over ranks (``moe.ep_size > 1``) is gathered into every expert,
so it loads into the same model built with ``ep_size: 1``.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from angelptm import checkpoint
from angelptm.errors import CheckpointError


def consolidated_fp32_state_dict(load_dir: str | Path, tag: str | None = None) -> dict[str, torch.Tensor]:
    """The module state dict with fp32 master weights, read from a checkpoint directory.

    Args:
        load_dir: the ``save_dir`` given to ``save_checkpoint``.
        tag: a checkpoint tag; None follows ``latest``.

    Returns:
        Every key of the module's state dict; tied weights appear under each of their names.
    """
    path = checkpoint.resolve(load_dir, tag)
    if path is None:
        raise CheckpointError(f"{load_dir} holds no checkpoint (no 'latest' file); pass --tag")
    model_states = checkpoint.load_file(path / checkpoint.MODEL_FILE)
    module, masters = model_states["module"], {}
    if (path / checkpoint.OPTIM_FILE).is_file():
        optimizer = checkpoint.load_file(path / checkpoint.OPTIM_FILE)["optimizer"]
        shards = model_states.get("zero_cache_shards", 1)
        masters = checkpoint.merge_zero_cache_shards(path, optimizer, shards)["masters"] if shards > 1 \
            else optimizer["masters"]
    if model_states.get("ep_size", 1) > 1:
        module, masters = _gather_experts(path, model_states, masters)
    return checkpoint.consolidate(module, masters, model_states["param_aliases"])


_INDEXED_EXPERT = re.compile(r"^(.*\.experts\.)(\d+)(\..+)$")
"""A key of one expert module of a list (``...experts.experts.3.weight``); other expert keys are stacked [L, ...]."""


def _gather_experts(path: Path, model_states: dict, masters: dict[str, torch.Tensor]
                    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The module state and masters of a checkpoint saved with experts over W ranks, with every expert.

    Rank 0's slice is in the shared files, slice p in ``rank_<p>``'s file. Stacked expert tensors
    ([L, ...], ``GroupedExperts``) are concatenated in rank order; an expert list's keys are
    renumbered p L + i. The result loads into the same model built with ep_size 1.
    """
    ep_size, expert_keys = model_states["ep_size"], model_states["expert_state_keys"]
    slices = [(model_states["module"], masters)]
    for rank in range(1, ep_size):
        source = path / checkpoint.rank_file(rank)
        saved = checkpoint.load_file(source).get("experts") if source.is_file() else None
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
    parser = argparse.ArgumentParser(prog="python -m angelptm.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("load_dir", help="checkpoint directory (the save_dir given to save_checkpoint)")
    parser.add_argument("output", help="the .safetensors file to write")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: the one named in 'latest')")
    args = parser.parse_args(argv)
    parent = Path(args.output).parent
    if not parent.is_dir():  # checked first: no point reading a large checkpoint that cannot be written out
        problem = "is not a directory" if parent.exists() else "does not exist"
        print(f"error: cannot write {args.output}: the directory {str(parent)!r} {problem}", file=sys.stderr)
        return 1
    try:
        state = consolidated_fp32_state_dict(args.load_dir, args.tag)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    try:
        save_file(state, args.output)
    except (OSError, SafetensorError) as err:  # e.g. no permission, disk full
        print(f"error: cannot write {args.output}: {err}", file=sys.stderr)
        return 1
    numel = sum(t.numel() for t in state.values())
    print(f"wrote {len(state)} tensors ({numel:,} elements, fp32) to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
