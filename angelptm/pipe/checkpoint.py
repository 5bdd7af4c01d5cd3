"""Checkpoints of a :class:`~angelptm.pipe.engine.PipelineEngine`: every rank saves its own stage.

A rank holds only its stage's layers, so each rank's file carries that stage's parameters, frozen ones
too, and the module's buffers (by the ``PipelineModule``'s state-dict names), its optimizer state (fp32
masters, moments), the scheduler, its RNG streams and data position; rank 0's model file carries the steps,
the layout and the client state. The files go through :func:`angelptm.checkpoints.files.save` (atomic, with a
manifest), so a checkpoint is whole or absent, and loading verifies it first. A checkpoint loads into a
pipeline of the same stages, ranks and split (the layer boundaries or AutoPipe's op cuts); anything else is
refused with what differs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from angelptm.checkpoints import files as checkpoint
from angelptm.errors import CheckpointError

FORMAT = "pipeline"


class PipelineCheckpoints:
    """``save_checkpoint`` / ``load_checkpoint`` for the pipeline engine (a mixin over its state)."""

    def _stage_layout(self) -> dict[str, Any]:
        """What a checkpoint must match to load: the stages, the ranks and where the model is cut."""
        split = self.runner.op_starts if self.runner is not None else None
        return {"num_stages": self.layout.num_stages, "world_size": self.ctx.world_size,
                "parts": list(self.module.parts) if self.module.parts is not None else None, "op_starts": split}

    def _stage_state(self) -> dict[str, torch.Tensor]:
        """This stage's parameters (frozen ones too) and every persistent buffer (small; each rank builds every
        layer, so a buffer's name is the same on every rank), by the ``PipelineModule``'s state-dict names."""
        mine = {id(p) for p in self.optimizer.params}
        if self.runner is not None:
            mine |= {id(p) for _, p in self.runner.named_parameters()}
        if self.module.parts is not None:
            mine |= {id(p) for p in self.module.stage_parameters(self.stage_id)}
        params = {id(p) for p in self.module.parameters()}
        return {name: t for name, t in self.module.state_dict(keep_vars=True).items()
                if id(t) in mine or id(t) not in params}

    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> Path:
        """Save every stage atomically (every rank must call it); returns ``save_dir/tag``.

        ``exclude_frozen_parameters`` changes nothing here: a stage saves the parameters it trains.
        """
        tag = tag or f"global_step{self.global_steps}"
        layout = self._stage_layout()
        model_states = {"format_version": checkpoint.FORMAT_VERSION, "format": FORMAT, "layout": layout,
                        "global_steps": self.global_steps, "global_samples": self.global_samples,
                        "micro_steps": self.micro_steps, "skipped_steps": self.skipped_steps,
                        "client_state": dict(client_state or {})}
        per_rank = {"stage": self.stage_id, "layout": layout,
                    "module": {name: t.detach().cpu().clone() for name, t in self._stage_state().items()},
                    "optimizer": self.optimizer.state_dict(),
                    "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
                    "rng": checkpoint.capture_rng_state(),
                    "data": self.training_dataloader.state_dict() if self.training_dataloader else None}
        self._join_save_dir(save_dir)  # destroy() leaves its writer lock (EngineSaves)
        return checkpoint.save(save_dir, tag, self.ctx, shared={checkpoint.MODEL_FILE: model_states},
                               per_rank=per_rank, save_latest=save_latest)

    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None, *,
                        allow_unsafe_pickle: bool = False) -> tuple[str | None, dict | None]:
        """Restore what :meth:`save_checkpoint` wrote (every rank must call it).

        Returns:
            ``(path, client_state)``, or ``(None, None)`` when ``load_dir`` holds no checkpoint.

        Raises:
            CheckpointError: not a pipeline checkpoint, or one of another layout.
        """
        if custom_load_fn is not None:
            raise NotImplementedError("load_checkpoint(custom_load_fn=...) is not supported")
        path = checkpoint.resolve(load_dir, tag, self.ctx)
        if path is None:
            return None, None
        model_states = checkpoint.load_file(path / checkpoint.MODEL_FILE, allow_unsafe_pickle=allow_unsafe_pickle)
        if model_states.get("format") != FORMAT:
            raise CheckpointError(f"{path} was not written by a pipeline engine (a PipelineModule's "
                                  "save_checkpoint); load it with the engine that wrote it")
        error = None
        try:  # a stage that cannot load must stop every stage, or the others would wait for it in train_batch
            self._load_stage(path, model_states, load_module_strict, load_optimizer_states, load_lr_scheduler_states,
                             load_module_only, allow_unsafe_pickle)
        except Exception as err:
            error = err
        failed = checkpoint.failed_ranks(self.ctx, error is None)
        if error is not None:
            raise error
        if failed:
            raise CheckpointError(f"{path}: stage(s) of rank(s) {failed} could not load their part (their logs say "
                                  "why); nothing was trained from it")
        return str(path), model_states["client_state"]

    def _load_stage(self, path: Path, model_states: dict, strict: bool, load_optimizer_states: bool,
                    load_lr_scheduler_states: bool, module_only: bool, allow_unsafe_pickle: bool) -> None:
        state = checkpoint.load_file(path / checkpoint.rank_file(self.ctx.rank),
                                     allow_unsafe_pickle=allow_unsafe_pickle)
        self._check_layout(path, state["layout"])
        self._load_stage_weights(path, state["module"], strict=strict)
        if module_only:
            self.optimizer.refresh_masters_from_params()
            return
        self.optimizer.load_state_dict(state["optimizer"], load_optimizer_states=load_optimizer_states)
        if load_lr_scheduler_states and self.lr_scheduler is not None and state["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        for name in ("global_steps", "global_samples", "micro_steps", "skipped_steps"):
            setattr(self, name, model_states[name])
        checkpoint.restore_rng_state(state["rng"])
        if self.training_dataloader is not None and state["data"] is not None:
            self.training_dataloader.load_state_dict(state["data"])

    def _check_layout(self, path: Path, saved: dict[str, Any]) -> None:
        mine = self._stage_layout()
        differs = [key for key in ("num_stages", "world_size", "parts") if saved[key] != mine[key]]
        if mine["op_starts"] is not None and saved["op_starts"] is not None and saved["op_starts"] != mine["op_starts"]:
            differs.append("op_starts")
        if differs:
            raise CheckpointError(f"{path} was saved by a pipeline with " + ", ".join(
                f"{key}={saved[key]}" for key in differs) + "; this one has " + ", ".join(
                f"{key}={mine[key]}" for key in differs) + ". Load it into the same layout (for AutoPipe, the "
                "same autopipe.profile_path)")

    def _load_stage_weights(self, path: Path, weights: dict[str, torch.Tensor], *, strict: bool) -> None:
        own = self._stage_state()
        missing, unexpected = sorted(set(own) - set(weights)), sorted(set(weights) - set(own))
        if strict and (missing or unexpected):
            raise CheckpointError(f"{path}: stage {self.stage_id}'s weights do not match its layers: missing "
                                  f"{missing[:5]}, unexpected {unexpected[:5]}")
        with torch.no_grad():
            for name in set(own) & set(weights):
                own[name].copy_(weights[name])
