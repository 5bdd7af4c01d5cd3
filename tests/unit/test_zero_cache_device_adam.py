"""The device's Adam in one pass (``zero_cache.optim.device_adam``): the runs it launches over, its kernel against
torch's fused Adam on fresh random inputs, and an engine whose device chunks take it training like one whose device
chunks take the four passes.

The kernel is Triton's; here it runs under Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors, so these
tests need Triton installed (CUDA builds of torch bring it, and the test extras install it on Linux x86-64: CI runs
them; elsewhere they are skipped). The same kernel compiled for a GPU is checked in
``tests/gpu/test_zero_cache_device_adam_cuda.py``.
"""

from __future__ import annotations

import importlib
import random

import pytest
import torch
from reference import random_batches, train_steps
from test_zero_cache_streamed import assert_trained_alike
from zero_cache_setup import resident_engine, six_layer_llama

from zero_cache.optim import device_adam
from zero_cache.optim import device_groups as groups_module
from zero_cache.optim.host_adam import torch_fused_adam
from zero_cache.plan.layout import ALIGN_NUMEL, TensorSlot
from zero_cache.plan.planner import DEVICE


def test_contiguous_runs_are_the_slots_elements_in_maximal_runs():
    rng = random.Random(torch.randint(0, 10_000, ()).item())
    for _ in range(200):
        slots, offset = [], 0
        for index in range(rng.randint(0, 8)):
            offset += rng.choice([0, 0, rng.randint(1, 5)])  # back to back, or a gap (another group's, padding)
            numel = rng.randint(1, 9)
            slots.append(TensorSlot(f"p{index}", (numel,), 0, offset))
            offset += numel
        chosen = rng.sample(slots, rng.randint(0, len(slots)))
        runs = device_adam.contiguous_runs(chosen)

        expected = {e for s in chosen for e in range(s.offset, s.offset + s.numel)}
        covered = [e for low, high in runs for e in range(low, high)]
        assert covered == sorted(expected)  # every element once, in chunk order
        assert all(low < high for low, high in runs)
        assert all(a[1] < b[0] for a, b in zip(runs, runs[1:]))  # maximal: no two runs touch


@pytest.fixture
def one_pass(monkeypatch):
    """The module with its kernel built for Triton's interpreter (it reads ``TRITON_INTERPRET`` on import)."""
    pytest.importorskip("triton", reason="the one-pass kernel is Triton's (CUDA builds of torch bring it)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    module = importlib.reload(device_adam)
    yield module
    monkeypatch.delenv("TRITON_INTERPRET")
    importlib.reload(device_adam)


EPS = torch.finfo(torch.float32).eps
"""fp32's ulp at 1: the two kernels differ in the order of a few roundings."""


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_one_pass_is_torch_fused_adam_to_a_few_ulps(one_pass, decoupled, grad_dtype):
    generator = torch.Generator().manual_seed(torch.randint(0, 10_000, ()).item())
    numel = int(torch.randint(1, 3 * device_adam.BLOCK, (), generator=generator))  # a last block cut short
    master = torch.randn(numel, generator=generator)
    exp_avg = torch.randn(numel, generator=generator) * 0.1
    exp_avg_sq = torch.rand(numel, generator=generator) * 0.01
    grad = (torch.randn(numel, generator=generator) * 3).to(grad_dtype)
    factor = float(torch.rand((), generator=generator)) + 0.1
    hyper = {"lr": 1e-3 * (1 + float(torch.rand((), generator=generator))), "betas": (0.9, 0.95), "eps": 1e-8,
             "weight_decay": 0.1}
    step = int(torch.randint(1, 50, (), generator=generator))

    before = [master.clone(), exp_avg.clone(), exp_avg_sq.clone()]
    expected = [state.clone() for state in before]
    torch_fused_adam([expected[0]], [grad.float() * factor], [expected[1]], [expected[2]], decoupled=decoupled,
                     step=step, **hyper)
    grad_before = grad.clone()
    params = torch.full((numel,), float("nan"), dtype=torch.bfloat16)
    states = [master, exp_avg, exp_avg_sq]
    one_pass.adam_in_one_pass(states, grad, params, grad_factor=factor, step=step, decoupled=decoupled, **hyper)

    for name, got, want, old in zip(("master", "exp_avg", "exp_avg_sq"), states, expected, before):
        assert (want != old).float().mean() > 0.99, name  # the step moved (nearly) every element
        torch.testing.assert_close(got, want, rtol=4 * EPS, atol=4 * EPS * old.abs().mean().item(), msg=name)
    assert torch.equal(params, master.to(torch.bfloat16))  # the params are the new masters, rounded
    assert torch.equal(grad, grad_before)  # the gradient is read, not scaled in place


@pytest.mark.parametrize("block,num_warps", [(1024, 8), (4096, 4)])
def test_the_one_pass_variants_the_bench_sweeps_give_the_same_bits(one_pass, block, num_warps):
    """On CPU, Triton's interpreter ignores warps and compiles nothing, so what this checks is the launches: other
    block sizes, and whole blocks without a mask beside a masked rest, cover every element once with the default's
    arithmetic. That the compiles agree on a GPU is bench/device_adam.py --sweep's to show."""
    generator = torch.Generator().manual_seed(torch.randint(0, 10_000, ()).item())
    numel = 5 * ALIGN_NUMEL * int(torch.randint(14, 40, (), generator=generator))  # whole blocks and a rest
    states = [torch.randn(numel, generator=generator), torch.randn(numel, generator=generator) * 0.1,
              torch.rand(numel, generator=generator) * 0.01]
    grad = torch.randn(numel, generator=generator).to(torch.bfloat16)
    hyper = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    results = []
    variants = ({}, {"block": block, "num_warps": num_warps, "numel_known": True},
                {"block": block, "num_warps": num_warps, "even_blocks": True})
    for kwargs in variants:
        got = [state.clone() for state in states]
        params = torch.empty(numel, dtype=torch.bfloat16)
        one_pass.adam_in_one_pass(got, grad, params, grad_factor=0.7, step=3, decoupled=True, **hyper, **kwargs)
        assert not torch.equal(got[0], states[0])
        results.append((got, params))
    default, default_params = results[0]
    for swept, swept_params in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(default, swept))
        assert torch.equal(default_params, swept_params)


