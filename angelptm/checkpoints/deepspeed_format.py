"""DeepSpeed's own checkpoints (0.19.8's layout), read by parameter name, so a run started on DeepSpeed goes on here.

``engine.load_checkpoint``, ``zero_to_fp32`` and ``angelptm-export`` recognise a DeepSpeed checkpoint directory
(:func:`find`) and read it with :func:`read`; :mod:`angelptm.checkpoints.deepspeed_resume` puts it into the engine.

The layout (``deepspeed/runtime/engine.py``, ``_save_checkpoint`` and ``_save_zero_checkpoint``), in ``save_dir/tag/``:

- ``mp_rank_00_model_states.pt`` (ZeRO-3: ``zero_pp_rank_R_mp_rank_00_model_states.pt`` for each rank R): the
  module's state dict (ZeRO-3: empty tensors, and the buffers), ``param_shapes`` (the order of the flat partitions),
  ``shared_params``, ``buffer_names``, frozen parameters, ``lr_scheduler``, the counters and the script's
  ``client_state`` keys. At stage 0 ``optimizer`` is the optimizer's ``state_dict()``, by position.
- ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`` for each data-parallel rank R (stages 1-3): R's partition of
  each group's fp32 masters and Adam moments, flat. Stages 1-2 name each parameter's fragment in R's partition
  (``param_slice_mappings``), as ``ds_to_universal.py``'s ``extract_zero_shards`` reads them; stage 3 cuts every
  parameter into W parts of ceil(numel / W), in ``param_shapes`` order (``zero_to_fp32.py``'s
  ``_zero3_merge_trainable_params``).

The masters come out as DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint`` gives them
(``tests/multiproc/test_deepspeed_resume.py`` compares), the moments by the same mappings. DeepSpeed's readers
themselves are not called: they unpickle with ``weights_only=False`` (a file could run code), and under
``angelptm.integrations`` ``import deepspeed`` is this package. Files are read like the engine's own
(:mod:`angelptm.checkpoints.safe_pickle`); the three DeepSpeed classes they name (its loss scaler,
``ZeroStageEnum``, ``fragment_address``) are read as plain data by stand-ins.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from angelptm.checkpoints import deepspeed_partitions as partitions
from angelptm.checkpoints import files as checkpoint
from angelptm.checkpoints import paths, safe_pickle
from angelptm.errors import CheckpointError

MODEL_FILE = "mp_rank_00_model_states.pt"
ZERO3_MODEL_FILE = "zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
_OPTIM_FILE = re.compile(r"(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt")
_OTHER_LAYOUTS = ((re.compile(r"layer_\d+-model_\d+-model_states\.pt"), "pipeline-parallel (a file per layer)"),
                  (re.compile(r"(?:zero_pp_rank_\d+_)?mp_rank_(?!00_)\d+_model_states\.pt"), "tensor-parallel"),
                  (re.compile(r".*expert_\d+_mp_rank_\d+_model_states\.pt"), "mixture-of-experts"))
DEEPSPEED_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
    "checkpoint_parallel_dimensions", "universal_checkpoint_info", "num_experts", "ds_autoep_layers", "autoep_layers"})
"""What DeepSpeed 0.19.8 writes into the model states itself; every other key is the script's ``client_state``."""
WITH_DEEPSPEED = ("Resume it with DeepSpeed, or take its weights with DeepSpeed's zero_to_fp32.py (DeepSpeed writes it "
                  "next to a ZeRO checkpoint; at stage 0 they are the 'module' of mp_rank_00_model_states.pt) and load "
                  "them into the model before initialize(), the optimizer starting afresh")
"""The way on from a DeepSpeed checkpoint this engine does not read at all."""
WEIGHTS_ALONE = ("Take its weights alone with load_checkpoint(..., load_optimizer_states=False), the optimizer "
                 "starting afresh, or resume it with DeepSpeed")
"""The way on when only its optimizer states do not fit this run."""
COPY_AGAIN = "Copy the whole checkpoint directory again (every rank's files), or resume from another checkpoint"
"""The way on from a checkpoint that lost files, or holds damaged ones."""


class DeepSpeedObject:
    """The attributes of a DeepSpeed object in a checkpoint (a loss scaler, a ``fragment_address``), as ``fields``:
    the stand-in its class is read as, so unpickling builds plain data and runs nothing of DeepSpeed's."""

    def __new__(cls, *args: Any, **kwargs: Any) -> "DeepSpeedObject":
        self = object.__new__(cls)
        self.fields = {}
        return self

    def __setstate__(self, state: Any) -> None:
        for part in state if isinstance(state, tuple) else (state,):  # (dict, slots) for classes with __slots__
            if isinstance(part, dict):
                self.fields.update(part)


