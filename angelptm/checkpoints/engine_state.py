"""The engine's checkpoints: save, load, consolidate and export its weights (a mixin of :class:`Engine`).

Files and their atomic protocol are :mod:`angelptm.checkpoints.files`'s; this module decides what goes in
them: the module's state (weights in the fp32 masters when ZeRO-Cache shards them), the optimizer and
scheduler, the steps, every rank's RNG streams and data position, and expert-parallel slices.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

import torch

from angelptm.checkpoints import architecture, deepspeed_format, deepspeed_resume, optimizer_format, writer_lock
from angelptm.checkpoints import background as background_save
from angelptm.checkpoints import files as checkpoint
from angelptm.engine.expert_parallel import ExpertParallel
from angelptm.errors import CheckpointError
from zero_cache import OptimizerCheckpoint

logger = logging.getLogger("angelptm.engine.engine")

STAGED_CHUNKS = 2
"""ZeRO-Cache checkpoints: chunks of optimizer states staged in host memory at once by default (one being written,
one staged behind it). Each is ``12 x chunk_size`` bytes (fp32 master, exp_avg, exp_avg_sq)."""


class EngineCheckpoints:
    """Checkpoint methods of :class:`~angelptm.engine.engine.Engine` (they use its module, optimizer, counters and
    whether it was destroyed)."""

    _pending_save: background_save.PendingSave | None = None
    """A checkpoint being written beside training (``save_checkpoint(background=True)``)."""

    @property
    def zero_cache_shards(self) -> int:
        """Ranks over which ZeRO-Cache shards the optimizer states (1: not sharded)."""
        sharding = self.optimizer.sharding if self.optimizer is not None else None
        return sharding.world_size if sharding is not None else 1

    def _named_master_weights(self) -> dict[str, torch.Tensor]:
        if self.optimizer is None:
            return {name: p.detach().float().cpu().clone() for name, p in self.module.named_parameters()}
        masters = self.optimizer.master_state_dict()
        if self.zero_cache_shards > 1:  # each rank holds its chunks' masters: a collective gathers them all
            parts: list[Any] = [None] * self.world_size
            torch.distributed.all_gather_object(parts, masters, group=self.ctx.group)
            masters = {name: tensor for part in parts for name, tensor in part.items()}
        return masters

    def _param_aliases(self) -> dict[str, str]:
        """state_dict key -> the named_parameters name of the same tensor (tied weights)."""
        canonical = {id(p): name for name, p in self.module.named_parameters()}
        return {key: canonical[id(t)] for key, t in self.module.state_dict(keep_vars=True).items()
                if id(t) in canonical}

    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """The full module state dict with fp32 weights on CPU, loadable into the plain model.

        With sharded ZeRO-Cache states every rank must call it (the masters are gathered)."""
        self._check_not_destroyed("consolidated_state_dict")
        self._refuse_spread_experts()
        masters = self._named_master_weights()  # first: it waits for weights still landing from the last step
        self._sync_params()
        return checkpoint.consolidate(self.module.state_dict(), masters, self._param_aliases())

    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False, *,
                        background: bool = False, max_staged_chunks: int = STAGED_CHUNKS) -> Path:
        """Save model, optimizer, scheduler, loss scaler, RNG and data position atomically.

        Saving between accumulation boundaries drops the partial gradient sum (as DeepSpeed does);
        that is logged, since the resumed step then sums fewer micro-batches.

        With ZeRO-Cache the optimizer's states are streamed from a snapshot, at most ``max_staged_chunks`` chunks
        staged in host memory at a time (:mod:`angelptm.checkpoints.background`). A save still being written is
        waited for first (and its error raised).

        Args:
            background: (ZeRO-Cache, one process) return once the first chunks are staged and write the rest beside
                training: the files hold the states of this step (each chunk is staged before the next step changes
                it), and ``latest`` moves when every file is complete and fsynced.
                :meth:`wait_for_checkpoint` waits for it; the next save, load, step or ``destroy()`` raises its
                error. Elsewhere the save is written before this returns.
            max_staged_chunks: ZeRO-Cache: chunks of optimizer states staged in host memory at once.

        Returns:
            The checkpoint directory ``save_dir/tag`` (with ``background``: where it will be).
        """
        self._check_not_destroyed("save_checkpoint")
        self.wait_for_checkpoint()
        tag = tag or f"global_step{self.global_steps}"
        if self.micro_steps % self.gradient_accumulation_steps() and self.ctx.is_main:
            logger.warning("saving in the middle of gradient accumulation (micro-step %d of %d): the partial "
                           "gradients are not saved", self.micro_steps % self.gradient_accumulation_steps(),
                           self.gradient_accumulation_steps())
        experts = self.experts
        shards = self.zero_cache_shards
        self._sync_params()  # rank 0 writes the module: its non-owned chunks come from their owners first
        self._join_save_dir(save_dir)  # the save takes its writer lock (the lowest rank writing there)
        if isinstance(self.optimizer, OptimizerCheckpoint) and experts is None:
            return self._save_streamed(save_dir, tag, client_state, save_latest=save_latest,
                                       exclude_frozen=exclude_frozen_parameters, background=background,
                                       max_staged_chunks=max_staged_chunks)

        def shared() -> dict[str, Any]:
            if self.optimizer is not None:
                self.optimizer.finish_pending()  # weights may still be landing from a background update
            files = {checkpoint.MODEL_FILE: self._model_states(client_state, self.module.state_dict(),
                                                               exclude_frozen=exclude_frozen_parameters)}
            if self.optimizer is not None:
                files[checkpoint.OPTIM_FILE] = self._optim_states(self.optimizer.state_dict())
            return files

        per_rank = self._per_rank_state()
        if shards > 1 and self.ctx.rank > 0:  # rank 0's shard is in the optimizer file
            per_rank[checkpoint.ZERO_CACHE_SHARD] = self.optimizer.state_dict()
        if experts is not None and 0 < self.ctx.rank < experts.ep_size:
            # The shared files hold rank 0's experts; ranks 1..W-1 of the first expert-parallel group
            # hold the other slices, so they write theirs (every expert-data-parallel replica equals one).
            expert_names = self._expert_state_names(experts)
            per_rank["experts"] = {"module": {k: v for k, v in self.module.state_dict().items() if k in expert_names},
                                   "optimizer": self.optimizer.expert_state_dict() if self.optimizer is not None
                                   else None}
        return checkpoint.save(save_dir, tag, self.ctx, shared=shared, per_rank=per_rank, save_latest=save_latest)

    def _save_streamed(self, save_dir: str, tag: str, client_state: dict | None, *, save_latest: bool,
                       exclude_frozen: bool, background: bool, max_staged_chunks: int) -> Path:
        """ZeRO-Cache's save: the states (and the weights, cast from their masters) stream from a snapshot."""
        optimizer = self.optimizer
        alone = self.ctx.group is None
        if background and not alone and self.ctx.is_main:
            logger.warning("save_checkpoint(background=True) writes in the background in a single process only: "
                           "with %d ranks the save is written before it returns", self.world_size)
        snapshot = optimizer.begin_snapshot(max_staged=max_staged_chunks)  # (settles every update in flight)
        states = optimizer.state_refs()
        shared: dict[str, Any] = {}
        if self.ctx.is_main:
            module_state = self.module.state_dict()
            aliases = self._param_aliases()
            for key, name in aliases.items():  # the weights this rank's snapshot holds: cast from their masters
                if key in module_state and name in states["masters"]:
                    module_state[key] = dataclasses.replace(states["masters"][name], dtype=module_state[key].dtype)
            shared[checkpoint.MODEL_FILE] = self._model_states(client_state, module_state,
                                                               exclude_frozen=exclude_frozen)
            shared[checkpoint.OPTIM_FILE] = self._optim_states(states)
        per_rank = self._per_rank_state()
        if self.zero_cache_shards > 1 and self.ctx.rank > 0:
            per_rank[checkpoint.ZERO_CACHE_SHARD] = states
        pending = background_save.save_streamed(
            save_dir, tag, self.ctx, shared=shared, per_rank=per_rank, snapshot=snapshot, save_latest=save_latest,
            background=background and alone, on_end=lambda: optimizer.end_snapshot(snapshot))
        if pending.done():
            return pending.wait()
        self._pending_save = pending
        return pending.target.final

    def wait_for_checkpoint(self) -> Path | None:
        """Wait for a checkpoint still being written (``save_checkpoint(background=True)``).

        Returns:
            Its directory, or None when none was being written.

        Raises:
            Its error (the previous checkpoint and ``latest`` are then untouched), once.
        """
        pending, self._pending_save = self._pending_save, None
        return pending.wait() if pending is not None else None

    @property
    def saving_in_background(self) -> bool:
        """Whether a checkpoint started with ``save_checkpoint(background=True)`` is still being written (its writer
        has not finished: ``latest`` may not name it yet)."""
        pending = self._pending_save
        return pending is not None and not pending.done()

    def _checkpoint_goes_on(self, *, report: bool = False) -> None:
        """At the engine's calls: a save in the background stages chunks into its free buffers; with ``report`` (the
        step), a save whose writer failed raises its error (once; the save is then over)."""
        pending = self._pending_save
        if pending is None:
            return
        if report and pending.failed():
            self.wait_for_checkpoint()
        pending.pump()

    def _model_states(self, client_state: dict | None, module_state: dict[str, Any], *,
                      exclude_frozen: bool) -> dict[str, Any]:
        """``model_states.pt``'s contents: the module (without the weights held as shards), counters, client state."""
        experts = self.experts
        aliases = self._param_aliases()
        held = self._sharded_weight_keys(aliases)
        module_state = {k: v for k, v in module_state.items() if k not in held}  # they are in the masters
        if exclude_frozen:
            frozen = {name for name, p in self.module.named_parameters() if not p.requires_grad}
            module_state = {k: v for k, v in module_state.items() if k not in frozen}
        return {
            "format_version": checkpoint.FORMAT_VERSION, "module": module_state,
            "param_aliases": aliases, "weights_in_masters": bool(held),
            "global_steps": self.global_steps,
            "global_samples": self.global_samples, "micro_steps": self.micro_steps,
            "skipped_steps": self.skipped_steps, "world_size": self.world_size,
            "ep_size": experts.ep_size if experts is not None else 1, "zero_cache_shards": self.zero_cache_shards,
            "expert_state_keys": sorted(self._expert_state_names(experts)) if experts is not None else [],
            "dtype": str(self.compute_dtype), "client_state": dict(client_state or {}),
            # The architecture as JSON text, for `python -m angelptm.checkpoints.export --hf` (None: not a
            # known kind).
            "architecture": architecture.describe(self.module),
        }

    def _optim_states(self, optimizer_state: dict[str, Any]) -> dict[str, Any]:
        return {"optimizer": optimizer_state,
                "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None}

    def _per_rank_state(self) -> dict[str, Any]:
        return {"rng": checkpoint.capture_rng_state(),
                "data": self.training_dataloader.state_dict() if self.training_dataloader else None}

    def _join_save_dir(self, save_dir: str | os.PathLike) -> None:
        """Record ``save_dir`` (its real path, resolved now) as one this engine saves into, counted once per
        engine among the users of its writer lock (:meth:`_release_save_dirs` leaves it)."""
        if os.path.realpath(save_dir) not in self._save_dirs:
            self._save_dirs.add(writer_lock.LOCKS.join(save_dir))

    def _release_save_dirs(self) -> None:
        """Leave the writer locks this engine's saves took (at ``destroy()``): the last engine of the process to
        leave one gives it back. Nothing would wait for it, but the next process to save there would report
        taking over from a process that is gone."""
        for key in self._save_dirs:
            writer_lock.LOCKS.leave(key)
        self._save_dirs.clear()

    def _expert_state_names(self, experts: ExpertParallel) -> set[str]:
        ids = {id(t) for t in self.module.parameters() if id(t) in experts.expert_ids}
        return {k for k, t in self.module.state_dict(keep_vars=True).items() if id(t) in ids}

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

    def _sharded_weight_keys(self, aliases: dict[str, str]) -> set[str]:
        """State-dict keys of the weights this run keeps only as ZeRO-Cache shards (none when params are replicated)."""
        if self.optimizer is None or not self.optimizer.params_sharded:
            return set()
        held = set(self.optimizer.names)
        return {key for key, name in aliases.items() if name in held}

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

    def save_fp32_model(self, path: str) -> None:
        """Write the consolidated fp32 weights to one safetensors file (rank 0; every rank calls it)."""
        state = self._state_dict_for_writer()
        if state is not None:
            checkpoint.save_safetensors(state, path)
        self.ctx.barrier()

    def _refuse_spread_experts(self) -> None:
        if self.experts is not None:
            raise NotImplementedError("consolidating a model whose experts are spread over ranks (moe.ep_size > 1) "
                                      "needs every rank's experts: save a checkpoint and export it offline with "
                                      "`python -m angelptm.checkpoints.export`")

    def _state_dict_for_writer(self) -> dict[str, torch.Tensor] | None:
        """:meth:`consolidated_state_dict` on rank 0, None elsewhere (every rank calls it: sharded masters are
        gathered by all; a model that cannot be consolidated is refused on every rank, before any collective).
        After :meth:`destroy` the module's own state dict: it holds the whole weights (in the compute dtype), and
        the masters are gone."""
        if self.destroyed:
            return {key: value.detach().cpu() for key, value in self.module.state_dict().items()} \
                if self.ctx.is_main else None
        self._refuse_spread_experts()
        if not (self.ctx.is_main or self.zero_cache_shards > 1):
            return None
        state = self.consolidated_state_dict()
        return state if self.ctx.is_main else None

    def _sync_params(self) -> None:
        """Bring every rank's param chunks up to date (sharded ZeRO-Cache; a collective)."""
        if self.zero_cache_shards > 1:
            self.optimizer.sync_params()

