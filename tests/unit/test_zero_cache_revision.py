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

import itertools
import math

import pytest
import torch
from reference import random_batches
from zero_cache_setup import BF16_BYTES_PER_ELEMENT, budgets, six_layer_llama, zero_cache_config

import angelptm
from zero_cache.optim.revision import APPLIED, DEFERRED, SpeculationWindow
from zero_cache.plan.planner import OFF_DEVICE

LR, BETAS, EPS, WEIGHT_DECAY = 3e-3, (0.9, 0.95), 1e-8, 0.1
TOLERANCE = 1e-6
TARGET_NORMS = [None, 0.5, 0.5, 1.2, 0.5, 0.5, 100.0, 0.5, 0.5, 1.2]
"""Gradient norms the loss is scaled to reach, step by step (threshold 1; None: loss as it is, which measures the
scale): 0.5 is not clipped; 1.2 is clipped once every chunk has been applied (all redone); 100 is a spike, clipped
with most chunks deferred (the chunks updated in backward need a 1e-4 share of the squared norm for one of them to be
deferred: at a spike of 3, in about one run in 30 they held less, and none was). After a clipped step the next is
predicted to clip too and is not speculated, so the unclipped steps come in pairs."""


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
            outcomes = [update.outcome for update in optimizer.chunk_steps.speculated().values()]
        engine.step()
    return not optimizer.overflow, outcomes


def host_chunks_kept(optimizer) -> set[int]:
    return {c for c, g in enumerate(optimizer.store.groups) if g.tier in OFF_DEVICE
            and (g.kept is not None or optimizer.store.grads_in_accumulators)}


@pytest.fixture(params=["torch", "native"])
def host_kernel(request) -> dict:
    """The host Adam each engine test runs on: the library kernels (with torch's fallbacks), or the csrc kernel."""
    if request.param == "native":
        request.getfixturevalue("native_adam")
    return {"native_host_adam": request.param == "native"}


@pytest.mark.parametrize("accumulation", [1, 2])
def test_each_step_equals_the_reference_clipped_update_whether_or_not_it_clips(accumulation, host_kernel):
    seed = torch.randint(0, 10_000, ()).item()
    engine, optimizer = build(seed, accumulation=accumulation, **host_kernel)
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
            assert_states_close(states(optimizer), before, f"skipped step {index + 1}")
        else:
            assert applied and APPLIED in outcomes
            want = reference_step(before, grads, step=optimizer.step_count, clip=1.0, unscale=1 / scale)
            assert_states_close(states(optimizer), want, f"step {index + 1}", before)
    assert engine.skipped_steps == 2


def test_a_nan_mid_run_is_skipped_the_run_continues_and_its_checkpoint_resumes_exactly(tmp_path, host_kernel):
    seed = torch.randint(0, 10_000, ()).item()
    engine, optimizer = build(seed, clip=0.0, **host_kernel)  # no clipping: the NaN is what the step must catch
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
    assert_states_close(after, before, "the skipped step")
    for name, param in engine.module.named_parameters():  # (the restored masters, rounded: not a stepped weight)
        assert torch.equal(param, after[name][0].to(param.dtype).view(param.shape)), f"{name} was not restored"
    run_step(engine, optimizer, catcher, batches[2:3], 1.0)
    engine.save_checkpoint(str(tmp_path), tag="after_nan")
    expected = [run_step(engine, optimizer, catcher, [b], 1.0)[0] and optimizer.last_grad_norm for b in batches[3:]]
    resumed, resumed_opt = build(seed, clip=0.0, **host_kernel)
    resumed.load_checkpoint(str(tmp_path), tag="after_nan")
    got = [run_step(resumed, resumed_opt, GradientCatcher(resumed), [b], 1.0)[0] and resumed_opt.last_grad_norm
           for b in batches[3:]]
    assert got == expected
    for name, value in optimizer.master_state_dict().items():
        assert torch.equal(resumed_opt.master_state_dict()[name], value), name


