"""``deepspeed.zero.GatheredParameters`` on this engine: an edit inside the context reaches the engine's copies.

The reference is plain torch (fp32 AdamW over the same model): the same edit applied to its weights
(which are its masters) between the same steps. The engine must then give the same next forward, the
same masters, and keep training like the reference, whether its weights are the replicated optimizer's,
ZeRO-Cache chunks split over a device and a host tier, or streamed from homes on the host (placeholders
in the module between uses).
"""

from __future__ import annotations

import pytest
import torch
from gathered_params_job import BETAS, CHUNK_NUMEL, LR, WEIGHT_DECAY, edit, torch_step
from reference import ds_config, random_batches, tiny_gpt, train_steps

import angelptm
from zero_cache.plan.layout import pack


def chunk_bytes(model: torch.nn.Module, bytes_per_element: int) -> int:
    layout = pack([(n, tuple(p.shape)) for n, p in model.named_parameters()], CHUNK_NUMEL)
    return layout.num_chunks * layout.chunk_numel * bytes_per_element


def engine_config(kind: str, model: torch.nn.Module) -> dict:
    config = ds_config(bf16={"enabled": False})
    if kind == "replicated":
        return config
    states = chunk_bytes(model, 4 + 12 + 4)
    zero_cache = {"enabled": True, "chunk_size": CHUNK_NUMEL, "host_memory_budget": "1GiB",
                  "device_memory_budget": states // 3, "param_home": "device"}
    if kind == "streamed":  # param shards at home on the host: the module holds placeholders between uses
        zero_cache.update(param_home="host", device_memory_budget="auto")
    config["zero_cache"] = zero_cache
    return config


@pytest.mark.parametrize("kind", ["replicated", "zero_cache", "streamed"])
def test_an_edit_with_modifier_rank_reaches_the_next_forward_the_masters_and_training(kind):
    seed = torch.randint(0, 10_000, ()).item()
    batches = random_batches(seed, count=4, batch=4)
    engine, optimizer, _, _ = angelptm.initialize(model=tiny_gpt(seed, "llama"),
                                                  config=engine_config(kind, tiny_gpt(seed, "llama")))
    reference = tiny_gpt(seed, "llama")
    torch_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    assert train_steps(engine, batches[:2]) == pytest.approx([torch_step(reference, torch_optimizer, b)
                                                              for b in batches[:2]], rel=1e-5)
    params = dict(engine.module.named_parameters())
    with angelptm.zero.GatheredParameters(list(params.values()), modifier_rank=0):
        for name, param in params.items():  # whole, current weights inside, even where the module held placeholders
            assert param.shape == dict(reference.named_parameters())[name].shape
            torch.testing.assert_close(param.detach(), dict(reference.named_parameters())[name].detach(),
                                       rtol=1e-5, atol=1e-6)
        with torch.no_grad():
            edit({name: p.data for name, p in params.items()}, seed)
    with torch.no_grad():
        edit({name: p.data for name, p in reference.named_parameters()}, seed)
    masters = optimizer.master_state_dict()
    for name, expected in reference.named_parameters():
        torch.testing.assert_close(masters[name], expected.detach(), rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        assert engine(**batches[2]).item() == pytest.approx(reference(**batches[2]).item(), rel=1e-5)
    # Training continues from the edited weights (DeepSpeed's fp32 partitions would write over the edit here).
    assert train_steps(engine, batches[2:]) == pytest.approx([torch_step(reference, torch_optimizer, b)
                                                              for b in batches[2:]], rel=1e-5)


@pytest.mark.parametrize("kind", ["replicated", "zero_cache"])
def test_without_modifier_rank_edits_are_dropped(kind):
    seed = torch.randint(0, 10_000, ()).item()
    batch = random_batches(seed, count=1, batch=4)[0]
    engine, optimizer, _, _ = angelptm.initialize(model=tiny_gpt(seed, "llama"),
                                                  config=engine_config(kind, tiny_gpt(seed, "llama")))
    before = optimizer.master_state_dict()
    with torch.no_grad():
        loss_before = engine(**batch).item()
    params = dict(engine.module.named_parameters())
    with angelptm.zero.GatheredParameters(params.values()):
        with torch.no_grad():
            edit({name: p.data for name, p in params.items()}, seed)
    after = optimizer.master_state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)
    with torch.no_grad():
        assert engine(**batch).item() == loss_before


def test_a_bf16_edit_keeps_the_full_precision_masters_of_the_elements_left_alone():
    """Editing one row of a bf16 weight must not round the fp32 masters of the other rows."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, optimizer, _, _ = angelptm.initialize(model=model, config=config)
    engine.backward(engine(torch.randn(2, 16, dtype=torch.bfloat16)).float().square().mean())
    engine.step()  # masters now hold bits that bf16 cannot
    masters = optimizer.master_state_dict()["0.weight"]
    assert not torch.equal(masters, masters.bfloat16().float())
    weight = engine.module[0].weight
    with angelptm.zero.GatheredParameters(weight, modifier_rank=0):
        assert weight.dtype == torch.bfloat16
        with torch.no_grad():
            weight[2] = 0.25
    expected = masters.clone()
    expected[2] = 0.25
    assert torch.equal(optimizer.master_state_dict()["0.weight"], expected)
    assert torch.equal(engine.module[0].weight.detach(), expected.bfloat16())


def test_before_initialize_the_context_leaves_whole_weights_as_they_are():
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4)
    with angelptm.zero.GatheredParameters([layer.weight, None, layer.bias], modifier_rank=0):
        with torch.no_grad():
            layer.weight.fill_(0.5)
    assert torch.equal(layer.weight.detach(), torch.full((4, 4), 0.5))
    with pytest.raises(TypeError, match="expected parameters"):
        angelptm.zero.GatheredParameters(["weight"])



def test_between_backward_and_step_under_zero_cache_the_context_is_refused():
    """ZeRO-Cache keeps the window's gradients where the weights would be rewritten, and host chunks may already
    be updating from them: neither the weights before the step nor after it exist whole there."""
    seed = torch.randint(0, 10_000, ()).item()
    batch = random_batches(seed, count=1, batch=4)[0]
    engine, optimizer, _, _ = angelptm.initialize(model=tiny_gpt(seed, "llama"),
                                                  config=engine_config("zero_cache", tiny_gpt(seed, "llama")))
    engine.backward(engine(**batch))
    weight = engine.module.tok_emb.weight
    for modifier in (None, 0):
        with pytest.raises(ValueError, match=r"between backward\(\) and step\(\)"):
            with angelptm.zero.GatheredParameters(weight, modifier_rank=modifier):
                pass
    engine.step()
    with angelptm.zero.GatheredParameters(weight, modifier_rank=0):
        torch.testing.assert_close(weight.detach(), optimizer.master_state_dict()["tok_emb.weight"])
