"""What a script does to ``.grad`` between backward calls has DeepSpeed's effect on ``engine.step()`` (issue 28).

Every scenario of ``tests/helpers/grad_clear_job.py`` (the issue's example, whose config leaves DeepSpeed's default
clipping of 1.0 in force, zero_grad on the module or on the client optimizer, to None or to zeros, a backward
outside the engine kept or cleared, DeepSpeedExamples' DCGAN loop) runs under real DeepSpeed 0.19 in a subprocess
and under angelptm here; the weights must agree.
The fp32 runs' configs name no precision: fp32 in DeepSpeed, and here even on a CPU with bf16 units.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from grad_clear_job import run_all  # tests/helpers
from launch import free_port  # tests/helpers

import angelptm

pytest.importorskip("deepspeed")

JOB = Path(__file__).resolve().parents[1] / "helpers" / "grad_clear_job.py"



@pytest.fixture(scope="module")
def seed() -> int:
    return int(torch.randint(0, 10_000, ()).item())


@pytest.fixture(scope="module")
def deepspeeds(seed) -> dict[str, list[float]]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu", "MASTER_PORT": str(free_port())}
    done = subprocess.run([sys.executable, str(JOB), "--backend", "deepspeed", "--seed", str(seed)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])  # DeepSpeed prints its accelerator warning first


@pytest.fixture(scope="module")
def ours(seed) -> dict[str, list[float]]:
    # As on a CPU with bf16 units, where a config without a precision section once computed in bf16 here.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ANGELPTM_CPU_BF16", "1")
        return run_all(angelptm, seed)


def test_every_scenario_trains_the_weights_deepspeed_trains(deepspeeds, ours):
    assert ours.keys() == deepspeeds.keys()
    for name, theirs in deepspeeds.items():
        # bf16: the weights are bf16 numbers; an outside gradient is summed with the engine's in bf16 by DeepSpeed
        # (in .grad) and in fp32 here, which may round the last bit differently.
        tolerance = dict(rtol=1e-5, atol=1e-6) if name.startswith("fp32/") else dict(rtol=2 ** -7, atol=2 ** -7)
        torch.testing.assert_close(torch.tensor(ours[name]), torch.tensor(theirs), **tolerance, msg=name)


def test_the_cleared_gradient_is_what_made_the_difference(deepspeeds):
    """The scenarios are not vacuous: keeping the outside backward moves the weights far from clearing it."""
    kept, cleared = torch.tensor(deepspeeds["fp32/outside_kept"]), torch.tensor(deepspeeds["fp32/module_zero_grad"])
    assert (kept - cleared).abs().max() > 1.0
    # The numbers: DeepSpeed 0.19 [-0.0485, 0.2235, -0.4562, -0.4127], angelptm before [-10.10, ...].
    assert deepspeeds["fp32/issue_example"] == pytest.approx([-0.0485, 0.2235, -0.4562, -0.4127], abs=1e-4)


def test_a_config_without_gradient_clipping_clips_at_deepspeeds_default(deepspeeds, ours):
    """DeepSpeed 0.19 clips at 1.0 when a config leaves gradient_clipping out (GRADIENT_CLIPPING_DEFAULT), and so
    does angelptm; a written 0 turns clipping off in both. Both cases clip (gradient norms >= 2)."""
    for name in ("issue_example", "random_inputs"):
        default, off = f"fp32/{name}", f"fp32/{name}_unclipped"
        assert (torch.tensor(deepspeeds[default]) - torch.tensor(deepspeeds[off])).abs().max() > 1e-2, name
        for key in (default, off):
            torch.testing.assert_close(torch.tensor(ours[key]), torch.tensor(deepspeeds[key]), rtol=1e-5, atol=1e-6,
                                       msg=key)


def test_fp32_grad_is_readable_between_backward_and_step():
    """As under DeepSpeed's stage 0, ``.grad`` holds the accumulated gradient until ``step()``."""
    torch.manual_seed(1)
    net = torch.nn.Linear(3, 2)
    engine, _, _, _ = angelptm.initialize(model=net, model_parameters=net.parameters(), optimizer=torch.optim.SGD(
        net.parameters(), lr=0.1), config={"train_batch_size": 1, "bf16": {"enabled": False}})
    x = torch.randn(1, 3)
    engine.backward(engine(x).square().sum())
    expected = torch.func.grad(lambda w: torch.nn.functional.linear(x, w, net.bias).square().sum())(net.weight.detach())
    torch.testing.assert_close(net.weight.grad, expected)


def test_zero_cache_leaves_an_outside_gradient_to_the_script():
    """ZeRO-Cache writes gradients over the parameters: one from a backward outside the engine must not get there
    (before the fix it overwrote the weights), and one left after the engine's backward is refused at the step."""
    def build():
        torch.manual_seed(0)
        net = torch.nn.Linear(4, 1)
        engine, _, _, _ = angelptm.initialize(model=net, config={
            "train_batch_size": 1, "bf16": {"enabled": False}, "zero_cache": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}})
        return net, engine

    x = torch.randn(1, 4)
    net, engine = build()
    (net(x).sum() * 100).backward()
    net.zero_grad()
    engine.backward(engine(x).sum())
    engine.step()
    engine.optimizer.finish_pending()
    reference, plain = build()
    plain.backward(plain(x).sum())
    plain.step()
    plain.optimizer.finish_pending()
    torch.testing.assert_close(net.weight.detach(), reference.weight.detach())

    engine.backward(engine(x).sum())
    (net(x).sum() * 100).backward()
    with pytest.raises(RuntimeError, match="outside engine.backward"):
        engine.step()
