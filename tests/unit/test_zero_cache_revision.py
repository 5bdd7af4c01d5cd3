"""Host updates during backward stay exact under clipping, loss scaling, skipped steps and accumulation.

Each step is checked on its own against the reference: the engine's fp32 masters and moments before
the step, the gradients backward produced (caught by tensor hooks), ``torch.nn.utils.clip_grad_norm_``
and ``torch.optim.AdamW``. Step by step, so bf16 trajectories (which amplify any rounding) do not
blur what is compared: the update itself, at 1e-6 relative per tensor.

Relative to what: to the size of the terms the step adds, the scale at which fp32 itself rounds. An
exp_avg of ``b1 * m + (1 - b1) * g`` whose two terms nearly cancel is small, and one ulp of either term
is then a large part of it, whoever computes it (torch's own foreach and fused Adam differ so too).
"""

from __future__ import annotations

import math

import pytest
import torch

import angelptm
from reference import random_batches
from zero_cache.planner import OFF_DEVICE
from zero_cache.revision import APPLIED, DEFERRED, SpeculationWindow
from zero_cache_setup import BF16_BYTES_PER_ELEMENT, budgets, six_layer_llama, zero_cache_config

LR, BETAS, EPS, WEIGHT_DECAY = 3e-3, (0.9, 0.95), 1e-8, 0.1
TOLERANCE = 1e-6
UNDO_TOLERANCE = 1e-4
"""A step taken back and the step after it. Undoing recovers each moment to one ulp of its *stepped* value;
where an element's gradient jumped by orders of magnitude since the last step (common in the first steps),
that ulp is a large part of the element's old exp_avg_sq, and Adam, which divides by its root, turns it into an
lr-sized change of that weight: up to ~2e-5 of a tensor here. zero_cache.revision says so; keeping the moments
unstepped until the norm is known (folding them into the next step) would make this exact too."""
TARGET_NORMS = [None, 0.5, 0.5, 1.2, 0.5, 0.5, 3.0, 0.5, 0.5, 1.2]
"""Gradient norms the loss is scaled to reach, step by step (threshold 1; None: loss as it is, which measures the
scale): 0.5 is not clipped; 1.2 is clipped once every chunk has been applied (all redone); 10 is a spike, clipped
with most chunks deferred. After a clipped step the next is predicted to clip too and is not speculated, so the
unclipped steps come in pairs."""


def build(seed: int, *, clip: float = 1.0, accumulation: int = 1, fp16: bool = False, **zero_cache):
    model = six_layer_llama(seed)
    device_budget, host_budget = budgets(model, BF16_BYTES_PER_ELEMENT)
    config = zero_cache_config(device_budget, host_budget * 2, clip=clip, gradient_accumulation_steps=accumulation)
    config["zero_cache"].update(param_home="device", **zero_cache)
    if fp16:
        del config["bf16"]
        config["fp16"] = {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 1000, "hysteresis": 1}
    engine, optimizer, _, _ = angelptm.initialize(model=model, config=config)
    return engine, optimizer


class GradientCatcher:
    """The gradients each parameter receives in backward (summed over a window's micro-batches)."""

    def __init__(self, engine) -> None:
        self.grads: dict[str, torch.Tensor] = {}
        for name, param in engine.module.named_parameters():
            param.register_hook(lambda grad, name=name: self._add(name, grad))

    def _add(self, name: str, grad: torch.Tensor) -> None:
        total = self.grads.get(name)
        self.grads[name] = grad.float() if total is None else total + grad.float()

    def take(self) -> dict[str, torch.Tensor]:
        grads, self.grads = self.grads, {}
        return grads


def states(optimizer) -> dict[str, tuple[torch.Tensor, ...]]:
    """name -> (master, exp_avg, exp_avg_sq), once every host update has landed."""
    optimizer.finish_pending()
    out = {}
    for _, slot in optimizer.members:
        out[slot.name] = tuple(optimizer.store.state_view(slot, f).clone() for f in ("master", "exp_avg", "exp_avg_sq"))
    return out