def test_zero_grad_after_updates_made_during_backward_takes_them_back(host_kernel):
    seed = torch.randint(0, 10_000, ()).item()
    engine, optimizer = build(seed, clip=0.0, **host_kernel)
    batches = random_batches(seed, count=3, batch=4)
    catcher = GradientCatcher(engine)
    run_step(engine, optimizer, catcher, batches[:1], 1.0)
    before = states(optimizer)
    engine.backward(engine(**batches[1]))
    assert optimizer.chunk_steps.speculated(), "host chunks were updated during that backward"
    engine.zero_grad()
    catcher.take()
    assert_states_close(states(optimizer), before, "after zero_grad")
    run_step(engine, optimizer, catcher, batches[2:], 1.0)
    want = reference_step(before, catcher.take(), step=optimizer.step_count, clip=0.0, unscale=1.0)
    assert_states_close(states(optimizer), want, "the step after zero_grad", before)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_unclipped_steps_in_backward_equal_steps_after_it_bit_for_bit(native_adam, accumulation):
    """The csrc kernel's lazy steps (moments folded in at the chunk's next step, or before the accumulator is
    reused) leave the very bits of updates made after backward, over a run whose states are never read between
    steps (so every fold happens inside the next step's pass)."""
    seed = torch.randint(0, 10_000, ()).item()
    batches = random_batches(seed, count=4 * accumulation, batch=4)
    runs = {}
    for in_backward in (True, False):
        engine, optimizer = build(seed, clip=0.0, accumulation=accumulation, native_host_adam=True,
                                  update_in_backward=in_backward)
        for step in range(4):
            run_step(engine, optimizer, None, batches[step * accumulation:(step + 1) * accumulation], 1.0)
        speculated = 4 * len(host_chunks_kept(optimizer)) if in_backward else 0
        assert optimizer.reports.counts["speculated_chunks"] == speculated
        assert optimizer.reports.counts["clipped_steps"] == 0
        runs[in_backward] = states(optimizer)
    for name, (master, exp_avg, exp_avg_sq) in runs[True].items():
        assert torch.equal(master, runs[False][name][0]), name
        assert torch.equal(exp_avg, runs[False][name][1]) and torch.equal(exp_avg_sq, runs[False][name][2]), name


def admitted(window: SpeculationWindow, squares: list[float], order: list[int]) -> tuple[list[bool], list[float]]:
    """The window's outcome per update (in joining order) when the worker reaches them in ``order``, and the squares
    it took, in the order it took them."""
    positions = [window.join(square) for square in squares]
    taken = []
    outcomes = {p: window.admits(p, lambda square: taken.append(square) or square) for p in order}
    return [outcomes[p] for p in positions], taken


def test_the_window_defers_once_the_partial_norm_passes_the_threshold_or_is_not_finite():
    window = SpeculationWindow(max_norm=1.0, grad_factor=0.5)  # summed squares up to (1 / 0.5)^2 = 4 are admitted
    outcomes, _ = admitted(window, [3.0, 1.0, 0.5, 0.0], [0, 1, 2, 3])
    assert outcomes == [True, True, False, False], "once past the threshold, every later chunk defers"
    outcomes, _ = admitted(SpeculationWindow(max_norm=0.0, grad_factor=1.0), [1e30, math.nan, 1.0], [0, 1, 2])
    assert outcomes == [True, False, False]


