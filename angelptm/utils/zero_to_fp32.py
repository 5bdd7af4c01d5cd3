"""``deepspeed.utils.zero_to_fp32`` over angelptm checkpoints: the consolidated fp32 weights, offline, on CPU.

    python -m angelptm.utils.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR [-t TAG] [--safe_serialization]

The reading is :func:`angelptm.checkpoints.export.consolidated_fp32_state_dict` (fp32 masters, ZeRO-Cache shards and
expert-parallel slices merged). What is written follows DeepSpeed's script: ``OUTPUT_DIR/pytorch_model.bin``
(``torch.save``) or ``OUTPUT_DIR/model.safetensors``, in numbered shards with an index above ``max_shard_size``.
Checkpoints written by DeepSpeed itself (ZeRO stages 0-3, any number of ranks) are read too, by
:mod:`angelptm.checkpoints.deepspeed_format`: the same fp32 weights DeepSpeed's own script gives (and stage 0's,
which it does not read), without unpickling anything but data.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn

from angelptm.checkpoints.export import consolidated_fp32_state_dict
from angelptm.checkpoints.files import save_safetensors
from angelptm.errors import CheckpointError
from zero_cache import parse_bytes


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str | Path, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, torch.Tensor]:
    """The module state dict with fp32 weights from a checkpoint directory, like DeepSpeed's function.

    Args:
        checkpoint_dir: the ``save_dir`` given to ``engine.save_checkpoint`` (holds ``latest``).
        tag: a checkpoint tag (e.g. ``global_step14``); None follows ``latest``.
        exclude_frozen_parameters: not supported (raises; see the message).
        lazy_mode: accepted; the tensors are always loaded (they are on CPU).

    Returns:
        The state dict, on CPU, loadable with ``model.load_state_dict``.
    """
    if exclude_frozen_parameters:
        raise NotImplementedError("exclude_frozen_parameters=True: angelptm checkpoints do not record which "
                                  "parameters were frozen; save with engine.save_checkpoint(..., "
                                  "exclude_frozen_parameters=True) instead, or drop the keys from the result")
    return consolidated_fp32_state_dict(checkpoint_dir, tag)


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str | Path, output_dir: str | Path,
                                               max_shard_size: str | int = "5GB", safe_serialization: bool = False,
                                               tag: str | None = None, exclude_frozen_parameters: bool = False) -> Path:
    """Write the consolidated fp32 state dict to ``output_dir``, as DeepSpeed's script does.

    Args:
        checkpoint_dir: the checkpoint's ``save_dir``.
        output_dir: created if missing; receives ``pytorch_model.bin`` or ``model.safetensors``, or, for a
            model larger than ``max_shard_size``, numbered shards of them and their index
            (``pytorch_model.bin.index.json`` / ``model.safetensors.index.json``, as ``save_pretrained`` names them).
        max_shard_size: the largest file to write.
        safe_serialization: safetensors instead of ``torch.save``.
        tag: checkpoint tag; None follows ``latest``.
        exclude_frozen_parameters: not supported (raises).

    Returns:
        The file written (the index when sharded).
    """
    from huggingface_hub import split_torch_state_dict_into_shards

    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    output = Path(output_dir)
    output.mkdir(parents=True, exist_ok=True)
    pattern = "model{suffix}.safetensors" if safe_serialization else "pytorch_model{suffix}.bin"
    split = split_torch_state_dict_into_shards(state, filename_pattern=pattern,
                                               max_shard_size=parse_bytes(max_shard_size, name="max_shard_size"))
    for filename, keys in split.filename_to_tensors.items():
        shard = {key: state[key].contiguous() for key in keys}
        if safe_serialization:
            save_safetensors(shard, output / filename, metadata={"format": "pt"})
        else:
            torch.save(shard, output / filename)
    if not split.is_sharded:
        return output / next(iter(split.filename_to_tensors))
    index = output / (pattern.format(suffix="") + ".index.json")
    index.write_text(json.dumps({"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                                 "weight_map": split.tensor_to_filename}, indent=2, sort_keys=True) + "\n")
    return index


def load_state_dict_from_zero_checkpoint(model: nn.Module, checkpoint_dir: str | Path, tag: str | None = None
                                         ) -> nn.Module:
    """Move ``model`` to CPU and load the checkpoint's fp32 weights into it (``strict=False``, as DeepSpeed).

    Returns:
        The model.
    """
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m angelptm.utils.zero_to_fp32",
                                     description="Consolidate an angelptm checkpoint's fp32 weights (DeepSpeed's "
                                                 "zero_to_fp32.py interface).")
    parser.add_argument("checkpoint_dir", help="the save_dir given to engine.save_checkpoint")
    parser.add_argument("output_dir", help="directory for pytorch_model.bin / model.safetensors")
    parser.add_argument("--max_shard_size", default="5GB")
    parser.add_argument("--safe_serialization", action="store_true")
    parser.add_argument("-t", "--tag", default=None)
    parser.add_argument("--exclude_frozen_parameters", action="store_true")
    parser.add_argument("-d", "--debug", action="store_true", help="accepted; no extra output")
    args = parser.parse_args(argv)
    try:
        path = convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_dir, args.max_shard_size,
                                                          args.safe_serialization, args.tag,
                                                          args.exclude_frozen_parameters)
    except (CheckpointError, NotImplementedError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
