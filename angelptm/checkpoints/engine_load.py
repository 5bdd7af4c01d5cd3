"""The engine's loads: :meth:`load_checkpoint` and what it restores (a mixin of :class:`Engine`).

It reads what :mod:`angelptm.checkpoints.engine_save` writes (verified against its manifest first), or a checkpoint
DeepSpeed wrote (:mod:`angelptm.checkpoints.deepspeed_resume`), and refuses one of another architecture or
expert-parallel split before it loads anything.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from angelptm.checkpoints import architecture, deepspeed_format, deepspeed_resume, optimizer_format
from angelptm.checkpoints import files as checkpoint
from angelptm.errors import CheckpointError
from zero_cache import OptimizerCheckpoint

logger = logging.getLogger("angelptm.engine.engine")


class EngineLoads:
    """Load methods of :class:`~angelptm.engine.engine.Engine`; the names of its state (parameter aliases, sharded
    weights, expert slices) are :class:`~angelptm.checkpoints.engine_save.EngineSaves`'."""

    def _load_expert_slice(self, path: Path, *, load_optimizer_states: bool, module_only: bool,
                           allow_unsafe_pickle: bool = False) -> None:
        """Ranks of expert-parallel index p > 0 replace rank 0's experts with slice p's, saved by global rank p."""
        experts = self.experts
        if experts is None or experts.ep_rank == 0:
            return
        source = path / checkpoint.rank_file(experts.ep_rank)
        saved = checkpoint.load_file(source, allow_unsafe_pickle=allow_unsafe_pickle).get("experts") \
            if source.is_file() else None
        if saved is None:
            raise CheckpointError(f"{source} lacks the experts of expert-parallel index {experts.ep_rank}: the "
                                  f"checkpoint was not saved with moe.ep_size={experts.ep_size}")
        self.module.load_state_dict(saved["module"], strict=False)
        if self.optimizer is None:
            return
        if module_only or saved["optimizer"] is None:
            self.optimizer.refresh_masters_from_params()  # they were refreshed from rank 0's experts
        else:
            self.optimizer.load_expert_state_dict(saved["optimizer"], load_optimizer_states=load_optimizer_states)

    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None, *,
                        allow_unsafe_pickle: bool = False) -> tuple[str | None, dict | None]:
        """Restore a checkpoint written by :meth:`save_checkpoint`, after verifying it against its manifest, or one
        written by DeepSpeed itself (:mod:`angelptm.checkpoints.deepspeed_resume`).

        Without ``tag``, a ``latest`` checkpoint that fails verification is skipped (with a warning naming
        the damaged file) for the newest older one that passes; an explicit ``tag`` must pass.

        Args:
            allow_unsafe_pickle: load files that hold more than tensors and plain values (a checkpoint of
                the previous format) by full unpickling, which can run code: only for trusted checkpoints.

        Returns:
            ``(path, client_state)``, or ``(None, None)`` when ``load_dir`` holds no checkpoint.

        Raises:
            CheckpointError: the checkpoint does not verify, or holds unsafe objects without the opt-in.
        """
        self._check_not_destroyed("load_checkpoint")
        self.wait_for_checkpoint()  # (a save in the background may be writing the checkpoint asked for)
        foreign = deepspeed_format.find(load_dir, tag)
        if foreign is not None and custom_load_fn is None:  # a run started on DeepSpeed: read by parameter name
            return deepspeed_resume.load(self, foreign, load_module_strict=load_module_strict,
                                         load_optimizer_states=load_optimizer_states,
                                         load_lr_scheduler_states=load_lr_scheduler_states,
                                         load_module_only=load_module_only)
        path = checkpoint.resolve(load_dir, tag, self.ctx)  # verified; without a tag, the newest that verifies
        if path is None:
            logger.warning("no checkpoint to load in %s (no 'latest' file)", load_dir)
            return None, None
        if custom_load_fn is not None:
            raise NotImplementedError("load_checkpoint(custom_load_fn=...) is not supported")
        unsafe = allow_unsafe_pickle
        model_states = checkpoint.load_file(path / checkpoint.MODEL_FILE, allow_unsafe_pickle=unsafe)
        saved_ep, ep_size = model_states.get("ep_size", 1), self.experts.ep_size if self.experts else 1
        if saved_ep != ep_size:
            raise CheckpointError(f"{path} was saved with moe.ep_size={saved_ep} and this run has {ep_size}: its "
                                  "experts are split differently. Resume with the same ep_size, or export it with "
                                  "`python -m angelptm.checkpoints.export` and load the weights into the model built "
                                  "with ep_size 1")
        self._check_architecture(path, model_states.get("architecture"), load_module_only=load_module_only)
        has_optimizer_file = (path / checkpoint.OPTIM_FILE).is_file()
        optim_states = None
        if self.optimizer is not None and has_optimizer_file:
            lazy = isinstance(self.optimizer, OptimizerCheckpoint)  # (it copies the states one by one, chunk by chunk)
            optim_states = checkpoint.load_file(path / checkpoint.OPTIM_FILE, allow_unsafe_pickle=unsafe, lazy=lazy)
            shards = model_states.get("zero_cache_shards", 1)
            if shards > 1:  # any world size loads it: each rank takes the names it owns now
                checkpoint.merge_zero_cache_shards(path, optim_states["optimizer"], shards, allow_unsafe_pickle=unsafe,
                                                   lazy=lazy)
        module_weights = self._load_module_state(path, model_states, strict=load_module_strict,
                                                 has_optimizer_file=has_optimizer_file,
                                                 from_masters=self._weights_from_masters(optim_states))
        del model_states["module"]  # (its tensors map the file: the pages they touched go with them)
        if optim_states is not None:
            if load_optimizer_states and not load_module_only:  # (the masters alone load in either format)
                # Saved with ZeRO-Cache on and resumed with it off, or the reverse: converted by name, or refused.
                optim_states["optimizer"] = optimizer_format.adapt(optim_states["optimizer"], self.optimizer, path)
            # fp32 masters are the exact weights; the module's copy is rounded to the compute dtype.
            self.optimizer.load_state_dict(optim_states["optimizer"],
                                           load_optimizer_states=load_optimizer_states and not load_module_only)
        elif self.optimizer is not None and module_weights:  # sharded params: the shards take them from the masters
            self.optimizer.load_master_state_dict(module_weights)
        elif self.optimizer is not None:
            self.optimizer.refresh_masters_from_params()
        self._load_expert_slice(path, load_optimizer_states=load_optimizer_states and not load_module_only,
                                module_only=optim_states is None, allow_unsafe_pickle=unsafe)
        if load_module_only:
            return str(path), model_states["client_state"]
        if load_lr_scheduler_states and self.lr_scheduler is not None and optim_states is not None:
            self.lr_scheduler.load_state_dict(optim_states["lr_scheduler"])
        for name in ("global_steps", "global_samples", "micro_steps", "skipped_steps"):
            setattr(self, name, model_states[name])
        self._restore_rank_state(path, model_states["world_size"], allow_unsafe_pickle=unsafe)
        return str(path), model_states["client_state"]

    def _check_architecture(self, path: Path, saved: dict | None, *, load_module_only: bool) -> None:
        """Refuse to resume a checkpoint into a model whose recorded architecture differs, before loading anything.

        A changed ``num_heads`` loads without a size mismatch and computes other logits; a changed size dies in
        torch's traceback. With ``load_module_only`` (take the weights into a new model on purpose) it is a warning,
        and the weights' shapes must still match.
        """
        changed = architecture.differences(saved, architecture.describe(self.module))
        if not changed:
            return
        keys = "; ".join(changed)
        if load_module_only:
            logger.warning("%s was saved from another architecture (%s); loading its weights only, as asked", path,
                           keys)
            return
        raise CheckpointError(
            f"{path} was saved from another model architecture: {keys}. Resuming would load its weights and "
            "optimizer states into a different model. Either set the model back to the recorded values, start a "
            "new run in another directory (pretrain.py --save-dir NEW_DIR; --no-resume alone refuses a directory "
            "that holds a run), or take only its weights with load_checkpoint(..., load_module_only=True) where "
            "their shapes still match")

    def _weights_from_masters(self, optim_states: dict | None) -> set[str]:
        """State-dict keys of the weights the optimizer's load rewrites from the checkpoint's fp32 masters (ZeRO-Cache:
        every trained parameter's compute copy is restored from its master), so reading them from the module's file
        as well would only be overwritten: at 2.7B, 4.8 GB of bf16 weights read and copied for nothing. Empty when the
        masters do not cover every trained parameter (the load then refuses, or another engine loads)."""
        if not isinstance(self.optimizer, OptimizerCheckpoint) or optim_states is None:
            return set()
        masters = optim_states["optimizer"].get("masters") if isinstance(optim_states["optimizer"], dict) else None
        names = set(self.optimizer.names)
        if masters is None or not all(name in masters for name in names):
            return set()
        return {key for key, name in self._param_aliases().items() if name in names}

    def _load_module_state(self, path: Path, model_states: dict, *, strict: bool, has_optimizer_file: bool,
                           from_masters: set[str] = frozenset()) -> dict[str, torch.Tensor]:
        """Load the module's state, except weights this run holds sharded, or a sharded run saved in its masters,
        or ``from_masters``: weights the optimizer's load restores from the masters.

        Returns:
            The saved weights of the sharded params by parameter name (fp32), for the masters when there
            are no optimizer states to take them from; otherwise empty.
        """
        state = model_states["module"]
        aliases = self._param_aliases()
        held, in_masters = self._sharded_weight_keys(aliases), model_states.get("weights_in_masters", False)
        if not held and not in_masters and not from_masters:
            try:
                self.module.load_state_dict(state, strict=strict)
            except RuntimeError as err:  # torch lists every mismatch in a multi-line traceback
                if not any(kind in str(err) for kind in ("size mismatch", "Missing key", "Unexpected key")):
                    raise
                raise CheckpointError(f"{path}: the saved weights do not fit this model: "
                                      + " ".join(str(err).split())[:600]) from None
            return {}
        if in_masters and (self.optimizer is None or not has_optimizer_file):
            raise CheckpointError(f"{path} was saved with ZeRO-Cache's params sharded: its weights are the fp32 "
                                  f"masters in {checkpoint.OPTIM_FILE}, which this load cannot use (it is missing, or "
                                  "the engine has no optimizer). Export it with `python -m "
                                  "angelptm.checkpoints.export` and load the weights into the model instead")
        weights = {aliases[key]: tensor.float() for key, tensor in state.items() if key in held} \
            if not has_optimizer_file else {}
        skipped = held | from_masters
        try:
            result = self.module.load_state_dict({k: v for k, v in state.items() if k not in skipped}, strict=False)
        except RuntimeError as err:
            if "size mismatch" not in str(err):
                raise
            raise CheckpointError(f"{path}: the saved weights do not fit this model: "
                                  + " ".join(str(err).split())[:600]) from None
        saved_weights = set(model_states["param_aliases"]) if in_masters else set()
        missing = set(result.missing_keys) - skipped - saved_weights
        if strict and (missing or result.unexpected_keys):
            raise CheckpointError(f"{path}: the module state does not match the model: missing {sorted(missing)[:5]}, "
                                  f"unexpected {sorted(result.unexpected_keys)[:5]}")
        return weights

    def _restore_rank_state(self, path: Path, saved_world_size: int, *, allow_unsafe_pickle: bool = False) -> None:
        rank_path = path / checkpoint.rank_file(self.ctx.rank)
        if saved_world_size != self.world_size or not rank_path.is_file():
            # Per-rank RNG streams cannot carry over to another world size; the data position can,
            # as a count of samples consumed by all ranks together.
            logger.warning("checkpoint was saved with %d ranks, now %d: RNG streams start fresh, data resumes "
                           "after %d samples", saved_world_size, self.world_size, self.global_samples)
            if self.training_dataloader is not None:
                self.training_dataloader.seek(self.global_samples)
            return
        per_rank = checkpoint.load_file(rank_path, allow_unsafe_pickle=allow_unsafe_pickle)
        checkpoint.restore_rng_state(per_rank["rng"])
        if self.training_dataloader is not None and per_rank["data"] is not None:
            self.training_dataloader.load_state_dict(per_rank["data"])
