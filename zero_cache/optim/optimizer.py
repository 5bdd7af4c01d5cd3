"""The hybrid Adam over chunked model states: GPU-resident groups on the device, the rest on the host.

Gradients leave autograd by a post-accumulate-grad hook, written over their own parameters (one micro-batch per
step: no gradient buffers) or added into fp32 accumulators (:mod:`zero_cache.optim.optimizer_gradients`). Update
order (exact: every update uses this step's gradients, like a plain AdamW loop):

1. host chunks are queued on the host worker (:mod:`zero_cache.optim.host_update`): with ``update_in_backward``, as
   soon as a chunk's gradient is complete, with the clip factor taken as 1, and ``step()``, which knows the global
   norm, revises them (:mod:`zero_cache.optim.revision`); else by ``step()``, in forward order; host groups the plan
   names are stepped on the device instead (:mod:`zero_cache.optim.device_steps`);
2. the device chunks are updated by the device's Adam on the compute stream (:mod:`zero_cache.optim.device_groups`);
3. the next forward waits, per chunk, only for that chunk's update (a stream-event wait, no ``synchronize()``), so
   late chunks' updates overlap early layers' compute. On a CPU-only run every path runs the same way (copies are
   synchronous), which is what the unit tests exercise.

**Data-parallel sharding** (``store.sharding`` over W > 1 ranks) and gathered params: each rank updates only the
chunks it owns, from gradients reduced while backward runs (:mod:`zero_cache.optim.optimizer_sharded`).

**Parts.** The optimizer keeps the step (the norm, the clip, which update each chunk gets) and owns collaborators
given what they use: the gradient intake (:class:`~zero_cache.optim.optimizer_gradients.GradientIntake`) and the
sharded side (:class:`~zero_cache.optim.optimizer_sharded.ShardedGradients`), which ask the step whether a complete
chunk is updated now through a small protocol (:class:`~zero_cache.optim.optimizer_sharded.Speculation`); the
update side (:class:`~zero_cache.optim.chunk_updates.ChunkUpdates`: the host worker's and the device steps' queues and
the waits for them, each chunk's state in its step record, :mod:`zero_cache.optim.step_record`); the device-held
groups' Adam (:class:`~zero_cache.optim.device_groups.DeviceGroups`); the window's bookkeeping
(:class:`~zero_cache.optim.window.AccumulationWindow`); the states by parameter name for checkpoints
(:class:`~zero_cache.optim.optimizer_state.NamedStates`, behind the public
:class:`~zero_cache.optim.optimizer_state.OptimizerCheckpoint` methods); the step's timing
(:class:`~zero_cache.optim.step_clock.StepClock`); and the counts and tier figures a report reads
(:class:`~zero_cache.optim.counters.OptimizerCounters`).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, ContextManager

import torch

from zero_cache.optim.chunk_updates import ChunkUpdates
from zero_cache.optim.counters import OptimizerCounters
from zero_cache.optim.device_groups import DeviceGroups
from zero_cache.optim.device_steps import DeviceSteps
from zero_cache.optim.host_adam import HostAdam
from zero_cache.optim.host_update import HostUpdater
from zero_cache.optim.optimizer_gradients import GradientIntake
from zero_cache.optim.optimizer_sharded import ShardedGradients
from zero_cache.optim.optimizer_state import NamedStates, OptimizerCheckpoint, trained_members
from zero_cache.optim.release import release
from zero_cache.optim.revision import SpeculationWindow
from zero_cache.optim.step_clock import StepClock
from zero_cache.optim.step_observer import StepObserver, StepTimings
from zero_cache.optim.step_record import ChunkSteps
from zero_cache.optim.window import AccumulationWindow
from zero_cache.plan.layout import TensorSlot
from zero_cache.plan.placement import Plan
from zero_cache.plan.state_costs import UPDATED_HERE, Route
from zero_cache.plan.tier_names import DEVICE
from zero_cache.runtime.exchange import ChunkExchange
from zero_cache.runtime.gathered import RecordedGathers
from zero_cache.runtime.transfers import Transfers
from zero_cache.storage.chunks import ChunkStore


class ZeroCacheOptimizer(OptimizerCheckpoint, torch.optim.Optimizer):
    """Engine-facing optimizer over a :class:`ChunkStore` (same surface as the replicated one).

    A ``torch.optim.Optimizer`` by type, so torch and transformers LR schedulers accept it; its
    ``param_groups`` are the client optimizer's, from which every step reads its hyperparameters
    (:meth:`_hypers`), so a scheduler's lr is the one applied. ``Optimizer.__init__`` is not run:
    step hooks (``register_step_pre_hook``) are not available.

    Args:
        store: chunk storage, already bound to the module's parameters.
        optimizer: the torch optimizer built over the parameters; only its param groups (and their
            hyperparameters, which schedulers write) are used, never its step.
        names: id(parameter) -> qualified name.
        plan: the plan the store was built with, put in force by :meth:`apply_plan` as every later one is (its
            working set, its device-stepped groups).
        decoupled_weight_decay: AdamW (True) or Adam with L2 (False).
        loss_scaler: fp16 loss scaler (``.scale``, ``.update(overflow)``), or None.
        gradient_clipping: max global gradient norm (0 = off).
        update_in_backward: queue host chunks from backward (see ``ZeroCacheConfig.update_in_backward``).
        fold_waited: fold the moments of waited host updates in later (``ZeroCacheConfig.fold_waited_updates``).
        native_host_adam: host chunks by ``csrc/fused_host_adam.cpp`` (``ZeroCacheConfig.native_host_adam``).
        overlap_comm: sharded: reduce each group from backward (``ZeroCacheConfig.overlap_comm``).
        gather_ahead: sharded replicated params: groups gathered ahead (``ZeroCacheConfig.gather_ahead_elements``).
        deepspeed_import: where ``import deepspeed`` gives the installed DeepSpeed (:class:`HostAdam`).
    """

    def __init__(self, store: ChunkStore, optimizer: torch.optim.Optimizer, names: dict[int, str], plan: Plan, *,
                 decoupled_weight_decay: bool = True, loss_scaler: Any = None, gradient_clipping: float = 0.0,
                 update_in_backward: bool = False, native_host_adam: bool = False, overlap_comm: bool = True,
                 fold_waited: bool = True, gather_ahead: int = 1,
                 deepspeed_import: Callable[[], ContextManager[Any]] = contextlib.nullcontext) -> None:
        self.store = store
        self.optimizer = optimizer
        self.loss_scaler = loss_scaler
        self.gradient_clipping = gradient_clipping
        self.update_in_backward = update_in_backward
        self.device = store.tiers[DEVICE].device
        self.sharding = store.sharding
        self.transfers = Transfers(self.device)
        self.timeline = self.transfers.timeline  # (copies, host jobs, disk requests, waits; when a step is traced)
        for home in store.all_homes():
            home.use_timeline(self.timeline)
        self.members, self._members_of_chunk = trained_members(optimizer.param_groups, store.slots, names)
        """(param-group index, slot) of every trained parameter, in the optimizer's order; and by chunk."""
        self.names = [slot.name for _, slot in self.members]
        self.step_count = 0
        self.overflow = False
        self.last_grad_norm: float | None = None
        self.speculating = update_in_backward
        """Whether this window updates host chunks during backward (the prediction; revision.py)."""
        self.named_states = NamedStates(store, self.members, self._members_of_chunk, optimizer=optimizer,
                                        loss_scaler=loss_scaler, settle=self.finish_pending,
                                        restore_params=self._restore_params)
        """The states by parameter name: the checkpoint surface's (:class:`OptimizerCheckpoint`)."""
        self.step_clock = StepClock(self.device)
        """Times each step and its backward (its ``clock``, faked by tests; :attr:`last_backward_seconds`)."""
        self.host_adam = HostAdam(decoupled_weight_decay, try_deepspeed=self.device.type == "cuda",
                                  try_native=native_host_adam, deepspeed_import=deepspeed_import,
                                  state_dtype=store.state_dtype)
        self.chunk_steps = ChunkSteps(store.layout.num_chunks)
        """Where each chunk's update stands (:mod:`zero_cache.optim.step_record`), shared with the host worker."""
        self.host = HostUpdater(store, self.transfers, self.host_adam, self.chunk_steps)
        self.device_adam = DeviceGroups(store, decoupled_weight_decay=decoupled_weight_decay,
                                        step_clock=self.step_clock, before_update=self.named_states.before_update,
                                        fence=lambda: self.device_steps.fence())
        self.device_steps = DeviceSteps(store, self.transfers, self.device_adam.adam)
        self.reports = OptimizerCounters(store, self.transfers, self.host, self.device)
        """What a report reads: the counts and waits since the last :meth:`report`, the tiers' groups and shards."""
        self.updates = ChunkUpdates(store, self.transfers, self.host, self.device_steps, steps=self.chunk_steps,
                                    counters=self.reports, before_update=self.named_states.before_update,
                                    landed=lambda chunk: self.exchange.landed.get(self.sharding.group_of(chunk))
                                    if self.exchange is not None else None)
        self.exchange = (ChunkExchange(store, self.updates.wait_for_chunk, accumulate=store.grads_in_accumulators,
                                       gather_ahead=gather_ahead, overlap_comm=overlap_comm, transfers=self.transfers)
                         if self.sharding.sharded or store.shard_params else None)
        self.device_stepped: frozenset[int] = frozenset()
        """Host-tier chunks updated by :attr:`device_steps` after backward, not by the host worker (the plan's)."""
        self.window = AccumulationWindow(self._members_of_chunk, num_chunks=store.layout.num_chunks,
                                         group_of=self.sharding.group_of,
                                         num_groups=self.sharding.num_groups(store.layout.num_chunks),
                                         device=self.device)
        """This accumulation window's bookkeeping, shared by the gradient intake, the sharded side and the step."""
        self.sharded = (ShardedGradients(store, self.exchange, self.window, self.updates, speculation=self,
                                         members_of_chunk=self._members_of_chunk, overlap_comm=overlap_comm)
                        if self.exchange is not None else None)
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        self.intake = GradientIntake(store, self.window, self.updates, speculation=self, sharded=self.sharded,
                                     step_clock=self.step_clock, members=self.members, params=params)
        self._stepped_once = False
        self.observer: StepObserver | None = None
        """Told of each applied step (the warm-up's re-plan and tuning), registered by :meth:`observe`."""
        self.last_updates_after_backward = False
        """Whether the last step's host updates waited for its backward to end (no speculation in backward)."""
        self.fold_waited = fold_waited
        """Waited host updates store the weight and keep the gradient, a job behind them folds the moments in
        (:mod:`zero_cache.optim.revision`, "Waited steps"); False: they store everything in their pass."""
        self.hooks: list[Any] = [param.register_post_accumulate_grad_hook(self.intake.make_hook(slot))
                                 for param, (_, slot) in zip(params, self.members)]
        """Handles of the hooks on the parameters and (added by :func:`~zero_cache.attach.attach`) the modules, which
        :meth:`destroy` removes."""
        self.destroyed = False
        """Whether :meth:`destroy` released everything (then it cannot step)."""
        self._reset_window()
        self.apply_plan(plan)

    def destroy(self) -> None:
        """Hand the module its weights, remove the hooks and free everything else now (``engine.destroy()``;
        :mod:`zero_cache.optim.release`). The optimizer cannot step again."""
        release(self)
        self.destroyed = True

    # ------------------------------------------------------------------ torch.optim surface
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not possible: chunks are laid out over the parameters given to ``initialize()``."""
        raise NotImplementedError("zero_cache lays out its chunks over the parameters given at initialize(); a "
                                  "param group cannot be added later. Pass every parameter you will train to "
                                  "angelptm.initialize (a later-unfrozen one included, frozen until then)")

    @property
    def state(self) -> dict:
        return {"step": self.step_count}

    @property
    def gradients_pending(self) -> bool:
        """A backward of this window wrote gradients that no step has taken yet (in param chunks, or accumulators)."""
        return bool(self.window.written)

    @property
    def params_sharded(self) -> bool:
        """Each rank stores only its shards of the params: the weights are whole only in the fp32 masters."""
        return self.store.shard_params

    # ------------------------------------------------------------------ the engine's backward and forward
    def accumulating(self) -> ContextManager[None]:
        """The engine's backward runs inside (:meth:`GradientIntake.accumulating
        <zero_cache.optim.optimizer_gradients.GradientIntake.accumulating>`)."""
        return self.intake.accumulating()

    def prepare_backward(self, boundary: bool) -> None:
        """Told by the engine before each backward whether it completes an accumulation window."""
        self.intake.prepare_backward(boundary)

    def prepare_chunk(self, chunk: int) -> None:
        """Make ``chunk``'s params current before a forward uses it (forward pre-hook): wait for its update, or,
        sharded, gather its group from the owners (see :class:`ChunkExchange`)."""
        if self.exchange is None:
            self.updates.wait_for_chunk(chunk)
        else:
            self.exchange.prepare(chunk)

    def sync_params(self) -> None:
        """Gather every stale group now (sharded; every rank calls it, e.g. before a checkpoint)."""
        if self.exchange is not None:
            self.exchange.sync()

    # ------------------------------------------------------------------ what reports may read (not the store)
    @property
    def last_backward_seconds(self) -> float | None:
        """The last step's backward as it ran (:class:`~zero_cache.optim.step_clock.StepClock`)."""
        return self.step_clock.last_backward_seconds

    @property
    def plan(self) -> Plan:
        """The placement plan in force (its summary, and what it predicted a step costs)."""
        return self.store.plan

    def report(self) -> dict[str, float]:
        """Per-tier bytes and the traffic and waiting since the previous report (:class:`OptimizerCounters`)."""
        return self.reports.report()

    def tier_usage(self) -> dict[str, tuple[int, int]]:
        """Tier name -> (bytes in use, budget bytes), now."""
        return self.reports.tier_usage()

    # ------------------------------------------------------------------ the warm-up's seam (:mod:`~.step_observer`)
    def observe(self, observer: StepObserver) -> None:
        """Tell ``observer`` of every applied step from now on (it replaces the one before, if any)."""
        self.observer = observer

    def step_timings(self) -> StepTimings:
        """The work the steps timed since the last call or :meth:`restart_step_timings` (then forgotten)."""
        return StepTimings(host_adam=self.host.adam_work.take(), device_steps=self.device_steps.timing.work.take(),
                           device_adam=self.device_adam.timing.work.take())

    def restart_step_timings(self) -> None:
        """Forget the work timed so far, a step's still open included (it ran under other conditions)."""
        self.host.adam_work.take()
        self.device_steps.timing.restart()
        self.device_adam.timing.restart()

    def host_adam_probe(self, dtype: torch.dtype) -> Any:
        """The host's Adam as a rate probe runs it (:meth:`HostAdam.probe_work <.host_adam.HostAdam.probe_work>`)."""
        return self.host_adam.probe_work(dtype)

    def lent_bounce_buffer(self) -> ContextManager[torch.Tensor | None]:
        """A state homes' bounce buffer for a disk probe, or None (:meth:`ChunkStore.lent_bounce_buffer`)."""
        return self.store.lent_bounce_buffer()

    def recorded_gathers(self, under: Plan | None = None) -> RecordedGathers | None:
        """Gathered params: what the warm-up recorded, under ``under`` or the plan in force (:meth:`ChunkExchange.
        recorded_gathers <zero_cache.runtime.exchange.ChunkExchange.recorded_gathers>`); None where nothing is."""
        return self.exchange.recorded_gathers(under) if self.exchange is not None else None

    # ------------------------------------------------------------------ a window without a step
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start a new accumulation window: drop this one's gradients (and take back its updates during backward)."""
        if self.exchange is not None:  # reductions in flight write into the chunks about to be restored
            self.sharded.finish_micro_step() if self.store.grads_in_accumulators else self.exchange.completed()
        self.updates.drain_gradients()
        self._take_back(frozenset(self.window.written), restore_unreached=False)

    def _take_back(self, written: frozenset, *, restore_unreached: bool) -> None:
        """End the window without a step: revise the speculative updates away, restore overwritten params."""
        for chunk in self.chunk_steps.speculated():
            self.updates.revise(chunk, skip=True)
        if written and not self.store.grads_in_accumulators:
            self._restore_params(written)  # the dropped gradients overwrote parameters
            if restore_unreached:
                self._restore_unreached(written)
        self._reset_window()

    def _reset_window(self) -> None:
        self.window.reset()
        self.chunk_steps.new_window()
        self.sharded.new_micro_step() if self.sharded is not None else self.window.reset_group_counts()

    # ------------------------------------------------------------------ updates during backward (Speculation)
    def speculates(self, chunk: int) -> bool:
        """Whether ``chunk`` (its gradient complete) is updated now, during backward (:mod:`~.revision`)."""
        group = self.store.groups[chunk]
        return (self.speculating and group.home.route is Route.HOST_ADAM and chunk not in self.device_stepped
                and (group.kept is not None or self.store.grads_in_accumulators))

    def speculate(self, chunk: int, squares: torch.Tensor | None) -> None:
        """Update ``chunk`` now with the clip factor taken as 1; ``step()`` revises it (``squares``: its squared
        gradient norm, copied from the device; None: the worker takes it from the accumulator)."""
        scale = self.loss_scaler.scale if self.loss_scaler else 1.0
        factor = 1.0 / (scale * self.sharding.world_size if self.exchange is not None else scale)
        if self.window.speculation is None:
            self.window.speculation = SpeculationWindow(self.gradient_clipping, factor)
        self.updates.queue_host(chunk, self._step_members(chunk, frozenset(self.window.written)), self._hypers(),
                                step=self.step_count + 1, grad_factor=factor, squares=squares,
                                window=self.window.speculation)

    # ------------------------------------------------------------------ step
    def step(self) -> bool:
        """Apply the accumulated gradients; False if skipped for non-finite gradients (e.g. fp16 overflow)."""
        if self.destroyed:
            raise RuntimeError("optimizer.step() after engine.destroy(), which released this optimizer's states: "
                               "build a new engine with angelptm.initialize()")
        self.host.raise_if_failed()
        self.intake.refuse_stray_gradients()
        scale = self.loss_scaler.scale if self.loss_scaler else 1.0
        if self.exchange is not None:
            self.sharded.reduce_gradients()
            scale *= self.sharding.world_size  # the owners hold the sum of W ranks' gradients: step on the mean
        backward_ended = self.step_clock.mark()
        norm = self.intake.window_norm() / scale
        step_seconds = self.step_clock.norm_synced(backward_ended)  # (the step's one sync with the device)
        self.last_updates_after_backward = not self.speculating
        self.overflow = not math.isfinite(norm)  # a non-finite gradient skips the step in any precision
        if self.loss_scaler is not None:
            self.loss_scaler.update(self.overflow)
        written = frozenset(self.window.written)
        if self.overflow:
            self.last_grad_norm = None
            self.reports.counts["skipped_steps"] += 1
            self._take_back(written, restore_unreached=True)
            return False
        self.last_grad_norm = norm
        grad_factor = 1.0 / scale
        clipped = self.gradient_clipping > 0 and norm > self.gradient_clipping
        if clipped:
            grad_factor *= self.gradient_clipping / (norm + 1e-6)  # clip_grad_norm_'s rule
            self.reports.counts["clipped_steps"] += 1
        self.step_count += 1
        self.updates.release_retired()  # (before the device steps: a lazy update folds from the kept gradient first)
        hypers = self._hypers()
        self.device_adam.update(self._chunks_in((Route.DEVICE_ADAM,), written),
                                lambda chunk: self._step_members(chunk, written),
                                lambda chunk: len(self._members_of_chunk[chunk]), hypers, self.step_count, grad_factor)
        self.device_steps.begin()
        # (a window that updated in backward revised its host chunks; the others' kept gradients are idle)
        fold_later = self.fold_waited and not self.speculating and not self.store.grads_in_accumulators
        for chunk in self._chunks_in((Route.HOST_ADAM,), written):
            if self.chunk_steps[chunk].speculative is not None:
                self.updates.revise(chunk, grad_factor=grad_factor)
            elif self.updates.steps_on_device(chunk, self.device_stepped):
                self.updates.step_on_device(chunk, self._step_members(chunk, written), hypers, self.step_count,
                                            grad_factor)
            else:
                self.updates.queue_host(chunk, self._step_members(chunk, written), hypers, step=self.step_count,
                                        grad_factor=grad_factor, fold_later=fold_later)
        self.host.in_forward_order()  # backward queued its updates last chunk first
        if fold_later:
            self.host.settle_all()  # (the waited updates' moments, behind them: off the next forward's path)
        self._restore_unreached(written)
        self._mark_stale()
        self.speculating = self.update_in_backward and not clipped  # a clipped step predicts another
        self._reset_window()
        if self.observer is not None and not self._stepped_once:
            self._stepped_once = True
            self.observer.after_first_step(self)
        elif self.observer is not None and step_seconds is not None:
            self.observer.after_step(self, step_seconds)
        return True

    def _chunks_in(self, routes: tuple[Route, ...], written: frozenset) -> list[int]:
        """Chunks whose state home's update route is one of ``routes``, with at least one written slot, in model
        (= the next forward's) order."""
        return [c for c, members in sorted(self._members_of_chunk.items())
                if self.store.state_home(c).route in routes and any(slot.name in written for _, slot in members)]

    def _step_members(self, chunk: int, written: frozenset) -> dict[int, list[TensorSlot]]:
        members: dict[int, list[TensorSlot]] = {}
        for index, slot in self._members_of_chunk.get(chunk, ()):
            if slot.name in written:  # like torch's AdamW, a parameter without a gradient is not stepped
                members.setdefault(index, []).append(slot)
        return members

    def _hypers(self) -> list[dict[str, Any]]:
        """This step's hyperparameters, captured now: the scheduler may change them before the worker runs."""
        return [{"lr": float(g["lr"]), "betas": tuple(g["betas"]), "eps": g["eps"], "weight_decay": g["weight_decay"]}
                for g in self.optimizer.param_groups]

    def _restore_params(self, written: frozenset) -> None:
        """Rewrite param chunks that hold this window's gradients from their masters (no step taken; the
        speculatively updated ones are revised instead)."""
        chunks = [c for c in self._chunks_in(UPDATED_HERE, written) if self.chunk_steps[c].speculative is None]
        self.updates.restore(chunks, lambda chunk: self._step_members(chunk, written), self.step_count)
        self._mark_stale()  # the non-owned chunks come back from their owners

    def _restore_unreached(self, written: frozenset) -> None:
        """Sharded, one micro-batch: every group's reduce-scatter wrote into its owner's chunk, also where no
        gradient reached it on this rank (a parameter used without one): rewrite those from their masters."""
        if self.sharded is None or self.store.grads_in_accumulators:
            return
        reached = set(self._chunks_in(UPDATED_HERE, written))
        unreached = sorted(self.sharded.owned_chunks() - reached)
        self.updates.restore(unreached, lambda chunk: self._step_members(chunk, written), self.step_count)

    def _mark_stale(self) -> None:
        if self.exchange is not None:
            self.exchange.mark_stale()

    # ------------------------------------------------------------------ plans
    def apply_plan(self, plan: Plan, *, count_switch: bool = False, trial: bool = False) -> int:
        """Put ``plan`` in force between steps (the one door: the first plan, built with, comes in here too); returns
        the shards and groups moved. The work in flight is finished, the store moves what changed home
        (:meth:`ChunkStore.apply_plan`), the exchange takes the working set, the step the device-stepped groups.

        Args:
            plan: the plan to run under (the first, a re-plan, or a device-step count the tuner tries).
            count_switch: ``plan`` only changes the device-step count (nothing moves), so the switch waits for
                nothing (:meth:`ChunkUpdates.switch_retains <.chunk_updates.ChunkUpdates.switch_retains>`).
            trial: a count the tuner tries: the kept gradients it drops stay allocated for the next trial (the
                settled count's apply frees what is left over).
        """
        self.updates.release_retired()
        if count_switch:
            retain = self.updates.switch_retains(self.store.plan, plan)
        else:
            self.finish_pending()
            retain = frozenset()
        moved = self.store.apply_plan(plan, keep_spare_gradients=trial, retain=retain)
        if moved and not any(group.home.route is Route.HOST_ADAM for group in self.store.groups):
            self.host.trim_pools()  # (the host worker updates no group now: its pinned staging goes, as planned)
        self.chunk_steps.retire(retain, spare=trial)
        if self.exchange is not None:
            self.exchange.apply_working_set(plan)
        self.device_stepped = frozenset(plan.device_stepped)
        self.device_adam.compile_if_held()
        return moved

    # ------------------------------------------------------------------ waiting
    def finish_pending(self) -> None:
        """Block until every host update and copy has landed, and every moment is stored (before checkpoints and
        re-planning)."""
        self.updates.finish_all()
