"""The engine's saves: its checkpoints, its consolidated weights and their fp32 export (a mixin of :class:`Engine`).

Files and their atomic protocol are :mod:`angelptm.checkpoints.files`'s; this module decides what goes in
them: the module's state (weights in the fp32 masters when ZeRO-Cache shards them), the optimizer and
scheduler, the steps, every rank's RNG streams and data position, and expert-parallel slices. Reading them back is
:mod:`angelptm.checkpoints.engine_load`'s.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

import torch

from angelptm.checkpoints import architecture, writer_lock
from angelptm.checkpoints import background as background_save
from angelptm.checkpoints import files as checkpoint
from angelptm.engine.expert_parallel import ExpertParallel
from zero_cache import OptimizerCheckpoint

logger = logging.getLogger("angelptm.engine.engine")

STAGED_CHUNKS = 2
"""ZeRO-Cache checkpoints: chunks of optimizer states staged in host memory at once by default (one being written,
one staged behind it). Each is ``12 x chunk_size`` bytes (fp32 master, exp_avg, exp_avg_sq)."""


class EngineSaves:
    """Save methods of :class:`~angelptm.engine.engine.Engine` (they use its module, optimizer, counters and
    whether it was destroyed), and the names of its state that loading shares
    (:class:`~angelptm.checkpoints.engine_load.EngineLoads`)."""

    _in_flight: background_save.InFlightSave
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
        return self._in_flight.hold(pending)

    def wait_for_checkpoint(self) -> Path | None:
        """Wait for a checkpoint still being written (``save_checkpoint(background=True)``).

        Returns:
            Its directory, or None when none was being written.

        Raises:
            Its error (the previous checkpoint and ``latest`` are then untouched), once.
        """
        return self._in_flight.wait()

    @property
    def saving_in_background(self) -> bool:
        """Whether a checkpoint started with ``save_checkpoint(background=True)`` is still being written (its writer
        has not finished: ``latest`` may not name it yet)."""
        return self._in_flight.writing

    def _checkpoint_goes_on(self, *, report: bool = False) -> None:
        """At the engine's calls: a save in the background stages chunks into its free buffers; with ``report`` (the
        step), a save whose writer failed raises its error (once; the save is then over)."""
        self._in_flight.goes_on(report=report)

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

    def _sharded_weight_keys(self, aliases: dict[str, str]) -> set[str]:
        """State-dict keys of the weights this run keeps only as ZeRO-Cache shards (none when params are replicated)."""
        if self.optimizer is None or not self.optimizer.params_sharded:
            return set()
        held = set(self.optimizer.names)
        return {key for key, name in aliases.items() if name in held}

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
