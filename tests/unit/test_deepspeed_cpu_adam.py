"""The config's Adam on a CPU steps through DeepSpeed's C++ Adam: DeepSpeed's FusedAdam's weights, bit for bit, also
after a resume; torch Adam's state layout; ``torch_adam`` and ZeRO-Cache keep torch's Adam."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import angelptm
from angelptm.engine import deepspeed_cpu_adam
from angelptm.integrations import deepspeed_alias

pytest.importorskip("deepspeed")

SHAPES = ((1000,), (37, 3), (5,))  # (sizes that leave a tail past the SIMD width, which the op steps one by one)
LR, BETAS, EPS = 1e-3, (0.8, 0.999), 1e-8


def params(seed: int) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator) * 0.05) for shape in SHAPES]


def run(optimizer: torch.optim.Optimizer, steps: range, seed: int = 1) -> None:
    """Steps with seeded gradients (step k's are the same in every run) and a warm-up lr, as WarmupLR's."""
    for step in steps:
        generator = torch.Generator().manual_seed(seed * 1000 + step)
        for group in optimizer.param_groups:
            group["lr"] = LR * math.log(step + 2) / math.log(1000)
            for param in group["params"]:
                param.grad = torch.randn(param.shape, generator=generator) * 10.0 ** -(step % 4)


def stepped(optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        run(optimizer, range(step, step + 1))
        optimizer.step()


def ours(weights: list[torch.nn.Parameter], decoupled: bool, weight_decay: float) -> torch.optim.Optimizer:
    kernel = deepspeed_cpu_adam.load_kernel(decoupled, BETAS)
    assert kernel is not None, "DeepSpeed's cpu_adam op must build here (DeepSpeed's own FusedAdam needs the same)"
    return deepspeed_cpu_adam.DeepSpeedCpuAdam(weights, kernel, lr=LR, betas=BETAS, eps=EPS, weight_decay=weight_decay,
                                               decoupled_weight_decay=decoupled)


@pytest.mark.parametrize("decoupled, weight_decay", [(True, 3e-7), (True, 0.1), (False, 0.01)])
def test_weights_are_deepspeeds_fused_adams_bit_for_bit(decoupled, weight_decay):
    with deepspeed_alias.suspended():
        from deepspeed.ops.adam import FusedAdam
    theirs_weights, ours_weights, torch_weights = params(0), params(0), params(0)
    theirs = FusedAdam(theirs_weights, lr=LR, betas=BETAS, eps=EPS, weight_decay=weight_decay, adam_w_mode=decoupled)
    stepped(theirs, range(12))
    stepped(ours(ours_weights, decoupled, weight_decay), range(12))
    for a, b in zip(ours_weights, theirs_weights):
        assert torch.equal(a, b)
    plain = (torch.optim.AdamW if decoupled else torch.optim.Adam)(torch_weights, lr=LR, betas=BETAS, eps=EPS,
                                                                   weight_decay=weight_decay)
    stepped(plain, range(12))
    assert any(not torch.equal(a, b) for a, b in zip(torch_weights, theirs_weights)), \
        "torch's Adam rounds differently, or this test would prove nothing"


def test_a_resumed_optimizer_continues_bit_for_bit_in_torch_adams_state_layout():
    straight_weights, weights = params(0), params(0)
    stepped(ours(straight_weights, True, 0.01), range(9))
    first = ours(weights, True, 0.01)
    stepped(first, range(5))
    # (a deep copy, as a checkpoint file is: state_dict() hands out the live moments, which the steps update in place)
    state, weights_at_5 = copy.deepcopy(first.state_dict()), [w.detach().clone() for w in weights]
    reference = torch.optim.AdamW(params(0), lr=LR)
    stepped(reference, range(1))
    assert state["state"][0].keys() == reference.state_dict()["state"][0].keys()
    assert state["state"][0]["step"].dtype == reference.state_dict()["state"][0]["step"].dtype
    resumed = ours(weights, True, 0.01)
    # A fresh C++ optimizer first seen at step 6 (it replays beta^t up to there), then the same one sent back to an
    # earlier checkpoint (it starts its powers over): both continue as the uninterrupted run.
    for _ in range(2):
        resumed.load_state_dict(copy.deepcopy(state))
        with torch.no_grad():
            for weight, saved in zip(weights, weights_at_5):
                weight.copy_(saved)
        stepped(resumed, range(5, 9))
        for a, b in zip(weights, straight_weights):
            assert torch.equal(a, b)


def inner_optimizer(config: dict) -> torch.optim.Optimizer:
    model = torch.nn.Linear(4, 2)
    engine, *_ = angelptm.initialize(model=model, model_parameters=model.parameters(),
                                     config={"train_micro_batch_size_per_gpu": 1, **config})
    return engine.optimizer.optimizer


def test_the_configs_adam_takes_the_kernel_unless_torch_adam_is_asked_for():
    adam = {"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.01}}
    optimizer = inner_optimizer({"optimizer": adam})
    assert isinstance(optimizer, deepspeed_cpu_adam.DeepSpeedCpuAdam) and optimizer.kernel is not None
    assert optimizer.defaults["decoupled_weight_decay"], "DeepSpeed's \"Adam\" is AdamW unless adam_w_mode is false"
    with_l2 = inner_optimizer({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}})
    assert not with_l2.defaults["decoupled_weight_decay"] and not with_l2.kernel.decoupled
    torch_adam = inner_optimizer({"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}})
    assert type(torch_adam) is torch.optim.AdamW
