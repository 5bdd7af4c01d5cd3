"""Building a model whose params will live on the host: zero.Init, initialize()'s placement, offload_param."""

from __future__ import annotations

import pytest
import torch
from reference import SEQ, VOCAB, ds_config, random_batches, train_steps

import angelptm
from angelptm.engine.builders import place_module
from angelptm.pretraining.models import ModelConfig, build_model
from zero_cache.plan.planner import DEVICE, HOST

CHUNK_NUMEL = 8192


def gpt_config() -> ModelConfig:
    return ModelConfig(flavour="gpt2", vocab_size=VOCAB, max_seq_len=SEQ, num_layers=4, hidden_size=32, num_heads=4,
                       tie_embeddings=True, activation_checkpointing=True)


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def offload_config(device_budget: int | str, offload: str | None) -> dict:
    zero = {"stage": 3, **({"offload_param": {"device": offload, "pin_memory": True}} if offload else {})}
    return ds_config(bf16={"enabled": True}, gradient_clipping=1.0, zero_optimization=zero,
                     zero_cache={"enabled": True, "chunk_size": CHUNK_NUMEL, "device_memory_budget": device_budget,
                                 "host_memory_budget": "1GiB"})


@pytest.fixture
def a_gpu_is_there(monkeypatch):
    """zero.Init's choice as on a GPU machine (nothing is built on the GPU in these tests)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


@pytest.mark.parametrize("how, on_host", [({}, False), ({"remote_device": "cpu"}, True),
                                          ({"remote_device": "nvme"}, True), ({"offload": "cpu"}, True)])
def test_zero_init_builds_on_the_host_when_the_params_will_live_there(a_gpu_is_there, how, on_host):
    config = offload_config("auto", how.get("offload"))
    init = angelptm.zero.Init(config_dict_or_path=config, remote_device=how.get("remote_device"))
    assert init.device.type == ("cpu" if on_host else "cuda") and init.dtype == torch.bfloat16


def test_zero_init_names_an_unknown_remote_device():
    with pytest.raises(angelptm.ConfigError, match=r"remote_device='gpu'.*'cpu', 'nvme'"):
        angelptm.zero.Init(remote_device="gpu")


def test_initialize_leaves_trainable_params_where_they_were_built():
    """ZeRO-Cache's placement: trainable params cast where they are (their chunk copy comes later), frozen ones and
    buffers to the device; tied weights stay one Parameter. ("meta" stands for the GPU here.)"""
    torch.manual_seed(0)
    model = build_model(gpt_config())
    model.lm_head_bias = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
    model.register_buffer("steps_seen", torch.zeros(2))
    place_module(model, torch.device("meta"), torch.bfloat16, keep_trainable=True)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(p.device.type == "cpu" and p.dtype == torch.bfloat16 for p in trainable)
    assert model.lm_head_bias.is_meta and model.steps_seen.is_meta
    assert model.tok_emb.weight is model.lm_head.weight


def test_a_model_on_the_meta_device_is_refused_with_the_way_out():
    with torch.device("meta"):
        model = build_model(gpt_config())
    with pytest.raises(angelptm.ConfigError, match="meta device.*zero.Init"):
        angelptm.initialize(model=model, config=offload_config("auto", None))


def test_built_under_zero_init_with_a_budget_below_the_weights_the_device_tier_never_holds_them():
    seed = torch.randint(0, 10_000, ()).item()
    torch.manual_seed(seed)
    budget = int(0.9 * weight_bytes(build_model(gpt_config()).bfloat16()))
    config = offload_config(budget, "cpu")
    config["zero_cache"]["chunk_size"] = "auto"  # small enough for the live groups and buckets to fit
    with angelptm.zero.Init(config_dict_or_path=config):
        torch.manual_seed(seed)
        model = build_model(gpt_config())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    engine, optimizer, _, _ = angelptm.initialize(model=model, config=config)
    store = optimizer.store
    assert HOST in store.param_home  # the weights do not fit: some of them stream (the plan keeps the rest there)
    # One batch four times: its loss falls whatever the seed (four fresh random batches did not, now and then).
    losses = train_steps(engine, random_batches(seed, count=1, batch=2) * 4)
    shard_bytes = sum(shard.numel() * shard.element_size() for shard in store.shards)
    assert store.tiers[DEVICE].peak_bytes <= budget < shard_bytes
    assert losses[-1] < losses[0]


def test_offload_param_permits_host_homes_and_param_home_host_forces_them(caplog):
    """DeepSpeed's offload_param is a permission: with room on the device the plan keeps the params there (and
    says how to force them off); zero_cache.param_home "host" is the placement. Same losses either way."""
    seed = torch.randint(0, 10_000, ()).item()
    batches = random_batches(seed, count=3, batch=2)
    results = {}
    for name, offload, home in (("none", None, "auto"), ("permitted", "cpu", "auto"), ("forced", "cpu", "host")):
        config = offload_config("1GiB", offload)
        config["zero_cache"]["param_home"] = home
        torch.manual_seed(seed)
        with caplog.at_level("INFO", logger="angelptm.config.loader"):
            engine, optimizer, _, _ = angelptm.initialize(model=build_model(gpt_config()), config=config)
        results[name] = (optimizer.store, train_steps(engine, batches))
    weights = sum(chunk.numel() * chunk.element_size() for chunk in results["none"][0].param_chunks)
    for name in ("none", "permitted"):
        resident = results[name][0]
        assert not resident.shard_params and resident.tiers[DEVICE].used_bytes >= weights
    assert "offload_param.device is cpu: params may live in host memory" in caplog.text
    assert 'zero_cache.param_home to "host"' in caplog.text
    streamed = results["forced"][0]
    assert streamed.tiers[DEVICE].used_bytes < weights <= streamed.tiers[HOST].used_bytes
    assert streamed.shard_params and set(streamed.param_home) == {HOST}
    assert all(shard.is_pinned() or not torch.cuda.is_available() for shard in streamed.shards)
    assert results["permitted"][1] == pytest.approx(results["none"][1], rel=1e-2)
    assert results["forced"][1] == pytest.approx(results["none"][1], rel=1e-2)
