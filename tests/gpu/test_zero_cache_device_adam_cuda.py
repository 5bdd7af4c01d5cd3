"""The device's Adam in one pass compiled for the GPU (``zero_cache.optim.device_adam``): torch's fused Adam to a few
ulps on fresh random inputs the size of a chunk, and the params its rounded masters. Training through it is checked
against hand-written mixed precision by the other GPU tests (their device chunks take it). And a whole-GPU run times
it and checks its step against a prediction that counts it."""

from __future__ import annotations

import logging

import pytest
import torch
from reference import SEQ, VOCAB, ds_config, random_batches, train_steps

import angelptm
from angelptm.pretraining.models import ModelConfig, build_model
from zero_cache.optim.device_adam import adam_in_one_pass, one_pass_available
from zero_cache.optim.host_adam import torch_fused_adam
from zero_cache.plan.planner import DEVICE

pytestmark = pytest.mark.gpu
EPS = torch.finfo(torch.float32).eps


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("grad_dtype, param_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                                     (torch.float16, torch.float16)])
def test_one_pass_on_cuda_is_torch_fused_adam_to_a_few_ulps(decoupled, grad_dtype, param_dtype):
    device = torch.device("cuda")
    assert one_pass_available(device), "Triton does not run here: the device chunks take the four passes"
    generator = torch.Generator(device).manual_seed(torch.randint(0, 10_000, ()).item())
    numel = 25_000_003  # (a last block cut short)
    master = torch.randn(numel, device=device, generator=generator)
    exp_avg = torch.randn(numel, device=device, generator=generator) * 0.1
    exp_avg_sq = torch.rand(numel, device=device, generator=generator) * 0.01
    grad = (torch.randn(numel, device=device, generator=generator) * 3).to(grad_dtype)
    hyper = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    before = [master.clone(), exp_avg.clone(), exp_avg_sq.clone()]
    expected = [state.clone() for state in before]
    torch_fused_adam([expected[0]], [grad.float() * 0.37], [expected[1]], [expected[2]], decoupled=decoupled, step=7,
                     **hyper)
    params = torch.full((numel,), float("nan"), dtype=param_dtype, device=device)
    states = [master, exp_avg, exp_avg_sq]
    adam_in_one_pass(states, grad, params, grad_factor=0.37, step=7, decoupled=decoupled, **hyper)
    for name, got, want, old in zip(("master", "exp_avg", "exp_avg_sq"), states, expected, before):
        assert (want != old).float().mean() > 0.99, name
        torch.testing.assert_close(got, want, rtol=4 * EPS, atol=4 * EPS * old.abs().mean().item(), msg=name)
    assert torch.equal(params, master.to(param_dtype))


def test_a_whole_gpu_run_times_its_adam_and_checks_its_step_against_the_prediction(caplog):
    """Every group on the GPU: no host traffic (the floor is 0 s) and no device steps to tune. The device's Adam is
    timed on the compute stream, and after the warm-up, three steps (six where the update timing changes) and the five
    steps the check is taken over, the engine logs the step against a prediction that counts it."""
    caplog.set_level(logging.INFO, logger="zero_cache")
    seed = torch.randint(0, 10_000, ()).item()
    torch.manual_seed(seed)
    model = build_model(ModelConfig(flavour="llama", vocab_size=VOCAB, max_seq_len=SEQ, num_layers=6, hidden_size=320,
                                    num_heads=4))
    config = ds_config(bf16={"enabled": True}, gradient_clipping=1.0,
                       zero_cache={"enabled": True, "chunk_size": 2**20})
    engine, optimizer, _, _ = angelptm.initialize(model=model, config=config)
    train_steps(engine, random_batches(seed, count=14, batch=4))  # (a check that starts over: 7, then its 5 steps)
    assert all(group.tier == DEVICE for group in optimizer.store.groups), "the whole GPU holds every group"
    assert optimizer.plan.traffic.seconds == 0 and optimizer.plan.traffic.device_adam_elements > 0
    line = next(r.getMessage() for r in caplog.records if "the step runs at" in r.getMessage())
    assert "device Adam" in line.split("after backward:")[1] and "device Adam" in line.split("; at ")[1]
