"""The hybrid Adam over chunked model states: GPU-resident groups on the device, the rest on the host.

Gradient paths (chosen once, from the accumulation steps):

* **one micro-batch per step**: a post-accumulate-grad hook writes each gradient over its own
  parameter in the param chunk (no gradient buffers anywhere) and adds its squared norm to a
  per-chunk sum on the device;
* **accumulating micro-batches**: gradients are added into fp32 accumulators in the chunk's
  optimizer group; host accumulators receive them through pinned staging buffers and the worker.

Both paths live in :mod:`zero_cache.optim.optimizer_gradients`.

Update order (exact: every update uses this step's gradients, like a plain AdamW loop):

1. host chunks are queued on the :class:`~zero_cache.optim.host_update.HostUpdater`: with
   ``update_in_backward``, from the gradient hook as soon as a chunk's gradient is complete, so CPU
   Adam runs under the rest of backward, with the clip factor taken as 1; ``step()``, which knows the
   global norm, then revises them (:mod:`zero_cache.optim.revision`: nothing to do unless the step clips
   or is skipped). Chunks updated after backward are queued by ``step()``, in forward order;
2. the device chunks are updated by torch's fused Adam on the compute stream, each param chunk
   rewritten from its masters;
3. the next forward waits, per chunk, only for that chunk's host->device copy (a stream-event
   wait, no ``synchronize()``), so late chunks' updates overlap early layers' compute.

On a CPU-only run the "device" tier is host memory too; the worker thread and every path above
run the same way (copies are synchronous), which is what the unit tests exercise.

**Data-parallel sharding** (``store.sharding`` over W > 1 ranks; see :mod:`zero_cache.runtime.sharding`):
each rank updates only the chunks it owns. As soon as every chunk of a collective group has its
gradients on this rank (written over the params, or into a gradient bucket when micro-batches
accumulate), the training thread issues the group's reduce-scatter (async on NCCL), so it runs
under the rest of backward. ``step()`` waits for them, takes the global norm from the owned chunks
(one all-reduce of a float per chunk), updates the owned chunks with the mean gradient, and marks
every group stale; the next forward all-gathers each group in its pre-hook, ahead of use. The
worker thread never issues a collective, so every rank issues them in the same order. That side
lives in :mod:`zero_cache.optim.optimizer_sharded`.
With gathered params each owned chunk is this rank's shard: its gradients arrive by reduce-scatter from
a bucket, the update rewrites it from the masters as above, and the other ranks' chunks exist only while
gathered (:mod:`zero_cache.runtime.gathered`). A shard at home on the host (streamed params, on one rank too)
receives its gradients from the device->host stream and the host worker updates it in place: the next
gather copies the new weights in, so no host->device copy follows the update.

**Parts.** The gradient intake and the sharded side are mixins, as what they take in goes straight to the step's
update side (their docstrings say what they use); the window's bookkeeping they share with the step is an object,
:class:`~zero_cache.optim.window.AccumulationWindow`. The rest are collaborators given what they use:
the states by parameter name for checkpoints (:class:`~zero_cache.optim.optimizer_state.NamedStates`, behind the
public :class:`~zero_cache.optim.optimizer_state.OptimizerCheckpoint` methods), the step's timing
(:class:`~zero_cache.optim.step_clock.StepClock`) and the counts a report reads
(:class:`~zero_cache.optim.counters.OptimizerCounters`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
import time
from typing import Any, Callable, ContextManager, Iterable

import torch

from zero_cache.optim.chunk_adam import adam_step, fp32_gradient
from zero_cache.optim.counters import OptimizerCounters
from zero_cache.optim.device_adam import adam_in_one_pass, contiguous_runs, one_pass_available
from zero_cache.optim.device_adam import warm as warm_one_pass
from zero_cache.optim.device_steps import DeviceSteps
from zero_cache.optim.host_adam import HostAdam, torch_fused_adam
from zero_cache.optim.host_update import ChunkUpdate, HostUpdater
from zero_cache.optim.optimizer_gradients import GradientIntake
from zero_cache.optim.optimizer_sharded import ShardedGradients
from zero_cache.optim.optimizer_state import NamedStates, OptimizerCheckpoint
from zero_cache.optim.release import release
from zero_cache.optim.revision import SpeculationWindow
from zero_cache.optim.step_clock import StepClock, TimedSpans
from zero_cache.optim.step_record import ChunkSteps
from zero_cache.optim.window import AccumulationWindow
from zero_cache.plan.layout import TensorSlot
from zero_cache.plan.placement import Plan
from zero_cache.plan.state_costs import UPDATED_HERE, Route
from zero_cache.plan.tier_names import DEVICE
from zero_cache.plan.working_set import GRADIENT_BUCKETS
from zero_cache.runtime.exchange import ChunkExchange
from zero_cache.runtime.transfers import Transfers
from zero_cache.storage.chunks import STATE_FIELDS, ChunkStore


class ZeroCacheOptimizer(GradientIntake, ShardedGradients, OptimizerCheckpoint, torch.optim.Optimizer):
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
        decoupled_weight_decay: AdamW (True) or Adam with L2 (False).
        loss_scaler: fp16 loss scaler (``.scale``, ``.update(overflow)``), or None.
        gradient_clipping: max global gradient norm (0 = off).
        update_in_backward: queue host chunks from backward (see ``ZeroCacheConfig.update_in_backward``).
        native_host_adam: build and use ``csrc/fused_host_adam.cpp`` for host chunks
            (``ZeroCacheConfig.native_host_adam``).
        overlap_comm: sharded: reduce each group from backward (``ZeroCacheConfig.overlap_comm``).
        gather_ahead: sharded: groups gathered ahead of the forward (from ``ZeroCacheConfig.gather_ahead_elements``).
        max_live_groups: sharded params: groups gathered at once (from ``ZeroCacheConfig.max_live_elements``).
        gradient_buckets: gradient buckets the plan gives the device (``Plan.gradient_buckets``).
        device_stepped: host-tier chunks stepped on the device after backward (``Plan.device_stepped``).
        deepspeed_import: where ``import deepspeed`` gives the installed DeepSpeed (:class:`HostAdam`).
    """

    def __init__(self, store: ChunkStore, optimizer: torch.optim.Optimizer, names: dict[int, str], *,
                 decoupled_weight_decay: bool = True, loss_scaler: Any = None, gradient_clipping: float = 0.0,
                 update_in_backward: bool = False, native_host_adam: bool = False, overlap_comm: bool = True,
                 gather_ahead: int = 1, max_live_groups: int = 0, gradient_buckets: int = GRADIENT_BUCKETS,
                 device_stepped: tuple[int, ...] = (),
                 deepspeed_import: Callable[[], ContextManager[Any]] = contextlib.nullcontext) -> None:
        self.store = store
        self.optimizer = optimizer
        self.loss_scaler = loss_scaler
        self.gradient_clipping = gradient_clipping
        self.update_in_backward = update_in_backward
        self.device = store.tiers[DEVICE].device
        self.sharding = store.sharding
        self.overlap_comm = overlap_comm
        self.transfers = Transfers(self.device)
        self.exchange = (ChunkExchange(store, self.wait_for_chunk, accumulate=store.grads_in_accumulators,
                                       gather_ahead=gather_ahead, max_live_groups=max_live_groups,
                                       buckets=gradient_buckets, overlap_comm=overlap_comm, transfers=self.transfers)
                         if self.sharding.sharded or store.shard_params else None)
        self._device_adam = functools.partial(torch_fused_adam, decoupled=decoupled_weight_decay)
        self._decoupled = decoupled_weight_decay
        self._one_pass = one_pass_available(self.device)  # (device chunks: Adam in one pass over device memory)
        self._one_pass_compiled = False  # (compiled by apply_plan once a plan holds groups on the device)
        self.host_adam = HostAdam(decoupled_weight_decay, try_deepspeed=self.device.type == "cuda",
                                  try_native=native_host_adam, deepspeed_import=deepspeed_import)
        self.chunk_steps = ChunkSteps(store.layout.num_chunks)
        """Where each chunk's update stands (:mod:`zero_cache.optim.step_record`), shared with the host worker."""
        self.host = HostUpdater(store, self.transfers, self.host_adam, self.chunk_steps)
        self.device_steps = DeviceSteps(store, self.transfers, self._device_adam)
        self.device_stepped = frozenset(device_stepped)
        """Host-tier chunks updated by :attr:`device_steps` after backward instead of by the host worker
        (the plan's)."""
        self.timeline = self.transfers.timeline
        """The step's timeline (copies, host jobs, disk requests, waits); recording only while a step is traced."""
        for home in store.all_homes():
            home.use_timeline(self.timeline)
        slot_of = {slot.name: slot for slot in store.slots}
        # (param-group index, slot) for every parameter, in the optimizer's group order.
        self.members: list[tuple[int, TensorSlot]] = []
        for index, group in enumerate(optimizer.param_groups):
            for param in group["params"]:
                if param.requires_grad:
                    self.members.append((index, slot_of[names[id(param)]]))
        self.names = [slot.name for _, slot in self.members]
        self._members_of_chunk: dict[int, list[tuple[int, TensorSlot]]] = {}
        for index, slot in self.members:
            self._members_of_chunk.setdefault(slot.chunk, []).append((index, slot))
        self.step_count = 0
        self.overflow = False
        self.last_grad_norm: float | None = None
        self.window = AccumulationWindow(self._members_of_chunk, num_chunks=store.layout.num_chunks,
                                         group_of=self.sharding.group_of,
                                         num_groups=self.sharding.num_groups(store.layout.num_chunks),
                                         device=self.device)
        """This accumulation window's bookkeeping, shared by the gradient intake, the sharded side and the step."""
        self._speculating = update_in_backward  # whether this window updates during backward (the prediction)
        self._boundary = True
        self._replanned = False
        self.counters = OptimizerCounters(store, self.transfers, self.host, self.device)
        """The counts and waits since the last :meth:`report` (:attr:`counts`, :attr:`timings`), and the report."""
        self.after_first_step: Any = None
        """Called once after the first applied step (the warm-up re-plan)."""
        self.after_step: Any = None
        """Called after each later applied step with its measured seconds (the device-step count's tuning)."""
        self.nonmodel_peak_bytes: int | None = None
        """Device bytes the warm-up's re-plan measured beside the model states (activations, library workspaces,
        fragmentation): what its plan leaves room for."""
        self.step_clock = StepClock(self.device)
        """Times each step and its backward (its ``clock``, faked by tests; :attr:`last_backward_seconds`)."""
        self.device_adam_timing = TimedSpans()
        """The device's Adam over the groups it holds, timed on the compute stream each step (the step's prediction
        prices it by this: :func:`zero_cache.runtime.rates.with_timed_work`)."""
        self.named_states = NamedStates(store, self.members, self._members_of_chunk, optimizer=optimizer,
                                        loss_scaler=loss_scaler, settle=self.finish_pending,
                                        restore_params=self._restore_params)
        """The states by parameter name: the checkpoint surface's (:class:`OptimizerCheckpoint`)."""
        self.last_updates_after_backward = False
        """Whether the last step's host updates waited for its backward to end (no speculation in backward)."""
        self.fold_waited = True
        """Host updates that wait for the global norm store the weight and keep the gradient, their moments folded in
        by a job behind them, off the path to the next forward (:mod:`zero_cache.optim.revision`, "Waited steps");
        False: they store everything in their pass (the tests' reference)."""
        self._params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        self._engine_backward = False  # gradients are taken only inside the engine's backward (accumulating())
        self.hooks: list[Any] = [param.register_post_accumulate_grad_hook(self._make_grad_hook(slot))
                                 for param, (_, slot) in zip(self._params, self.members)]
        """Handles of the hooks on the parameters and (added by :func:`~zero_cache.attach.attach`) the modules, which
        :meth:`destroy` removes."""
        self.destroyed = False
        """Whether :meth:`destroy` released everything (then it cannot step)."""
        self._reset_window()

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

    # ------------------------------------------------------------------ what reports may read (not the store)
    @property
    def last_backward_seconds(self) -> float | None:
        """The last step's backward as it ran (:attr:`StepClock.last_backward_seconds
        <zero_cache.optim.step_clock.StepClock.last_backward_seconds>`)."""
        return self.step_clock.last_backward_seconds

    @property
    def plan(self) -> Plan:
        """The placement plan in force (its summary, and what it predicted a step costs)."""
        return self.store.plan

    @property
    def counts(self) -> dict[str, int]:
        """Since the last report: chunks updated during backward, of them revised at the step, host chunks stepped on
        the device, steps clipped / skipped (:data:`~zero_cache.optim.counters.COUNTS`)."""
        return self.counters.counts

    @property
    def timings(self) -> dict[str, float]:
        """Seconds the training thread waited for host gradient accumulation / for host chunk updates."""
        return self.counters.timings

    def tier_usage(self) -> dict[str, tuple[int, int]]:
        """Tier name -> (bytes in use, budget bytes), now."""
        return {name: (tier.used_bytes, tier.budget_bytes) for name, tier in self.store.tiers.items()}

    def tier_counts(self) -> dict[str, int]:
        """Tier name -> optimizer groups there now (after any re-plan; REMOTE: another rank's)."""
        return dict(collections.Counter(group.tier for group in self.store.groups))

    def param_home_counts(self) -> dict[str, int]:
        """Tier name -> this rank's param shards at home there now (gathered params; empty when resident)."""
        return dict(collections.Counter(self.store.param_home))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start a new accumulation window: drop the gradients of this one (and take back its updates made
        during backward)."""
        if self.exchange is not None:  # reductions in flight write into the chunks about to be restored
            self._finish_micro_step() if self.store.grads_in_accumulators else self.exchange.completed()
        self._drain_host_gradients()
        self._take_back(frozenset(self.window.written), restore_unreached=False)

    def _take_back(self, written: frozenset, *, restore_unreached: bool) -> None:
        """End the window without a step: revise the speculative updates away, restore overwritten params."""
        for chunk in self.chunk_steps.speculated():
            self._queue_revision(chunk, skip=True)
        if written and not self.store.grads_in_accumulators:
            self._restore_params(written)  # the dropped gradients overwrote parameters
            if restore_unreached:
                self._restore_unreached(written)
        self._reset_window()

    def _queue_revision(self, chunk: int, *, grad_factor: float = 0.0, skip: bool = False) -> None:
        self.named_states.before_update(chunk)  # (a checkpoint being written stages the chunk first)
        original = self.chunk_steps[chunk].speculative
        revision = ChunkUpdate(chunk=chunk, members=original.members, hypers=original.hypers, step=original.step,
                               grad_factor=grad_factor, revises=original, skip=skip)
        self.chunk_steps.revise(revision)
        self.host.submit_update(revision)
        if skip or grad_factor != original.grad_factor:
            self.counts["revised_chunks"] += 1

    def _drain_host_gradients(self) -> None:
        """Wait for the worker's gradient jobs (accumulation), not for the updates queued behind them."""
        start = time.perf_counter()
        with self.timeline.waiting("host gradients drained"):
            self.host.drain(gradients_only=True)
        self.timings["grad_wait"] += time.perf_counter() - start

    # ------------------------------------------------------------------ step
    def step(self) -> bool:
        """Apply the accumulated gradients; False if skipped for non-finite gradients (e.g. fp16 overflow)."""
        if self.destroyed:
            raise RuntimeError("optimizer.step() after engine.destroy(), which released this optimizer's states: "
                               "build a new engine with angelptm.initialize()")
        self.host.raise_if_failed()
        self._refuse_stray_gradients()
        scale = self.loss_scaler.scale if self.loss_scaler else 1.0
        if self.exchange is not None:
            self._reduce_gradients()
            scale *= self.sharding.world_size  # the owners hold the sum of W ranks' gradients: step on the mean
        backward_ended = self.step_clock.mark()
        norm = self._grad_norm() / scale
        step_seconds = self.step_clock.norm_synced(backward_ended)  # (the step's one sync with the device)
        self.last_updates_after_backward = not self._speculating
        self.overflow = not math.isfinite(norm)  # a non-finite gradient skips the step in any precision
        if self.loss_scaler is not None:
            self.loss_scaler.update(self.overflow)
        written = frozenset(self.window.written)
        if self.overflow:
            self.last_grad_norm = None
            self.counts["skipped_steps"] += 1
            self._take_back(written, restore_unreached=True)
            return False
        self.last_grad_norm = norm
        grad_factor = 1.0 / scale
        clipped = self.gradient_clipping > 0 and norm > self.gradient_clipping
        if clipped:
            grad_factor *= self.gradient_clipping / (norm + 1e-6)  # clip_grad_norm_'s rule
            self.counts["clipped_steps"] += 1
        self.step_count += 1
        self._release_retired()  # (before the device steps: a lazy update folds from the kept gradient first)
        hypers = self._hypers()
        self._update_device_chunks(written, hypers, grad_factor)
        self.device_steps.begin()
        # (a window that updated in backward revised its host chunks; the others' kept gradients are idle)
        fold_later = self.fold_waited and not self._speculating and not self.store.grads_in_accumulators
        for chunk in self._chunks_in((Route.HOST_ADAM,), written):
            if self.chunk_steps[chunk].speculative is not None:
                self._queue_revision(chunk, grad_factor=grad_factor)
            elif self._steps_on_device(chunk):
                self._step_on_device(chunk, written, hypers, grad_factor)
            else:
                self._queue_host_update(chunk, written, hypers, step=self.step_count, grad_factor=grad_factor,
                                        fold_later=fold_later)
        self.host.in_forward_order()  # backward queued its updates last chunk first
        if fold_later:
            self.host.settle_all()  # (the waited updates' moments, behind them: off the next forward's path)
        self._restore_unreached(written)
        self._mark_stale()
        self._speculating = self.update_in_backward and not clipped  # a clipped step predicts another
        self._reset_window()
        if not self._replanned and self.after_first_step is not None:
            self._replanned = True
            self.after_first_step()
        elif self.after_step is not None and step_seconds is not None:
            self.after_step(step_seconds)
        return True

    def _steps_on_device(self, chunk: int) -> bool:
        """Whether ``chunk`` is stepped on the device now: the plan's choice, for a group whose home lets the device
        step it (its states all in host memory, none left to fold in from a lazy update of the host's)."""
        return (chunk in self.device_stepped and self.store.state_home(chunk).device_steppable
                and self.chunk_steps.owed_fold(chunk) is None)

    def _step_on_device(self, chunk: int, written: frozenset, hypers: list[dict[str, Any]], grad_factor: float) -> None:
        """Queue ``chunk``'s update on :attr:`device_steps`; the next forward waits for its params alone."""
        self.named_states.before_update(chunk)
        self.wait_for_chunk(chunk)  # a host job still on it (a restore) has run
        # None unless written home by a copy: on the device it is ordered by begin(), an accumulator is filled
        self.chunk_steps.on_device(chunk, self.device_steps.step(chunk, self._step_members(chunk, written), hypers,
                                                                 self.step_count, grad_factor, self._landed(chunk)))
        self.counts["device_stepped_chunks"] += 1

    def _grad_norm(self) -> float:
        """Global norm over the gradients written in this window (the one device sync of the step)."""
        if self.store.grads_in_accumulators and self.store.shard_params and not self.sharding.sharded:
            # One rank, streamed params: per parameter in double, in the order the resident path sums them.
            return math.sqrt(sum(float(torch.linalg.vector_norm(self.store.state_view(slot, "grad"),
                                                                dtype=torch.float32)) ** 2
                                 for slot in self.window.completed_order))
        if not self.store.grads_in_accumulators or self.exchange is not None:
            return math.sqrt(float(self.window.chunk_squares.sum()))  # sharded: summed over the owners
        self._drain_host_gradients()
        total = sum(self.window.host_squares)
        on_device = [torch.linalg.vector_norm(self.store.state_view(slot, "grad"), dtype=torch.float32).square()
                     for _, slot in self.members if slot.name in self.window.written
                     and self.store.state_home(slot.chunk).route is Route.DEVICE_ADAM]
        if on_device:
            total += float(torch.stack(on_device).double().sum())
        return math.sqrt(total)

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

    def _queue_host_update(self, chunk: int, written: frozenset, hypers: list[dict[str, Any]], *, step: int,
                           grad_factor: float, squares: torch.Tensor | None = None, restore_only: bool = False,
                           window: SpeculationWindow | None = None, fold_later: bool = False) -> ChunkUpdate:
        self.named_states.before_update(chunk)  # a checkpoint being written stages the chunk before it changes
        self.device_steps.wait(chunk)  # the host takes the chunk back: its device step's copies have landed
        update = ChunkUpdate(chunk=chunk, members=self._step_members(chunk, written), hypers=hypers, step=step,
                             grad_factor=grad_factor, grads_written=self.transfers.mark(),
                             grads_landed=self._landed(chunk),
                             squares=squares, restore_only=restore_only, window=window, fold_later=fold_later)
        if window is not None:
            update.position = window.join(update)
            self.chunk_steps.speculate(update)
        elif restore_only:
            self.chunk_steps.restore(update)
        else:
            self.chunk_steps.queue(update)
        self.host.submit_update(update)
        return update

    def _landed(self, chunk: int) -> torch.cuda.Event | None:
        """The device->host copy that wrote ``chunk``'s reduced gradients into its shard's home on the host, if any."""
        return self.exchange.landed.get(self.sharding.group_of(chunk)) if self.exchange is not None else None

    def _update_device_chunks(self, written: frozenset, hypers: list[dict[str, Any]], grad_factor: float) -> None:
        """Adam over each written device chunk and its param chunk rewritten from the masters: in one pass where
        Triton runs (:mod:`zero_cache.optim.device_adam`), else through the fp32 scratch and torch's fused Adam."""
        if not self._one_pass:  # (the four passes use the scratch, which the last step's device steps used)
            self.device_steps.fence()
        self.device_adam_timing.close_step()
        chunks = list(self._chunks_in((Route.DEVICE_ADAM,), written))
        if chunks:
            self.device_adam_timing.start(self.step_clock.mark())
        for chunk in chunks:
            self.named_states.before_update(chunk)
            group = self.store.groups[chunk]
            params = self.store.param_chunks[chunk]
            source = group.grad if self.store.grads_in_accumulators else params
            members = self._step_members(chunk, written)
            if self._one_pass:
                states = [group.field(name) for name in STATE_FIELDS]
                for index, slots in members.items():
                    for low, high in contiguous_runs(slots):
                        adam_in_one_pass([state[low:high] for state in states], source[low:high], params[low:high],
                                         grad_factor=grad_factor, step=self.step_count, decoupled=self._decoupled,
                                         **hypers[index])
                if sum(map(len, members.values())) == len(self._members_of_chunk[chunk]):
                    continue  # (else the params of those without a gradient come from their masters below)
            else:
                grads = fp32_gradient(source, self.store.scratch[DEVICE], grad_factor)
                for index, slots in members.items():
                    adam_step(self.store, slots, grads, hypers[index], self.step_count, self._device_adam)
            params.copy_(group.field("master"))
        if chunks:
            self.device_adam_timing.extend(self.step_clock.mark(), len(chunks) * self.store.layout.chunk_numel)

    def _restore_params(self, written: frozenset) -> None:
        """Rewrite param chunks that hold this window's gradients from their masters (no step taken; the
        speculatively updated ones are revised instead)."""
        chunks = [c for c in self._chunks_in(UPDATED_HERE, written) if self.chunk_steps[c].speculative is None]
        self._rewrite_from_masters(chunks, written)
        self._mark_stale()  # the non-owned chunks come back from their owners

    def _rewrite_from_masters(self, chunks: list[int], written: frozenset) -> None:
        """Param chunks rewritten from their masters: device chunks now, the others through the host worker."""
        for chunk in chunks:
            if self.store.state_home(chunk).route is Route.DEVICE_ADAM:
                self.store.param_chunks[chunk].copy_(self.store.groups[chunk].field("master"))
            else:
                self._queue_host_update(chunk, written, [], step=self.step_count, grad_factor=1.0, restore_only=True)

    # ------------------------------------------------------------------ waiting
    def wait_for_chunk(self, chunk: int) -> None:
        """Order the compute stream after ``chunk``'s latest host update (forward pre-hook, gradient hook)."""
        stepped, update = self.chunk_steps.take_waits(chunk)
        if stepped is not None:
            torch.cuda.current_stream(self.device).wait_event(stepped)
        if update is None:
            return
        if not update.issued.is_set():
            start = time.perf_counter()
            with self.timeline.waiting(f"chunk {chunk}"):
                while not update.issued.wait(0.005):  # only this chunk's update, not the whole host tier
                    self.host.raise_if_failed()
            self.timings["chunk_wait"] += time.perf_counter() - start
        self.host.raise_if_failed()
        ready = self.chunk_steps.take_params_sent(chunk)
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)

    def apply_plan(self, plan: Plan, *, count_switch: bool = False, trial: bool = False) -> int:
        """Put ``plan`` in force between steps; returns the shards and groups moved. In this order: the work in flight
        is finished, the store moves the shards and optimizer groups whose home changed
        (:meth:`ChunkStore.apply_plan <zero_cache.storage.chunks.ChunkStore.apply_plan>`), the exchange takes the
        plan's working set (gradient buckets, prefetch depth, live groups), and the step its device-stepped groups.

        Args:
            plan: the plan to run under (a re-plan, the warm-up's, or a device-step count the tuner tries).
            count_switch: ``plan`` only changes the device-step count (nothing moves), so the switch waits for
                nothing (:meth:`_switch_retains`).
            trial: a count the tuner tries: the kept gradients it drops stay allocated for the next trial (the
                settled count's apply frees what is left over).
        """
        self._release_retired()
        if count_switch:
            retain = self._switch_retains(plan)
        else:
            self.finish_pending()
            retain = frozenset()
        moved = self.store.apply_plan(plan, keep_spare_gradients=trial, retain=retain)
        self.chunk_steps.retire(retain, spare=trial)
        if self.exchange is not None:
            self.exchange.apply_working_set(plan)
        self.device_stepped = frozenset(plan.device_stepped)
        self._compile_one_pass()
        return moved

    def _compile_one_pass(self) -> None:
        """Compile the device's one-pass Adam now, once a plan holds groups on the device: compiled on first use, it
        fell in the step after (the tuning's first measured step at 2.7B capped on an H100: 1.78 s against 0.63)."""
        if self._one_pass and not self._one_pass_compiled and any(
                self.store.state_home(chunk).route is Route.DEVICE_ADAM
                for chunk in range(self.store.layout.num_chunks)):
            warm_one_pass(self.device, torch.float32 if self.store.grads_in_accumulators else self.store.compute_dtype,
                          self.store.compute_dtype, self._decoupled)
            self._one_pass_compiled = True

    def _switch_retains(self, plan: Plan) -> frozenset[int]:
        """The chunks that keep their kept gradient for now although a count switch to ``plan`` drops it.

        A switch changes routes only, and blocking on the chunks it changes would drain their share of the host's
        queue and device steps into the switching step (1.1-1.2 s at 10B and 13B, the tuning's slowest steps). It
        need not: a chunk leaving the device steps is waited for where the host next touches it, its next gradient
        or update, as every step's are; one joining them is updated on the device only after its host update
        (:meth:`_step_on_device`). Only a kept gradient the plan drops may still be read by the chunk's queued host
        update or lazy fold, so it stays with its chunk until the next step lets go of it (:meth:`_release_retired`,
        by when the forward has waited for that update). That holds for chunks joining the device steps, which
        the step never updates in backward; any other chunk dropping its kept gradient (a plan the tuner does not
        make), or chunks gaining one that would need new memory beside the retained, are finished now instead.
        """
        now = self.store.plan
        dropping = frozenset(now.kept_gradients) - frozenset(plan.kept_gradients)
        gaining = len(frozenset(plan.kept_gradients) - frozenset(now.kept_gradients))
        if dropping - frozenset(plan.device_stepped) or dropping and gaining > self.store.spare_kept:
            self.finish_chunks(sorted(dropping))
            return frozenset()
        return dropping

    def _release_retired(self) -> None:
        """Let go of the kept gradients the last count switch retained, once their chunks' host work is done."""
        retired, spare = self.chunk_steps.take_retired()
        if retired:
            self.finish_chunks(retired)
            self.store.release_kept(frozenset(retired), spare=spare)

    def finish_chunks(self, chunks: Iterable[int]) -> None:
        """Block until the host work and device-step copies of ``chunks`` have landed, and their lazy updates are
        folded: before their kept gradients go, where :meth:`finish_pending` would drain the whole host tier."""
        for chunk in chunks:
            self.device_steps.wait(chunk)
            self.wait_for_chunk(chunk)
            # No job of the chunk is left on the worker: its lazy update, if one waits, folds here from the kept
            # gradient the switch may take away.
            self.host.settle(chunk)

    def finish_pending(self) -> None:
        """Block until every host update and copy has landed, and every moment is stored (before checkpoints and
        re-planning)."""
        self.device_steps.synchronize()
        self.host.settle_all()
        self.host.drain()
        self.store.flush()
        for chunk in self.chunk_steps.in_flight():
            self.wait_for_chunk(chunk)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def report(self) -> dict[str, float]:
        """Per-tier bytes and the traffic and waiting since the previous report (then resets those): see
        :meth:`OptimizerCounters.report <zero_cache.optim.counters.OptimizerCounters.report>`."""
        return self.counters.report()