@pytest.mark.parametrize("max_norm, squares, expected", [
    (1.0, [1.5, 1.0, 2.0, 0.25, 0.0], [True, True, False, False, False]),
    (0.0, [2.0, 1e30, math.inf, 0.5, 1.0], [True, True, False, False, False]),
])
def test_the_window_decides_in_backward_order_whichever_update_the_worker_reaches_first(max_norm, squares, expected):
    """step() re-sorts the updates the worker has not started into forward order, and how many those are depends
    on thread timing: an outcome depends on the squares of the chunks backward completed before it alone."""
    for order in itertools.permutations(range(len(squares))):
        outcomes, taken = admitted(SpeculationWindow(max_norm=max_norm, grad_factor=0.5), squares, list(order))
        assert outcomes == expected, order
        assert taken == squares, f"each square is taken once, in backward order ({order})"


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
    from zero_cache.optim.host_adam import HostAdam, torch_fused_adam

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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_lazy_step_folded_later_is_the_eager_step_and_taken_back_restores_the_moments(native_adam, dtype):
    """A lazy step stores the weight alone; folding its kept gradient in (in the next step's pass, or alone) leaves
    the eager steps' very bits; taking it back leaves the moments untouched and the master within an ulp of the
    terms (a few roundings)."""
    from zero_cache.optim.host_adam import HostAdam

    generator = torch.Generator().manual_seed(torch.randint(0, 10_000, ()).item())
    numel = 100_003
    before = [torch.randn(numel, generator=generator), torch.randn(numel, generator=generator) * 1e-2,
              torch.rand(numel, generator=generator) * 1e-4]
    grads = [(torch.randn(numel, generator=generator) * 10 ** -k).to(dtype) for k in (1, 3)]  # a 100x drop
    hyper = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    adam = HostAdam(True, try_deepspeed=False, try_native=True)
    eager, lazy = [t.clone() for t in before], [t.clone() for t in before]
    kept = torch.empty_like(grads[0])
    for step, grad in zip((6, 7), grads):
        eager_out, lazy_out = grad.clone(), grad.clone()
        adam.update_in_place(*eager[:1], eager_out, *eager[1:], step=step, grad_scale=0.5, **hyper)
        adam.update_in_place(*lazy[:1], lazy_out, *lazy[1:], step=step, grad_scale=0.5, kept=kept, lazy=True,
                             fold_scale=0.5 if step == 7 else 0.0, **hyper)
        assert torch.equal(lazy_out, eager_out) and torch.equal(lazy[0], eager[0]), f"step {step}: the weight"
        assert torch.equal(kept, grad)
    adam.fold(lazy[1], lazy[2], kept, scale=0.5, betas=BETAS)
    for got, want in zip(lazy, eager):
        assert torch.equal(got, want), "a lazy step folded later is bit for bit the eager step"

    for redo in (0.0, 0.2):  # taken back (a skipped step), or redone with a clip factor
        got = [t.clone() for t in before]
        adam.update_in_place(*got[:1], grads[0].clone(), *got[1:], step=6, grad_scale=0.5, kept=kept, lazy=True,
                             **hyper)
        stepped = got[0].clone()
        adam.revise(got[0], kept, torch.empty_like(kept), got[1], got[2], step=6, hyper=hyper, undo_scale=0.5,
                    redo_scale=redo, undo_lazy=True)
        want = [t.clone() for t in before]
        if redo:
            adam.update_in_place(*want[:1], grads[0].clone(), *want[1:], step=6, grad_scale=redo, **hyper)
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2]), "the moments are exact"
        # Within rounding of the terms: the weight before, the update added back to it, the weight after.
        terms = before[0].abs() + (stepped - before[0]).abs() + want[0].abs()
        ulps = ((got[0] - want[0]).abs() / (torch.finfo(torch.float32).eps * terms)).max()
        assert ulps <= 4, f"the master is off by {ulps:.1f} ulp of its terms"


