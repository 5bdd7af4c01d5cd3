"""The ``deepspeed`` names a script touches, on ``angelptm``: against DeepSpeed's own where both run in one CPU
process, else against plain PyTorch. Multi-process scripts are in ``tests/multiproc/test_deepspeed_scripts.py``."""

from __future__ import annotations

import argparse
import importlib
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import angelptm
from angelptm import checkpointing, comm  # DeepSpeed's paths: deepspeed.checkpointing is an attribute, as here
from angelptm.engine import deepspeed_cpu_adam
from angelptm.errors import ConfigError
from angelptm.ops.adam import DeepSpeedCPUAdam, FusedAdam
from angelptm.pipe.partition import partition_balanced, partition_uniform
from angelptm.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from angelptm.utils.zero_to_fp32 import main as zero_to_fp32_main

deepspeed = pytest.importorskip("deepspeed")


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def config(**overrides) -> dict:
    # Clipping off: the torch loops compared against do not clip (left out, DeepSpeed's default 1.0 applies).
    base = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.1}}}
    return {**base, **overrides}


def batches(count: int, seed: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 6, generator=generator), torch.randn(2, 3, generator=generator)) for _ in range(count)]


def test_every_comm_name_is_deepspeeds() -> None:
    """No invented names: each public ``angelptm.comm`` name exists in ``deepspeed.comm`` too."""
    missing = [name for name in comm.__all__ if not hasattr(deepspeed.comm, name)]
    assert not missing


def test_add_config_arguments_parses_like_deepspeed() -> None:
    argv = ["--deepspeed", "--deepspeed_config", "ds.json", "--lr", "3"]
    parsed = []
    for module in (deepspeed, angelptm):
        parser = argparse.ArgumentParser()
        parser.add_argument("--lr", type=float)
        parsed.append(vars(module.add_config_arguments(parser).parse_args(argv)))
    assert parsed[0] == parsed[1]


def test_comm_before_any_process_group_is_a_world_of_one() -> None:
    if comm.is_initialized():
        pytest.skip("a process group exists in this test process")
    assert (comm.get_rank(), comm.get_world_size(), comm.barrier()) == (0, 1, None)
    with pytest.raises(NotImplementedError, match="torch.profiler"):
        comm.all_reduce(torch.ones(1), prof=True)


def test_accelerator_answers_like_deepspeeds_cpu_accelerator(monkeypatch) -> None:
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    ours, theirs = angelptm.accelerator.get_accelerator(), CPU_Accelerator()
    for method in ("device_name", "current_device_name", "is_available", "is_synchronized_device"):
        assert getattr(ours, method)() == getattr(theirs, method)(), method
    # Both ask this CPU (DeepSpeed's fp16 answer is None rather than False where oneDNN has no fp16 kernels).
    for method in ("is_bf16_supported", "is_fp16_supported"):
        assert getattr(ours, method)() is bool(getattr(theirs, method)()), method
    assert ours.supported_dtypes() == theirs.supported_dtypes()
    assert ours.communication_backend_name() == "gloo"  # DeepSpeed's says "ccl" when oneCCL is installed
    ours.manual_seed(5)
    first = torch.rand(3)
    theirs.manual_seed(5)
    assert torch.equal(torch.rand(3), first)
    tensor = torch.ones(2)
    assert ours.on_accelerator(tensor) and ours.pin_memory(tensor) is tensor
    with pytest.raises(NotImplementedError, match="op builders"):
        ours.create_op_builder("CPUAdamBuilder")