def _zero_stage(value: Any) -> int:
    """``ZeroStageEnum(value)`` as the stage number."""
    return int(value)


def _tensor_of_type(func: Any, new_type: Any, args: tuple, state: Any) -> torch.Tensor:
    """``torch._tensor._rebuild_from_type_v2`` (DeepSpeed's ZeRO-3 masters are saved through it) for plain tensors
    and parameters only; ``func`` was resolved through the allowlist."""
    if new_type not in (torch.Tensor, torch.nn.Parameter):
        raise CheckpointError(f"a tensor of type {new_type!r} is not read")
    return torch._tensor._rebuild_from_type_v2(func, new_type, args, state)


STAND_INS = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": DeepSpeedObject,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": DeepSpeedObject,
    "deepspeed.utils.tensor_fragment.fragment_address": DeepSpeedObject,
    "deepspeed.runtime.zero.config.ZeroStageEnum": _zero_stage,
    "torch._tensor._rebuild_from_type_v2": _tensor_of_type,
    "torch.Tensor": torch.Tensor,
}


@dataclass(kw_only=True, slots=True)
class DeepSpeedCheckpoint:
    """What a DeepSpeed checkpoint holds, by parameter name (``named_parameters`` names, as DeepSpeed records)."""

    path: Path
    module: dict[str, torch.Tensor]
    """The module's whole state dict on CPU, weights in fp32 (tied weights under each name)."""
    optimizer: partitions.Partitions
    """The optimizer's side, every rank's partitions merged: stage and ranks, the fp32 masters, Adam's moments,
    steps and group hyperparameters, the loss scale."""
    lr_scheduler: dict[str, Any] | None
    global_steps: int
    global_samples: int
    skipped_steps: int
    client_state: dict[str, Any]


def find(load_dir: str | os.PathLike, tag: str | None) -> Path | None:
    """The checkpoint directory ``load_dir/tag`` (``tag`` None: the one ``latest`` names) when it is DeepSpeed's,
    else None (this engine's, or nothing: the engine's own loader answers for those)."""
    root = Path(load_dir)
    if tag is None:
        tag, _ = paths.read_latest(root)
    if tag is None or paths.tag_problem(tag) is not None:
        return None
    path = root / tag
    if not path.is_dir() or not paths.is_inside(root, path) or _is_ours(path):
        return None
    return path if any(_is_deepspeed_file(entry.name) for entry in path.iterdir()) else None


def _is_ours(path: Path) -> bool:
    return (path / paths.MODEL_FILE).exists() or (path / paths.MANIFEST_FILE).exists()


def _is_deepspeed_file(name: str) -> bool:
    return name.endswith("_model_states.pt") or _OPTIM_FILE.fullmatch(name) is not None


def refuse(path: Path, why: str, remedy: str = WITH_DEEPSPEED) -> CheckpointError:
    """The error for a DeepSpeed checkpoint this engine cannot read: the format, what is wrong, what to do."""
    return CheckpointError(f"{path} is a DeepSpeed checkpoint, and {why}. {remedy}")


def load_file(path: Path) -> Any:
    """One DeepSpeed file, read without running code (its DeepSpeed classes as :class:`DeepSpeedObject`)."""
    if not path.exists():
        raise refuse(path.parent, f"its {path.name} is missing (a partial copy?)", COPY_AGAIN)
    problem = paths.regular_file_problem(path.parent, path.name)
    if problem is not None:
        raise refuse(path.parent, f"{path.name} is not read: {problem}", COPY_AGAIN)
    try:
        return safe_pickle.load(path, stand_ins=STAND_INS)
    except CheckpointError as err:
        refused = safe_pickle.refused_globals(path, stand_ins=STAND_INS)
        if refused:
            raise refuse(path.parent, f"its {path.name} names {', '.join(refused)}, which DeepSpeed 0.19.8 does not "
                                      "write there: it was not loaded and nothing in it ran (damaged, hostile, or "
                                      "written by another version)", COPY_AGAIN) from None
        raise refuse(path.parent, f"its {path.name} cannot be read ({err})", COPY_AGAIN) from None