@pytest.mark.parametrize("native", [False, True])
def test_library_lazy_step_in_pieces_then_folded_is_the_library_step(monkeypatch, request, native):
    """The library kernels' lazy step works through two small buffers, piece by piece (here 1,000 elements):
    the weight it stores, and the moments folded in later (by torch, or the csrc fold), are those of the plain
    step (fp16 gradient)."""
    from zero_cache.optim import host_adam
    from zero_cache.optim.host_adam import HostAdam

    monkeypatch.setattr(host_adam, "PIECE", 1000)
    generator = torch.Generator().manual_seed(torch.randint(0, 10_000, ()).item())
    numel = 4_321
    before = [torch.randn(numel, generator=generator), torch.randn(numel, generator=generator) * 1e-2,
              torch.rand(numel, generator=generator) * 1e-4]
    kept = (torch.randn(numel, generator=generator) * 1e-2).half()
    hyper = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    if native:
        request.getfixturevalue("native_adam")
    adam = HostAdam(True, try_deepspeed=False, try_native=native)
    lazy, eager = [t.clone() for t in before], [t.clone() for t in before]
    adam.lazy_update([lazy[0]], [kept.float() * 0.5], [lazy[1]], [lazy[2]], step=3, **hyper)
    assert torch.equal(lazy[1], before[1]) and torch.equal(lazy[2], before[2]), "a lazy step stores no moments"
    adam.update([eager[0]], [kept.float() * 0.5], [eager[1]], [eager[2]], step=3, **hyper)
    assert torch.equal(lazy[0], eager[0])
    adam.fold(lazy[1], lazy[2], kept, scale=0.5, betas=BETAS)
    for got, want in zip(lazy[1:], eager[1:]):  # (the csrc fold and torch's kernel round apart: per tensor, as above)
        assert (torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want)).item() <= TOLERANCE


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
    assert optimizer.reports.counts["speculated_chunks"] > 0


@pytest.mark.parametrize("read_between", [True, False])
def test_waited_updates_folded_later_equal_eager_ones_bit_for_bit(native_adam, read_between):
    """Where every step clips, the host updates wait for the global norm; they store the weight alone and keep their
    gradient, and a job behind them folds the moments in. The states and the weights the next forward reads are the
    bits of updates that store everything in their pass, and match the reference clipped AdamW: read after every
    step (each fold forced), or only at the end (the folds run when the worker reaches them, behind the next
    step's forward)."""
    seed = torch.randint(0, 10_000, ()).item()
    batches = random_batches(seed, count=4, batch=4)
    runs = {}
    for fold_waited in (True, False):
        # (every step's norm is far above the clip; the JSON's zero_cache.fold_waited_updates is the A/B's switch)
        engine, optimizer = build(seed, clip=1e-3, native_host_adam=True, fold_waited_updates=fold_waited)
        assert optimizer.fold_waited is fold_waited
        catcher, per_step = GradientCatcher(engine), []
        for index, batch in enumerate(batches):
            last = index == len(batches) - 1
            before = states(optimizer) if fold_waited and read_between else None
            run_step(engine, optimizer, catcher, [batch], 1.0)
            grads = catcher.take()
            if not (read_between or last):
                continue
            per_step.append((states(optimizer), {n: p.detach().clone() for n, p in engine.module.named_parameters()}))
            if before is not None and index:  # (step 1 speculated: the prediction starts unclipped)
                want = reference_step(before, grads, step=optimizer.step_count, clip=1e-3, unscale=1.0)
                assert_states_close(per_step[-1][0], want, f"waited step {index + 1}", before)
        assert optimizer.reports.counts["clipped_steps"] == len(batches)
        runs[fold_waited] = per_step
        if fold_waited:  # steps 2-4 waited: each host chunk with a kept gradient ran lazy, then folded
            assert optimizer.host.folded_later == 3 * len(host_chunks_kept(optimizer)) > 0
            assert not optimizer.chunk_steps.owing_folds()
        else:
            assert optimizer.host.folded_later == 0
    for step, ((folded, weights), (eager, eager_weights)) in enumerate(zip(runs[True], runs[False])):
        for name, fields in folded.items():
            for field, a, b in zip(("master", "exp_avg", "exp_avg_sq"), fields, eager[name]):
                assert torch.equal(a, b), f"step {step + 1}: {name} {field}"
        for name, weight in weights.items():
            assert torch.equal(weight, eager_weights[name]), f"step {step + 1}: weight {name}"
