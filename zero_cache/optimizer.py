"""The hybrid Adam over chunked model states: GPU-resident groups on the device, the rest on the host.

Step order (exact: every update uses this step's gradients, like a plain AdamW loop):

1. backward: a post-accumulate-grad hook moves each gradient out of autograd into its chunk's
   gradient buffer right away. Device groups: an in-place copy (first micro-batch of a window) or
   add. Host groups: an async copy on the device->host stream, straight into the pinned gradient
   chunk when each window is one micro-batch (bf16 gradients; their norms are taken on the GPU),
   or into a staging chunk that the host worker adds into an fp32 accumulator otherwise;
2. ``step()``: one global norm over both tiers (for clipping and the overflow check); the host
   worker runs CPU Adam chunk by chunk in forward order and starts each updated chunk's
   host->device copy on its own stream, while the main thread runs the fused GPU Adam over the
   device groups (low-precision gradients are read through one fp32 scratch chunk per tier);
3. the next forward waits, per chunk, only for that chunk's copy (a stream-event wait, no
   ``synchronize()``), so late chunks' copies overlap early layers' compute.

The host worker exists only with CUDA; on a CPU-only run every tier is host memory and the same
code runs inline, which is what the tests exercise.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from zero_cache.chunks import ChunkStore
from zero_cache.host_adam import HostAdam, fused_adam_kernel
from zero_cache.layout import TensorSlot
from zero_cache.planner import DEVICE, HOST

logger = logging.getLogger(__name__)


class ZeroCacheOptimizer:
    """Engine-facing optimizer over a :class:`ChunkStore` (same surface as the replicated one).

    Args:
        store: chunk storage, already bound to the module's parameters.
        optimizer: the torch optimizer built over the parameters; only its param groups (and their
            hyperparameters, which schedulers write) are used, never its step.
        names: id(parameter) -> qualified name.
        decoupled_weight_decay: AdamW (True) or Adam with L2 (False).
        loss_scaler: fp16 loss scaler (``.scale``, ``.update(overflow)``), or None.
        gradient_clipping: max global gradient norm (0 = off).
    """

    def __init__(self, store: ChunkStore, optimizer: torch.optim.Optimizer, names: dict[int, str], *,
                 decoupled_weight_decay: bool = True, loss_scaler: Any = None, gradient_clipping: float = 0.0) -> None:
        self.store = store
        self.optimizer = optimizer
        self.loss_scaler = loss_scaler
        self.gradient_clipping = gradient_clipping
        self.kernel = fused_adam_kernel(decoupled_weight_decay)
        self.device = store.tiers[DEVICE].device
        self.host_adam = HostAdam(decoupled_weight_decay, try_deepspeed=self.device.type == "cuda")
        slot_of = {slot.name: slot for slot in store.slots}
        # (group index, slot) for every parameter, in the optimizer's group order.
        self.members: list[tuple[int, TensorSlot]] = []
        for index, group in enumerate(optimizer.param_groups):
            for param in group["params"]:
                if param.requires_grad:
                    self.members.append((index, slot_of[names[id(param)]]))
        self.names = [slot.name for _, slot in self.members]
        self.step_count = 0
        self.overflow = False
        self.last_grad_norm: float | None = None
        self._cuda = self.device.type == "cuda"
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero-cache-host") if self._cuda else None
        self._d2h = torch.cuda.Stream(self.device) if self._cuda else None
        self._h2d = torch.cuda.Stream(self.device) if self._cuda else None
        self._pending_grads: list[Future] = []
        self._param_ready: dict[int, torch.cuda.Event] = {}
        self._host_done: Future | None = None
        self._staging: dict[int, torch.Tensor] = {}
        self._written: set[str] = set()  # slots that received a gradient in this accumulation window
        self._host_squares: list[float] = []  # squared norms of host slots, taken by the worker
        self._device_squares: list[torch.Tensor] = []  # squared norms of host slots' grads, taken on the GPU
        self._host_ready: dict[int, threading.Event] = {}  # host chunks whose update is still being issued
        self._covered: set[str] = set()  # host slots whose squared norm is already recorded this window
        self._slot_jobs: dict[str, Future] = {}  # last accumulation job per host slot (its staging slice)
        self._staging_lock = threading.Lock()
        self._replanned = False
        self._boundary = True
        self.timings = dict.fromkeys(("grad_wait", "host_update", "chunk_wait"), 0.0)
        self.moved_bytes = {"d2h": 0, "h2d": 0}
        """Bytes copied device->host (gradients) and host->device (updated params) since the last report."""
        """Seconds the training thread waited for host gradients / for host updates, and worker time."""
        self.after_first_step: Any = None
        """Called once after the first applied step (the warm-up re-plan)."""
        for param, (_, slot) in zip(self._params_in_member_order(), self.members):
            param.register_post_accumulate_grad_hook(self._make_grad_hook(slot))

    def _params_in_member_order(self) -> list[nn.Parameter]:
        return [p for group in self.optimizer.param_groups for p in group["params"] if p.requires_grad]

    # ------------------------------------------------------------------ torch.optim surface
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> dict:
        return {"step": self.step_count}

    # ------------------------------------------------------------------ gradients
    def prepare_backward(self, boundary: bool) -> None:
        """Told by the engine before each backward whether it completes an accumulation window."""
        self._boundary = boundary

    def _make_grad_hook(self, slot: TensorSlot):
        def hook(param: nn.Parameter) -> None:
            grad = param.grad
            param.grad = None
            first = slot.name not in self._written  # the first gradient of a window is copied, not added
            self._written.add(slot.name)
            if self.store.tier_of(slot) == DEVICE or not self._cuda:
                accumulator = self.store.state_view(slot, "grad")
                accumulator.copy_(grad.reshape(-1)) if first else accumulator.add_(grad.reshape(-1))
                return
            # The host chunk may still be the staging source of this chunk's last param update.
            self.wait_for_chunk(slot.chunk)
            direct = first and self.store.grad_dtype == grad.dtype and self.store.grad_dtype != torch.float32
            if direct:  # single-micro-batch windows: straight into the pinned host gradient chunk
                if self._boundary:
                    self._device_squares.append(torch.linalg.vector_norm(grad, dtype=torch.float32) ** 2)
                    self._covered.add(slot.name)
                self._copy_async(self.store.state_view(slot, "grad"), grad)
                return
            self._pending_grads.append(self._copy_grad_to_host(slot, grad, first))

        return hook

    def _copy_async(self, destination: torch.Tensor, grad: torch.Tensor) -> torch.cuda.Event:
        """Device-to-host copy on the D2H stream, ordered after the gradient's producer."""
        self._d2h.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._d2h):
            destination.copy_(grad.reshape(-1), non_blocking=True)
            self.moved_bytes["d2h"] += grad.numel() * grad.element_size()
            grad.record_stream(self._d2h)  # keep the gradient alive until the copy is done
            copied = torch.cuda.Event()
            copied.record()
        return copied

    def _copy_grad_to_host(self, slot: TensorSlot, grad: torch.Tensor, first: bool) -> Future:
        """Async D2H into the chunk's pinned staging buffer, then an fp32 copy/add on the worker.

        At the window's last micro-step the worker also takes the slot's squared norm, so the
        global norm at ``step()`` is a sum of partials computed while backward was still running.
        """
        previous = self._slot_jobs.pop(slot.name, None)
        if previous is not None:
            previous.result()  # the worker has read this staging slice; it may be written again
        staging = self._staging_chunk(slot.chunk)[slot.offset:slot.offset + slot.numel]
        copied = self._copy_async(staging, grad)
        accumulator = self.store.state_view(slot, "grad")
        boundary = self._boundary
        if boundary:
            self._covered.add(slot.name)

        def accumulate() -> None:
            copied.synchronize()
            accumulator.copy_(staging) if first else accumulator.add_(staging)
            if boundary:
                self._host_squares.append(float(torch.linalg.vector_norm(accumulator, dtype=torch.float32)) ** 2)

        job = self._worker.submit(accumulate)
        self._slot_jobs[slot.name] = job
        return job

    def _staging_chunk(self, chunk: int) -> torch.Tensor:
        with self._staging_lock:  # the hook (training thread) and the update (worker) both ask
            if chunk not in self._staging:
                numel = self.store.layout.chunk_numel
                self._staging[chunk] = self.store.tiers[HOST].allocate(numel, self.store.param_chunks[chunk].dtype)
            return self._staging[chunk]

    def _drain_gradient_jobs(self) -> None:
        start = time.perf_counter()
        for future in self._pending_grads:
            future.result()
        self._pending_grads.clear()
        self._slot_jobs.clear()
        self.timings["grad_wait"] += time.perf_counter() - start

    def _reset_window(self) -> None:
        self._written.clear()
        self._covered.clear()
        self._host_squares.clear()
        self._device_squares.clear()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start a new accumulation window: the next gradient of each parameter overwrites its buffer."""
        self._drain_gradient_jobs()
        self._reset_window()

    # ------------------------------------------------------------------ step
    def _grad_norm(self) -> float:
        """Global norm over the gradients written in this window (parameters without one take no step)."""
        self._drain_gradient_jobs()
        total = sum(self._host_squares)
        on_device = list(self._device_squares)
        for _, slot in self.members:
            if slot.name not in self._written or slot.name in self._covered:
                continue
            square = torch.linalg.vector_norm(self.store.state_view(slot, "grad"), dtype=torch.float32) ** 2
            if square.device.type == "cpu":
                total += float(square)
            else:
                on_device.append(square)
        if on_device:
            total += float(torch.stack(on_device).double().sum())  # the one device sync of the step
        return math.sqrt(total)

    def step(self) -> bool:
        """Apply the accumulated gradients; False if skipped for non-finite gradients (e.g. fp16 overflow)."""
        self._finish_previous_update()
        scale = self.loss_scaler.scale if self.loss_scaler else 1.0
        norm = self._grad_norm() / scale
        self.overflow = not math.isfinite(norm)  # a non-finite gradient skips the step in any precision
        if self.loss_scaler is not None:
            self.loss_scaler.update(self.overflow)
        if self.overflow:
            self.last_grad_norm = None
            self._reset_window()
            return False
        self.last_grad_norm = norm
        grad_factor = 1.0 / scale
        if self.gradient_clipping > 0 and norm > self.gradient_clipping:
            grad_factor *= self.gradient_clipping / (norm + 1e-6)  # clip_grad_norm_'s rule
        self.step_count += 1
        written = frozenset(self._written)
        if self._cuda:
            host_ready = {c: threading.Event() for c, g in enumerate(self.store.groups) if g.tier == HOST}
            self._host_ready = host_ready
            grads_landed = torch.cuda.Event()
            grads_landed.record(self._d2h)  # after every gradient copy issued during backward
            self._host_done = self._worker.submit(self._timed_host_update, grad_factor, written, host_ready,
                                                  grads_landed)
        else:
            self._timed_host_update(grad_factor, written, {})
        self._update_tier(DEVICE, grad_factor, written, {})
        self._reset_window()
        if not self._replanned and self.after_first_step is not None:
            self._replanned = True
            self.after_first_step()
        return True

    def _finish_previous_update(self) -> None:
        """Surface a failed host update and order this step after any copy no forward waited for."""
        if self._host_done is not None:
            self._host_done.result()
            self._host_done = None
        for chunk in list(self._host_ready) + list(self._param_ready):
            self.wait_for_chunk(chunk)

    def _timed_host_update(self, grad_factor: float, written: frozenset, host_ready: dict[int, threading.Event],
                           grads_landed: torch.cuda.Event | None = None) -> None:
        start = time.perf_counter()
        if grads_landed is not None:
            grads_landed.synchronize()
        self._update_tier(HOST, grad_factor, written, host_ready)
        self.timings["host_update"] += time.perf_counter() - start

    def _update_tier(self, tier: str, grad_factor: float, written: frozenset,
                     host_ready: dict[int, threading.Event]) -> None:
        """Adam over every chunk whose optimizer group lives in ``tier``, in chunk (= model) order.

        Like torch's AdamW, a parameter that received no gradient in this window is not stepped.
        Each chunk's params are refreshed as soon as its update is done; for host chunks that
        starts the host->device copy, which overlaps the remaining CPU work and the next forward.
        """
        slots_of: dict[int, dict[int, list[TensorSlot]]] = {}
        for index, slot in self.members:
            if self.store.tier_of(slot) == tier and slot.name in written:
                slots_of.setdefault(slot.chunk, {}).setdefault(index, []).append(slot)
        for chunk in sorted(slots_of):
            grads = self._fp32_grads(chunk, tier, grad_factor)
            for index, slots in slots_of[chunk].items():
                self._adam(tier, slots, grads, self.optimizer.param_groups[index])
            self._refresh_param_chunk(chunk, host_ready)
        for chunk, issued in host_ready.items():  # host chunks with nothing to update: nothing to wait for
            if chunk not in slots_of:
                issued.set()

    def _fp32_grads(self, chunk: int, tier: str, grad_factor: float) -> torch.Tensor:
        """The chunk's gradient in fp32, unscaled and clipped: in place if fp32, else via the tier's scratch."""
        grad = self.store.groups[chunk].grad
        if grad.dtype != torch.float32:
            grad = self.store.scratch[tier].copy_(grad)
        if grad_factor != 1.0:
            grad.mul_(grad_factor)
        return grad

    def _adam(self, tier: str, slots: list[TensorSlot], grads: torch.Tensor, hyper: dict[str, Any]) -> None:
        views = {f: [self.store.state_view(s, f) for s in slots] for f in ("master", "exp_avg", "exp_avg_sq")}
        grad_views = [grads[s.offset:s.offset + s.numel] for s in slots]
        args = (views["master"], grad_views, views["exp_avg"], views["exp_avg_sq"])
        hypers = dict(lr=float(hyper["lr"]), eps=hyper["eps"], weight_decay=hyper["weight_decay"])
        if tier == HOST:
            self.host_adam.update(*args, step=self.step_count, betas=tuple(hyper["betas"]), **hypers)
            return
        step = torch.tensor(float(self.step_count), device=self.device)
        beta1, beta2 = hyper["betas"]
        self.kernel(*args, [], [step] * len(slots), beta1=beta1, beta2=beta2, amsgrad=False, maximize=False, **hypers)

    def _refresh_param_chunk(self, chunk: int, host_ready: dict[int, threading.Event] | None = None) -> None:
        """Write the chunk's updated masters into its compute-dtype param chunk."""
        master = self.store.groups[chunk].field("master")
        param_chunk = self.store.param_chunks[chunk]
        if master.device == param_chunk.device:
            param_chunk.copy_(master)
            return
        grad = self.store.groups[chunk].grad
        # The consumed low-precision gradient chunk doubles as the staging buffer: the next backward
        # writes it again only after the next forward has waited for this copy.
        staging = grad if grad.dtype == param_chunk.dtype else self._staging_chunk(chunk)
        staging.copy_(master)  # fp32 -> compute dtype on the host, so the bus carries half the bytes
        with torch.cuda.stream(self._h2d):
            param_chunk.copy_(staging, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        self._param_ready[chunk] = ready
        self.moved_bytes["h2d"] += param_chunk.numel() * param_chunk.element_size()
        issued = (host_ready or {}).get(chunk)
        if issued is not None:
            issued.set()  # the training thread may now order its stream after this copy

    def wait_for_chunk(self, chunk: int) -> None:
        """Make the compute stream wait until ``chunk``'s params are updated (forward pre-hook)."""
        issued = self._host_ready.pop(chunk, None)
        if issued is not None and not issued.is_set():
            start = time.perf_counter()
            while not issued.wait(0.005):  # only this chunk's update, not the whole host tier
                if self._host_done is not None and self._host_done.done():
                    self._host_done.result()  # re-raises a worker failure instead of waiting forever
                    break
            self.timings["chunk_wait"] += time.perf_counter() - start
        ready = self._param_ready.pop(chunk, None)
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)

    def finish_pending(self) -> None:
        """Block until every host update and copy has landed (before checkpoints and re-planning)."""
        for chunk in list(self._host_ready) + list(self._param_ready):
            self.wait_for_chunk(chunk)
        if self._host_done is not None:
            self._host_done.result()
            self._host_done = None
        if self._cuda:
            torch.cuda.current_stream(self.device).synchronize()

    def report(self) -> dict[str, float]:
        """Per-tier bytes and the traffic and waiting since the previous report (then resets those).

        ``overlap`` is the share of the host tier's work (gradient accumulation and CPU Adam) that
        the training thread did not wait for: 1.0 means fully hidden under GPU compute.
        """
        host_work = self.timings["host_update"]
        waited = self.timings["grad_wait"] + self.timings["chunk_wait"]
        report = {f"zero_cache_{name}_bytes": tier.used_bytes for name, tier in self.store.tiers.items()}
        report.update({f"zero_cache_{way}_bytes": moved for way, moved in self.moved_bytes.items()})
        report.update({f"zero_cache_{name}_s": seconds for name, seconds in self.timings.items()})
        if host_work > 0 and self._cuda:  # without CUDA the host work runs inline: nothing to hide it under
            report["zero_cache_overlap"] = max(0.0, 1.0 - waited / host_work)
        self.timings = dict.fromkeys(self.timings, 0.0)
        self.moved_bytes = dict.fromkeys(self.moved_bytes, 0)
        return report

    # ------------------------------------------------------------------ checkpoints
    def master_state_dict(self) -> dict[str, torch.Tensor]:
        self.finish_pending()
        return {s.name: self.store.state_view(s, "master").detach().cpu().clone().view(s.shape) for _, s in self.members}

    def load_master_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.finish_pending()
        missing = [name for name in self.names if name not in state]
        if missing:
            raise KeyError(f"checkpoint lacks master weights for {missing[:5]}")
        with torch.no_grad():
            for _, slot in self.members:
                self.store.state_view(slot, "master").copy_(state[slot.name].reshape(-1))
            for chunk in range(len(self.store.groups)):
                self._refresh_param_chunk(chunk)
        self.finish_pending()

    def refresh_masters_from_params(self) -> None:
        self.finish_pending()
        with torch.no_grad():
            for _, slot in self.members:
                self.store.state_view(slot, "master").copy_(self.store.param_view(slot).reshape(-1))

    def state_dict(self) -> dict[str, Any]:
        self.finish_pending()
        moments = {f: {s.name: self.store.state_view(s, f).cpu().clone() for _, s in self.members}
                   for f in ("exp_avg", "exp_avg_sq")}
        hypers = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        return {"optimizer": {"step": self.step_count, "param_groups": hypers, **moments},
                "masters": self.master_state_dict(),
                "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler else None}

    def load_state_dict(self, state: dict[str, Any], *, load_optimizer_states: bool = True) -> None:
        self.load_master_state_dict(state["masters"])
        if not load_optimizer_states:
            return
        saved = state["optimizer"]
        self.step_count = saved["step"]
        for group, hyper in zip(self.optimizer.param_groups, saved["param_groups"]):
            group.update(hyper)
        with torch.no_grad():
            for field in ("exp_avg", "exp_avg_sq"):
                for _, slot in self.members:
                    self.store.state_view(slot, field).copy_(saved[field][slot.name])
        if self.loss_scaler is not None and state.get("loss_scaler"):
            self.loss_scaler.load_state_dict(state["loss_scaler"])