def test_one_pass_reads_a_gradient_held_in_the_params_before_writing_them(one_pass):
    generator = torch.Generator().manual_seed(torch.randint(0, 10_000, ()).item())
    numel = 3 * device_adam.BLOCK + 5
    states = [torch.randn(numel, generator=generator), torch.zeros(numel), torch.zeros(numel)]
    grad = torch.randn(numel, generator=generator).to(torch.bfloat16)
    expected = [state.clone() for state in states]
    torch_fused_adam([expected[0]], [grad.float()], [expected[1]], [expected[2]], decoupled=True, step=1, lr=1e-2,
                     betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    params = grad.clone()  # one micro-batch a step: the gradient is written over the params
    one_pass.adam_in_one_pass(states, params, params, grad_factor=1.0, step=1, decoupled=True, lr=1e-2,
                              betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    torch.testing.assert_close(states[0], expected[0], rtol=4 * EPS, atol=4 * EPS)
    assert torch.equal(params, states[0].to(torch.bfloat16))


def test_one_pass_refuses_tensors_of_other_lengths():
    states = [torch.zeros(8), torch.zeros(8), torch.zeros(7)]
    with pytest.raises(ValueError, match="equally long contiguous"):  # (before any Triton: it runs without it)
        device_adam.adam_in_one_pass(states, torch.zeros(8), torch.zeros(8), grad_factor=1.0, step=1, decoupled=True,
                                     lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)


def test_device_chunks_updated_in_one_pass_train_like_the_four_passes(one_pass, monkeypatch):
    seed = torch.randint(0, 10_000, ()).item()
    batches = random_batches(seed, count=4, batch=4)
    monkeypatch.setattr(groups_module, "one_pass_available", lambda device: False)
    four, four_opt = resident_engine(seed)
    monkeypatch.setattr(groups_module, "one_pass_available", lambda device: True)
    monkeypatch.setattr(groups_module, "adam_in_one_pass", one_pass.adam_in_one_pass)
    warmed = []
    monkeypatch.setattr(groups_module, "warm_one_pass", lambda *args: (warmed.append(args), one_pass.warm(*args)))
    once, once_opt = resident_engine(seed)
    assert once_opt.device_adam.one_pass
    device_chunks = [c for c, group in enumerate(once_opt.store.groups) if group.tier == DEVICE]
    assert device_chunks, "the budgets must leave some optimizer groups on the device"

    calls = []
    monkeypatch.setattr(groups_module, "adam_in_one_pass",
                        lambda *args, **kwargs: (calls.append(1), one_pass.adam_in_one_pass(*args, **kwargs)))
    four_losses, once_losses = train_steps(four, batches), train_steps(once, batches)
    assert calls, "the device chunks were not updated in one pass"
    # (compiled once, by the first plan put in force that holds groups on the device)
    assert warmed == [(torch.device("cpu"), torch.bfloat16, torch.bfloat16, True)]
    assert once_losses == pytest.approx(four_losses, rel=1e-4)
    four_opt.finish_pending(), once_opt.finish_pending()
    four_masters, once_masters = four_opt.master_state_dict(), once_opt.master_state_dict()
    # Per tensor, against how far training moved it: the kernels differ by an ulp or two, and over steps a bf16 param
    # rounded the other way moves its gradient, which the next steps carry on. Over 40 seeds the two parted by at
    # most 2e-3 of the tensor's displacement (typically 2e-5), and by up to 8e-4 of its norm in one draw (tok_emb),
    # which a bound on the norm (1e-5 before) failed 3 draws in 40; a wrong term in the update parts them by tenths.
    start = {name: param.detach().float() for name, param in six_layer_llama(seed).named_parameters()}
    assert_trained_alike(once_masters, four_masters, start, rtol=1e-2)
    for name, param in once.module.named_parameters():
        assert torch.equal(param, once_masters[name].to(param.dtype)), f"{name} does not hold its new master"


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # (the interpreter's 0 * inf)
def test_one_pass_rounds_special_values_as_torch_does(one_pass):
    master = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.3e38, -3.4e38, 1e-40, -0.0, 1.00390625,
                           1.01171875, -2.0 ** -126] * 205)  # (ties to even both ways, bf16's overflow to inf)
    states = [master.clone(), torch.zeros_like(master), torch.zeros_like(master)]
    params = torch.empty(master.numel(), dtype=torch.bfloat16)
    one_pass.adam_in_one_pass(states, torch.zeros_like(master), params, grad_factor=1.0, step=1, decoupled=True,
                              lr=0.0, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    finite = master.isfinite()
    assert torch.equal(states[0][finite], master[finite])  # (lr 0: unchanged; 0 * inf is NaN, as in torch's)
    torch.testing.assert_close(params, states[0].to(torch.bfloat16), rtol=0, atol=0, equal_nan=True)
    assert (params[4::10] == -float("inf")).all()  # (-3.4e38 is past bf16's largest: it rounds to -inf)