def reference_step(before, grads, *, step: int, clip: float, unscale: float) -> dict[str, tuple[torch.Tensor, ...]]:
    """torch's clip_grad_norm_ and AdamW from ``before`` with ``grads`` (times ``unscale``)."""
    names = list(before)
    masters = [before[n][0].clone().requires_grad_(True) for n in names]
    for master, name in zip(masters, names):
        master.grad = grads[name].reshape(-1) * unscale
    if clip:
        torch.nn.utils.clip_grad_norm_(masters, clip)
    optimizer = torch.optim.AdamW(masters, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    for master, name in zip(masters, names):
        optimizer.state[master] = {"step": torch.tensor(float(step - 1)), "exp_avg": before[name][1].clone(),
                                   "exp_avg_sq": before[name][2].clone()}
    optimizer.step()
    return {n: (m.detach(), optimizer.state[m]["exp_avg"], optimizer.state[m]["exp_avg_sq"])
            for n, m in zip(names, masters)}


def assert_states_close(got, want, what: str, before=None, tolerance: float = TOLERANCE) -> None:
    """Per tensor: ``||got - want|| <= TOLERANCE * scale``, the scale being the larger of the norms of ``want`` and
    of the state ``before`` the step (the terms a step adds are the state before it and what it changes by)."""
    for name in want:
        for index, field in enumerate(("master", "exp_avg", "exp_avg_sq")):
            a, b = got[name][index], want[name][index]
            scale = torch.linalg.vector_norm(b)
            if before is not None:
                scale = torch.maximum(scale, torch.linalg.vector_norm(before[name][index]))
            error = (torch.linalg.vector_norm(a - b) / scale.clamp_min(1e-30)).item()
            assert error <= tolerance, f"{what}: {name} {field} differs by {error:.1e} relative"


def run_step(engine, optimizer, catcher, batches, factor: float) -> tuple[bool, list[str]]:
    """One optimizer step over ``batches`` (its micro-batches) with the loss times ``factor``: whether it applied,
    and the outcome of each update made during its backward (APPLIED or DEFERRED)."""
    outcomes = []
    for batch in batches:
        engine.backward(engine(**batch) * factor)
        if batch is batches[-1]:
            optimizer.host.drain()  # (lets the test read which speculative updates were applied or deferred)
            outcomes = [update.outcome for update in optimizer._queued.values()]
        engine.step()
    return not optimizer.overflow, outcomes


def host_chunks_kept(optimizer) -> set[int]:
    return {c for c, g in enumerate(optimizer.store.groups) if g.tier in OFF_DEVICE
            and (g.kept is not None or optimizer.store.grads_in_accumulators)}


@pytest.mark.parametrize("accumulation", [1, 2])
def test_each_step_equals_the_reference_clipped_update_whether_or_not_it_clips(accumulation):
    seed = torch.randint(0, 10_000, ()).item()
    engine, optimizer = build(seed, accumulation=accumulation)
    assert optimizer.update_in_backward and host_chunks_kept(optimizer), "some host chunks must update in backward"
    catcher = GradientCatcher(engine)
    batches = random_batches(seed, count=len(TARGET_NORMS) * accumulation, batch=4)
    seen = set()
    base_norm = None  # the norm at loss factor 1, from the first step
    for index, target in enumerate(TARGET_NORMS):
        factor = 1.0 if target is None else target / base_norm
        before = states(optimizer)
        window = batches[index * accumulation:(index + 1) * accumulation]
        applied, outcomes = run_step(engine, optimizer, catcher, window, factor)
        assert applied
        norm = optimizer.last_grad_norm
        base_norm = base_norm or norm / factor
        seen.update((norm > 1.0, outcome) for outcome in outcomes)
        want = reference_step(before, catcher.take(), step=optimizer.step_count, clip=1.0, unscale=1.0)
        assert_states_close(states(optimizer), want, f"step {index + 1} (norm {norm:.3g})", before)
    # Both kinds of step, and in the clipped ones updates applied early (then redone) and deferred ones.
    assert {(False, APPLIED), (True, APPLIED), (True, DEFERRED)} <= seen, seen


def test_fp16_overflow_is_skipped_with_the_scale_lowered_and_later_steps_exact():
    seed = torch.randint(0, 10_000, ()).item()
    engine, optimizer = build(seed, fp16=True)
    catcher = GradientCatcher(engine)
    batches = random_batches(seed, count=5, batch=4)
    first_layer = next(p for n, p in engine.module.named_parameters() if n.startswith("blocks.0."))
    # Unclipped steps (loss x 1e-3), an overflow everywhere (x 1e6 at scale 4096: every chunk deferred), and
    # an overflow in the first layer only, whose gradient comes last: the chunks before it were updated.
    for index, overflow in enumerate([None, "everywhere", None, None, "first layer"]):
        before, scale = states(optimizer), optimizer.loss_scaler.scale
        hook = first_layer.register_hook(lambda grad: grad * math.inf) if overflow == "first layer" else None
        applied, outcomes = run_step(engine, optimizer, catcher, batches[index:index + 1],
                                     1e6 if overflow == "everywhere" else 1e-3)
        grads = catcher.take()
        if hook is not None:
            hook.remove()
        if overflow:
            assert not applied and optimizer.loss_scaler.scale < scale, "an overflow skips and lowers the scale"
            assert (APPLIED in outcomes) == (overflow == "first layer"), outcomes
            assert_states_close(states(optimizer), before, f"skipped step {index + 1}", tolerance=UNDO_TOLERANCE)
        else:
            assert applied and APPLIED in outcomes
            want = reference_step(before, grads, step=optimizer.step_count, clip=1.0, unscale=1 / scale)
            assert_states_close(states(optimizer), want, f"step {index + 1}", before, tolerance=UNDO_TOLERANCE)
    assert engine.skipped_steps == 2


def test_a_nan_mid_run_is_skipped_the_run_continues_and_its_checkpoint_resumes_exactly(tmp_path):
    seed = torch.randint(0, 10_000, ()).item()
    engine, optimizer = build(seed, clip=0.0)  # no clipping: the NaN is what the step must catch
    batches = random_batches(seed, count=6, batch=4)
    catcher = GradientCatcher(engine)
    run_step(engine, optimizer, catcher, batches[:1], 1.0)
    before = states(optimizer)
    # A NaN in the first layer's gradient, which comes last in backward: the host chunks were updated already.
    first = next(p for n, p in engine.module.named_parameters() if n.startswith("blocks.0."))
    handle = first.register_hook(lambda grad: grad * float("nan"))
    applied, outcomes = run_step(engine, optimizer, catcher, batches[1:2], 1.0)
    assert not applied
    handle.remove()
    assert APPLIED in outcomes
    after = states(optimizer)
    assert_states_close(after, before, "the skipped step", tolerance=UNDO_TOLERANCE)
    for name, param in engine.module.named_parameters():  # (the restored masters, rounded: not a stepped weight)
        assert torch.equal(param, after[name][0].to(param.dtype).view(param.shape)), f"{name} was not restored"
    run_step(engine, optimizer, catcher, batches[2:3], 1.0)
    engine.save_checkpoint(str(tmp_path), tag="after_nan")
    expected = [run_step(engine, optimizer, catcher, [b], 1.0)[0] and optimizer.last_grad_norm for b in batches[3:]]
    resumed, resumed_opt = build(seed, clip=0.0)
    resumed.load_checkpoint(str(tmp_path), tag="after_nan")
    got = [run_step(resumed, resumed_opt, GradientCatcher(resumed), [b], 1.0)[0] and resumed_opt.last_grad_norm
           for b in batches[3:]]
    assert got == expected
    for name, value in optimizer.master_state_dict().items():
        assert torch.equal(resumed_opt.master_state_dict()[name], value), name


def test_zero_grad_after_updates_made_during_backward_takes_them_back():
    seed = torch.randint(0, 10_000, ()).item()
    engine, optimizer = build(seed, clip=0.0)
    batches = random_batches(seed, count=3, batch=4)
    catcher = GradientCatcher(engine)
    run_step(engine, optimizer, catcher, batches[:1], 1.0)
    before = states(optimizer)
    engine.backward(engine(**batches[1]))
    assert optimizer._queued, "host chunks were updated during that backward"
    engine.zero_grad()
    catcher.take()
    assert_states_close(states(optimizer), before, "after zero_grad", tolerance=UNDO_TOLERANCE)
    run_step(engine, optimizer, catcher, batches[2:], 1.0)
    want = reference_step(before, catcher.take(), step=optimizer.step_count, clip=0.0, unscale=1.0)
    assert_states_close(states(optimizer), want, "the step after zero_grad", before, tolerance=UNDO_TOLERANCE)


def test_the_window_defers_once_the_partial_norm_passes_the_threshold_or_is_not_finite():
    window = SpeculationWindow(max_norm=1.0, grad_factor=0.5)  # summed squares up to (1 / 0.5)^2 = 4 are admitted
    assert window.admits(3.0) and window.admits(1.0)
    assert not window.admits(0.5) and not window.admits(0.0), "once past the threshold, every later chunk defers"
    unclipped = SpeculationWindow(max_norm=0.0, grad_factor=1.0)
    assert unclipped.admits(1e30) and not unclipped.admits(math.nan) and not unclipped.admits(1.0)


def test_removed_overlap_optimizer_step_key_says_why():
    with pytest.raises(angelptm.ConfigError, match="overlap_optimizer_step: removed.*update_in_backward"):
        angelptm.config.load_config({"train_micro_batch_size_per_gpu": 1,
                                     "zero_cache": {"enabled": True, "overlap_optimizer_step": True}})


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("step", [1, 6])
def test_native_revision_redoes_and_takes_back_a_step_like_the_reference(native_adam, decoupled, dtype, step):
    """The one-pass kernel: a speculative step (factor 1, gradient kept in the same pass), then redone with the
    true factor, equals torch's Adam with that factor; taken back, it equals the states before."""
    from zero_cache.host_adam import HostAdam, torch_fused_adam

    generator = torch.Generator().manual_seed(torch.randint(0, 10_000, ()).item())
    numel = 100_003  # not a multiple of any vector width
    before = [torch.randn(numel, generator=generator), torch.randn(numel, generator=generator) * 1e-2,
              torch.rand(numel, generator=generator) * 1e-4]
    if step == 1:
        before[1].zero_(), before[2].zero_()
    grad = (torch.randn(numel, generator=generator) * 1e-2).to(dtype)
    hyper = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    adam = HostAdam(decoupled, try_deepspeed=False, try_native=True)
    want = [t.clone() for t in before]
    torch_fused_adam([want[0]], [grad.float() * 0.3], [want[1]], [want[2]], decoupled=decoupled, step=step, **hyper)
    for redo in (0.3, 0.0):
        got, kept, grad_and_out = [t.clone() for t in before], torch.empty_like(grad), grad.clone()
        adam.update_in_place(*got[:1], grad_and_out, *got[1:], step=step, grad_scale=1.0, kept=kept, **hyper)
        assert torch.equal(kept, grad) and torch.equal(grad_and_out, got[0].to(dtype))
        out = torch.empty_like(grad)
        adam.revise(got[0], kept, out, got[1], got[2], step=step, hyper=hyper, undo_scale=1.0, redo_scale=redo)
        assert torch.equal(out, got[0].to(dtype)), "the weight written is the revised master, rounded"
        expected = want if redo else before
        for index, field in enumerate(("master", "exp_avg", "exp_avg_sq")):  # (scale: see assert_states_close)
            scale = max(torch.linalg.vector_norm(expected[index]), torch.linalg.vector_norm(want[index]))
            error = (torch.linalg.vector_norm(got[index] - expected[index]) / scale).item()
            assert error < TOLERANCE, f"{'redo' if redo else 'undo'}: {field} off by {error:.1e}"


def test_a_slow_update_during_the_last_micro_batch_does_not_wait_on_gradients_staged_behind_it():
    """The training thread stages every micro-batch gradient through pinned buffers; an update during backward
    that needs one too (for its new weights) must not wait for gradient jobs queued behind it (a deadlock)."""
    import threading
    import time

    seed = torch.randint(0, 10_000, ()).item()
    engine, optimizer = build(seed, accumulation=2)
    assert host_chunks_kept(optimizer)
    library_update = optimizer.host_adam.update

    def slow_update(*args, **kwargs):  # the worker is still in CPU Adam while backward stages gradients
        time.sleep(0.05)
        library_update(*args, **kwargs)

    optimizer.host_adam.update = slow_update
    done = threading.Event()
    batches = random_batches(seed, count=4, batch=4)

    def train() -> None:
        catcher = GradientCatcher(engine)
        run_step(engine, optimizer, catcher, batches[:2], 1e-3)
        run_step(engine, optimizer, catcher, batches[2:], 1e-3)
        done.set()

    threading.Thread(target=train, daemon=True).start()
    assert done.wait(timeout=120), "training hung: an update waited for a buffer held by gradients queued behind it"
    assert optimizer.counts["speculated_chunks"] > 0
