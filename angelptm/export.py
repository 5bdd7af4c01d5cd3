"""Offline export of a checkpoint's fp32 weights to one safetensors file.

    python -m angelptm.export CHECKPOINT_DIR OUTPUT.safetensors [--tag TAG]

Runs on CPU from the files alone (no model code, no GPU): the fp32 master weights come from
``optim_states.pt``; buffers and the names of tied weights from ``model_states.pt``. The result
loads into the plain model with ``model.load_state_dict(safetensors.torch.load_file(path))``.
"""

from __future__ import annotations

import argparse
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
    if model_states.get("ep_size", 1) > 1:
        raise CheckpointError(f"{path} was saved with moe.ep_size={model_states['ep_size']}: its experts are spread "
                              "over the per-rank files, and exporting such a checkpoint is not implemented yet")
    masters = {}
    if (path / checkpoint.OPTIM_FILE).is_file():
        masters = checkpoint.load_file(path / checkpoint.OPTIM_FILE)["optimizer"]["masters"]
    return checkpoint.consolidate(model_states["module"], masters, model_states["param_aliases"])


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