def read(path: Path, *, optimizer_states: bool, optimizer_order: Sequence[str] | None = None) -> DeepSpeedCheckpoint:
    """Read a DeepSpeed checkpoint directory (ZeRO stages 0-3, any number of data-parallel ranks).

    Args:
        path: ``save_dir/tag``.
        optimizer_states: read the Adam moments and steps too (else only the weights, counters and client state).
        optimizer_order: the names of the resuming optimizer's parameters in its order. ZeRO stage 0 saves the
            optimizer's states by position, in the order the script gave the parameters: the same script's
            order here names them. None (an export): stage 0's masters are the module's weights.

    Raises:
        CheckpointError: a layout this module does not read, or a damaged checkpoint; the message says it is
            DeepSpeed's format and what to do.
    """
    names = {entry.name for entry in path.iterdir()}
    for pattern, layout in _OTHER_LAYOUTS:
        if any(pattern.fullmatch(name) for name in names):
            raise refuse(path, f"a {layout} one, which this engine does not read")
    zero3 = ZERO3_MODEL_FILE.format(rank=0) in names
    model_file = path / (ZERO3_MODEL_FILE.format(rank=0) if zero3 else MODEL_FILE)
    if not model_file.is_file():
        raise refuse(path, f"its {model_file.name} is missing", COPY_AGAIN)
    states = load_file(model_file)
    if not isinstance(states, dict) or not isinstance(states.get("module"), dict):
        raise refuse(path, f"its {model_file.name} holds no module state dict (a pipeline engine's checkpoint?), "
                           "which this engine does not read")
    if states.get("num_experts") is not None or states.get("ds_autoep_layers") or states.get("autoep_layers"):
        raise refuse(path, "a mixture-of-experts one, which this engine does not read")
    optim_files = sorted((int(m.group(1)), path / name) for name in names if (m := _OPTIM_FILE.fullmatch(name)))
    try:
        parts = _merge(path, states, optim_files, zero3=zero3, optimizer_states=optimizer_states,
                       optimizer_order=optimizer_order)
    except partitions.LayoutError as err:
        raise refuse(path, str(err), WEIGHTS_ALONE if err.weights_load else COPY_AGAIN) from None
    except (KeyError, IndexError, TypeError, AttributeError) as err:
        raise refuse(path, f"its files do not hold what DeepSpeed 0.19.8 writes ({type(err).__name__}: {err}): "
                           "damaged, or written by another version", COPY_AGAIN) from None
    aliases = {alias: name for alias, name in (states.get("shared_params") or {}).items()}
    module = checkpoint.consolidate({**states["module"], **parts.frozen}, parts.masters, aliases)
    return DeepSpeedCheckpoint(
        path=path, module=module, optimizer=parts,
        lr_scheduler=states.get("lr_scheduler"), global_steps=int(states.get("global_steps", 0)),
        global_samples=int(states.get("global_samples", 0)), skipped_steps=int(states.get("skipped_steps", 0)),
        client_state={k: v for k, v in states.items() if k not in DEEPSPEED_KEYS})


def _merge(path: Path, states: dict[str, Any], optim_files: list[tuple[int, Path]], *, zero3: bool,
           optimizer_states: bool, optimizer_order: Sequence[str] | None) -> partitions.Partitions:
    """The partitions of every rank merged, after checking that every rank's files are there."""
    if not optim_files:
        if zero3:
            raise refuse(path, "its optimizer files (zero_pp_rank_R_mp_rank_00_optim_states.pt) are missing",
                         COPY_AGAIN)
        return partitions.merge_stage0(states, optimizer_states=optimizer_states, optimizer_order=optimizer_order)
    ranks = [load_file(file)["optimizer_state_dict"] for _, file in optim_files]
    count = ranks[0]["partition_count"]
    world_size = max(count) if isinstance(count, list) else int(count)
    if [rank for rank, _ in optim_files] != list(range(world_size)):
        raise refuse(path, f"it was saved by {world_size} ranks and holds the optimizer files of ranks "
                           f"{[rank for rank, _ in optim_files]}: a rank's file is missing (a partial copy?)",
                     COPY_AGAIN)
    if not zero3:
        return partitions.merge_zero12(states, ranks, optimizer_states=optimizer_states)
    model_states = [states] + [load_file(path / ZERO3_MODEL_FILE.format(rank=rank)) for rank in range(1, world_size)]
    return partitions.merge_zero3(model_states, ranks, optimizer_states=optimizer_states)