@pytest.mark.parametrize("cpu_has_fp16", [True, False])
def test_accelerator_asks_the_cpu_for_fp16_as_deepspeeds_does(monkeypatch, cpu_has_fp16: bool) -> None:
    """Both answers on any CPU: an AVX2 AMD EPYC's (oneDNN without fp16 kernels) and a Sapphire Rapids'."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: cpu_has_fp16)
    ours, theirs = angelptm.accelerator.Accelerator("cpu"), CPU_Accelerator()
    assert ours.is_fp16_supported() is cpu_has_fp16 is bool(theirs.is_fp16_supported())
    assert (torch.float16 in ours.supported_dtypes()) is cpu_has_fp16
    assert ours.supported_dtypes() == theirs.supported_dtypes()


def test_checkpointing_gives_plain_gradients_and_refuses_what_it_cannot_do() -> None:
    model = mlp(0)
    x = torch.randn(4, 6, requires_grad=True)
    model(x).square().sum().backward()
    expected = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad()
    x.grad = None
    checkpointing.reset()
    checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {"number_checkpoints": 2}})
    assert checkpointing.is_configured()
    checkpointing.checkpoint(model, x).square().sum().backward()
    for got, want in zip([p.grad for p in model.parameters()] + [x.grad], expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    for option in ("partition_activations", "checkpoint_in_cpu", "contiguous_checkpointing"):
        with pytest.raises(NotImplementedError):
            checkpointing.configure(None, **{option: True})
    checkpointing.reset()
    assert not checkpointing.is_configured()


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_ds_adams_are_the_torch_adam_they_name(adamw_mode: bool) -> None:
    reference_model, cpu_model, fused_model = mlp(1), mlp(1), mlp(1)
    reference = (torch.optim.AdamW if adamw_mode else torch.optim.Adam)(reference_model.parameters(), lr=0.05,
                                                                         weight_decay=0.1)
    cpu = DeepSpeedCPUAdam(cpu_model.parameters(), lr=0.05, weight_decay=0.1, adamw_mode=adamw_mode)
    fused = FusedAdam(fused_model.parameters(), lr=0.05, weight_decay=0.1, adam_w_mode=adamw_mode)
    for x, y in batches(3):
        for model, optimizer in ((reference_model, reference), (cpu_model, cpu), (fused_model, fused)):
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    for a, b, c in zip(reference_model.parameters(), cpu_model.parameters(), fused_model.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
        torch.testing.assert_close(c, a, rtol=0, atol=0)
    with pytest.raises(NotImplementedError, match="bias_correction"):
        DeepSpeedCPUAdam(mlp(1).parameters(), bias_correction=False)


def test_torch_scheduler_on_engine_optimizer_moves_the_applied_lr() -> None:
    """``LambdaLR(engine.optimizer)``, stepped by the script, against the same schedule in a torch loop."""
    lam = lambda step: [1.0, 0.1, 2.0, 0.5][min(step, 3)]  # noqa: E731
    model = mlp(2)
    engine, optimizer, _, _ = angelptm.initialize(model=model, config=config())
    assert isinstance(engine.optimizer, torch.optim.Optimizer) and optimizer is engine.optimizer
    scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lam)
    reference_model = mlp(2)
    # The engine steps the config's AdamW on a CPU with DeepSpeed's C++ Adam: so does the reference.
    reference = deepspeed_cpu_adam.DeepSpeedCpuAdam(
        reference_model.parameters(), deepspeed_cpu_adam.load_kernel(True, (0.9, 0.999)), lr=0.05, betas=(0.9, 0.999),
        eps=1e-8, weight_decay=0.1, decoupled_weight_decay=True)
    reference_scheduler = torch.optim.lr_scheduler.LambdaLR(reference, lam)
    for x, y in batches(4):
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
        scheduler.step()
        nn.functional.mse_loss(reference_model(x), y).backward()
        reference.step()
        reference.zero_grad()
        reference_scheduler.step()
    assert engine.get_lr() == reference_scheduler.get_last_lr()
    for got, want in zip(engine.module.parameters(), reference_model.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_gradient_accumulation_boundary_override() -> None:
    engine, _, _, _ = angelptm.initialize(model=mlp(3), config=config(gradient_accumulation_steps=4))
    x, y = batches(1)[0]
    before = [p.detach().clone() for p in engine.module.parameters()]
    engine.set_gradient_accumulation_boundary(True)  # the first micro-step ends the window
    assert engine.is_gradient_accumulation_boundary()
    engine.backward(nn.functional.mse_loss(engine(x), y))
    engine.step()
    assert engine.global_steps == 1 and engine.was_step_applied()
    assert any(not torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    engine.set_gradient_accumulation_boundary(False)  # the counted boundary (micro-step 4) is deferred
    for _ in range(4):
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
    assert engine.global_steps == 1
    assert engine.zero_optimization_stage() == 0


def test_no_sync_accumulates_like_summed_backwards() -> None:
    """gradient_accumulation_steps 1, two backwards (the first inside no_sync), one step: torch's summed gradients."""
    engine, _, _, _ = angelptm.initialize(model=mlp(4), config=config())
    reference_model = mlp(4)
    # The engine steps the config's AdamW on a CPU with DeepSpeed's C++ Adam: so does the reference.
    reference = deepspeed_cpu_adam.DeepSpeedCpuAdam(
        reference_model.parameters(), deepspeed_cpu_adam.load_kernel(True, (0.9, 0.999)), lr=0.05, betas=(0.9, 0.999),
        eps=1e-8, weight_decay=0.1, decoupled_weight_decay=True)
    (x1, y1), (x2, y2) = batches(2)
    with engine.no_sync():
        engine.backward(nn.functional.mse_loss(engine(x1), y1))
        with pytest.raises(RuntimeError, match="no_sync"):
            engine.step()
    engine.backward(nn.functional.mse_loss(engine(x2), y2))
    engine.step()
    for x, y in ((x1, y1), (x2, y2)):
        nn.functional.mse_loss(reference_model(x), y).backward()
    reference.step()
    for got, want in zip(engine.module.parameters(), reference_model.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4, bias=False)
        self.head = nn.Linear(4, 4, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.full((4,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(x)) * self.scale)


def test_save_16bit_model_writes_the_module_state_dict(tmp_path) -> None:
    """What DeepSpeed writes: torch.save of the module's state dict in the training dtype (tied keys included)."""
    torch.manual_seed(5)
    engine, _, _, _ = angelptm.initialize(model=Tied(), config=config(bf16={"enabled": True}))
    x = torch.randn(2, 4)
    engine.backward(engine(x.bfloat16()).float().square().mean())
    engine.step()
    assert engine.save_16bit_model(str(tmp_path), "weights.bin")
    saved, expected = torch.load(tmp_path / "weights.bin"), engine.module.state_dict()
    assert list(saved) == list(expected)
    for key, tensor in expected.items():
        assert saved[key].dtype == torch.bfloat16
        assert torch.equal(saved[key], tensor.cpu()), key


def test_zero_to_fp32_reads_our_checkpoints(tmp_path) -> None:
    engine, _, _, _ = angelptm.initialize(model=mlp(6), config=config(bf16={"enabled": True}))
    for x, y in batches(2):
        engine.backward(nn.functional.mse_loss(engine(x.bfloat16()).float(), y))
        engine.step()
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    expected = engine.consolidated_state_dict()
    state = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt")
    assert list(state) == list(expected) and all(torch.equal(state[k], expected[k]) for k in expected)
    assert all(t.dtype == torch.float32 for t in state.values())
    assert zero_to_fp32_main([str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    written = torch.load(tmp_path / "out" / "pytorch_model.bin")
    assert all(torch.equal(written[k], expected[k]) for k in expected)
    # A max_shard_size below the model: numbered shards and an index, as DeepSpeed's script writes them.
    largest = max(t.numel() * 4 for t in expected.values())
    assert zero_to_fp32_main([str(tmp_path / "ckpt"), str(tmp_path / "shards"), "--max_shard_size", f"{largest}B"]) == 0
    index = json.loads((tmp_path / "shards" / "pytorch_model.bin.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1 and set(index["weight_map"]) == set(expected)
    merged = {k: v for name in files for k, v in torch.load(tmp_path / "shards" / name).items()}
    assert all(torch.equal(merged[k], expected[k]) for k in expected)


def test_partitions_are_deepspeeds() -> None:
    from deepspeed.runtime import utils as ds_utils

    rng = random.Random(0)
    for _ in range(200):
        items, parts = rng.randint(1, 12), rng.randint(1, 5)
        weights = [rng.choice([0, 1, rng.randint(0, 1000)]) for _ in range(items)]
        assert partition_uniform(items, parts) == list(ds_utils.partition_uniform(items, parts))
        assert partition_balanced(weights, parts) == [int(p) for p in ds_utils.partition_balanced(weights, parts)]


def test_pipeline_module_refuses_what_it_cannot_honour() -> None:
    layers = [nn.Linear(2, 2), nn.Linear(2, 2)]
    for kwargs, match in (({"topology": object()}, "num_stages"), ({"loss_fn": None}, "loss_fn"),
                          ({"dynamic_shape": True}, "pad"), ({"partition_method": "profile"}, "autopipe")):
        with pytest.raises(NotImplementedError, match=match):
            angelptm.pipe.PipelineModule(layers, **{"num_stages": 1, "loss_fn": nn.MSELoss(), **kwargs})


def test_deepspeed_import_paths_resolve() -> None:
    import moe
    from angelptm.moe.layer import MoE
    from angelptm.runtime.lr_schedules import WarmupDecayLR

    assert MoE is moe.MoE and WarmupDecayLR is angelptm.engine.schedulers.WarmupDecayLR
    with pytest.raises(ValueError, match="tensor parallelism"):
        MoE(4, nn.Linear(4, 4), num_experts=2, enable_expert_tensor_parallelism=True)


@pytest.mark.parametrize("zero_cache", [False, True])
def test_adding_a_param_group_later_is_refused_not_trained_around_the_engine(zero_cache) -> None:
    """A torch Optimizer by type, but its masters (or chunks) cover the parameters given to initialize()."""
    extra = {"zero_cache": {"enabled": True, "chunk_size": 4096}} if zero_cache else {}
    model = mlp(6)
    head = nn.Linear(6, 6)
    engine, optimizer, _, _ = angelptm.initialize(model=model, config=config(**extra))
    with pytest.raises(NotImplementedError, match="initialize"):
        optimizer.add_param_group({"params": list(head.parameters())})


OUR_GROUPS = {"checkpoints", "config", "engine", "errors", "integrations", "launch", "memory", "pretraining",
              "telemetry"}
"""angelptm's own top-level modules and packages; every other one is a name ``deepspeed`` has (README: "Where
things live")."""


def test_the_top_level_is_deepspeeds_namespace_and_the_named_groups() -> None:
    root = Path(angelptm.__file__).parent
    entries = ({path.stem for path in root.glob("*.py") if path.stem != "__init__"}
               | {path.name for path in root.iterdir() if (path / "__init__.py").exists()})
    assert {entry for entry in entries if not hasattr(deepspeed, entry)} == OUR_GROUPS
    for name in ("accelerator", "checkpointing", "comm", "zero", "ops", "runtime", "utils", "pipe", "moe",
                 "initialize", "init_distributed", "add_config_arguments", "PipelineModule", "PipelineEngine"):
        assert hasattr(deepspeed, name) and hasattr(angelptm, name), name
    # deepspeed.checkpointing is deepspeed.runtime.activation_checkpointing.checkpointing; both paths work here.
    assert angelptm.checkpointing is importlib.import_module("angelptm.runtime.activation_checkpointing.checkpointing")


@pytest.mark.parametrize("seed", [0, 1234, 2**32 + 5, 2**63 + 11, -7])
def test_set_random_seed_and_initialize_seed_as_deepspeed_does(seed: int) -> None:
    """One seeding function: ``runtime.utils.set_random_seed`` is DeepSpeed's (any integer; numpy takes it mod
    2**32, torch mod 2**63), and ``initialize()`` with a config ``seed`` seeds through it."""
    from deepspeed.runtime.utils import set_random_seed as theirs

    def draws() -> tuple:
        return random.random(), float(np.random.rand()), torch.rand(3)

    theirs(seed)
    expected = draws()
    angelptm.runtime.utils.set_random_seed(seed)
    got = draws()
    angelptm.initialize(model=mlp(0), config=config(seed=seed))
    after_initialize = draws()
    for values in (got, after_initialize):
        assert values[:2] == expected[:2]
        torch.testing.assert_close(values[2], expected[2], rtol=0, atol=0)
    theirs(seed + 1)
    assert draws()[0] != expected[0]  # the draws depend on the seed


def _deepspeed_initialize_config(monkeypatch, args: argparse.Namespace) -> dict:
    """The config DeepSpeed's own ``initialize(args=args)`` reads: its code runs until it parses the config (a
    stand-in for DeepSpeedConfig stops it there, so no process group or engine is built)."""

    class Parsed(Exception):
        pass

    def stop(config: dict, *unused, **unused_kw):
        raise Parsed(config)

    monkeypatch.setattr(deepspeed.comm, "init_distributed", lambda *unused, **unused_kw: None)
    monkeypatch.setattr(deepspeed, "DeepSpeedConfig", stop)
    with pytest.raises(Parsed) as parsed:
        deepspeed.initialize(args=args, model=mlp(0))
    return parsed.value.args[0]


def test_deepscale_config_is_an_alias_of_deepspeed_config_as_in_deepspeed(tmp_path, monkeypatch) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config(train_micro_batch_size_per_gpu=3)))
    parsed = {}
    for module in (deepspeed, angelptm):
        parsed[module] = module.add_config_arguments(argparse.ArgumentParser()).parse_args(
            ["--deepscale_config", str(path)])
    theirs = _deepspeed_initialize_config(monkeypatch, parsed[deepspeed])
    engine, _, _, _ = angelptm.initialize(args=parsed[angelptm], model=mlp(0))
    assert theirs["train_micro_batch_size_per_gpu"] == engine.train_micro_batch_size_per_gpu() == 3
    # Both move the alias onto --deepspeed_config, for the script that reads it afterwards.
    assert vars(parsed[angelptm]) == vars(parsed[deepspeed])
    assert (parsed[angelptm].deepspeed_config, parsed[angelptm].deepscale_config) == (str(path), None)

    both = ["--deepscale_config", str(path), "--deepspeed_config", str(path)]
    with pytest.raises(AssertionError, match="both a deepscale_config and deepspeed_config"):
        deepspeed.initialize(args=deepspeed.add_config_arguments(argparse.ArgumentParser()).parse_args(both),
                             model=mlp(0))
    with pytest.raises(ConfigError, match="--deepscale_config .* and --deepspeed_config"):
        angelptm.initialize(args=angelptm.add_config_arguments(argparse.ArgumentParser()).parse_args(both),
                            model=mlp(0))
