"""Streamed params on one rank (CPU): param shards at home on the host, copied to the device tier on use.

The reference is the same engine with every param resident on the device and every optimizer group
on the host, so both update with the same host Adam; the streamed path sums the gradient norm per
parameter in the resident path's order. The two are bitwise equal.
"""

from __future__ import annotations

import functools
import threading

import pytest
import torch
from reference import SEQ, VOCAB, ds_config, random_batches, reference_loop, train_steps

import angelptm
from angelptm.pretraining.models import ModelConfig, build_model
from zero_cache.plan.layout import pack
from zero_cache.plan.planner import DEVICE, HOST

CHUNK_NUMEL = 8192


def tiny_gpt(seed: int, *, checkpointing: bool = True, tied: bool = True) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(ModelConfig(flavour="gpt2", vocab_size=VOCAB, max_seq_len=SEQ, num_layers=4, hidden_size=32,
                                   num_heads=4, tie_embeddings=tied, activation_checkpointing=checkpointing))


def state_bytes(model: torch.nn.Module, bytes_per_element: int) -> int:
    layout = pack([(n, tuple(p.shape)) for n, p in model.named_parameters()], CHUNK_NUMEL)
    return layout.num_chunks * layout.chunk_numel * bytes_per_element


def resident_budget(model: torch.nn.Module) -> int:
    """fp32 params and one fp32 scratch chunk, over the 3% margin: no room for an optimizer group (16 B/element)."""
    need = state_bytes(model, 4) + CHUNK_NUMEL * 4
    return int(need / 0.97) + 4 * CHUNK_NUMEL


def config(param_home: str, device_budget: int | str = "auto", *, clip: float = 1.0, accumulation: int = 1,
           **zero_cache) -> dict:
    return ds_config(gradient_clipping=clip, gradient_accumulation_steps=accumulation,
                     zero_cache={"enabled": True, "chunk_size": CHUNK_NUMEL, "param_home": param_home,
                                 "device_memory_budget": device_budget, "host_memory_budget": "1GiB", **zero_cache})


def train(model: torch.nn.Module, cfg: dict, batches: list[dict]) -> tuple[list[float], dict, object]:
    engine, optimizer, _, _ = angelptm.initialize(model=model, config=cfg)
    losses = train_steps(engine, batches)
    return losses, optimizer.master_state_dict(), optimizer


def assert_close_to(got: dict, expected: dict, start: dict, rtol: float) -> None:
    """Per tensor, ||got - expected|| <= rtol ||expected|| (rtol 0: bitwise)."""
    moved = max((expected[k] - start[k]).abs().max().item() for k in expected)
    assert moved > 1e-3, f"training moved the weights by only {moved}"
    for name in expected:
        if rtol == 0:
            assert torch.equal(got[name], expected[name]), name
        else:
            error = (got[name] - expected[name]).norm() / expected[name].norm()
            assert error <= rtol, f"{name}: relative error {error:.2e}"


def assert_trained_alike(got: dict, expected: dict, start: dict, rtol: float) -> None:
    """Per tensor, ||got - expected|| <= rtol ||expected - start||: two runs whose kernels differ by an ulp or two
    part further over steps (a bf16 param rounded the other way moves its gradient), most in the tensors training
    moves least against their size, so the bound is on how far training moved each, not on its norm."""
    for name, want in expected.items():
        moved = (want - start[name]).norm()
        assert moved > 0, f"{name} did not train"
        error = (got[name] - want).norm() / moved
        assert error <= rtol, f"{name}: {error:.2e} of its displacement"


@pytest.mark.parametrize("accumulation, clip, tied", [(1, 1.0, True), (1, 0.0, False), (3, 1.0, True)])
def test_streamed_params_give_the_weights_of_resident_params(accumulation, clip, tied):
    seed = torch.randint(0, 10_000, ()).item()
    batches = random_batches(seed, count=4 * accumulation, batch=2)
    start = {n: p.detach().clone() for n, p in tiny_gpt(seed, tied=tied).named_parameters()}
    # Accumulating, the resident run would update during the last backward and revise at a clipped step (within
    # an ulp: zero_cache.optim.revision), where streamed params, which accumulate through buckets, update after it.
    # Both after backward, the comparison stays bitwise.
    after = {"update_in_backward": False} if accumulation > 1 else {}
    resident_cfg = config("device", resident_budget(tiny_gpt(seed, tied=tied)), clip=clip, accumulation=accumulation,
                          **after)
    resident_losses, resident, reference = train(tiny_gpt(seed, tied=tied), resident_cfg, batches)
    assert {group.tier for group in reference.store.groups} == {HOST} and not reference.store.shard_params
    losses, masters, optimizer = train(tiny_gpt(seed, tied=tied), config("host", clip=clip, accumulation=accumulation),
                                       batches)
    store = optimizer.store
    assert store.shard_params and set(store.param_home) == {HOST}
    assert all(group.tier == HOST for group in store.groups)
    assert losses == resident_losses
    assert_close_to(masters, resident, start, rtol=0)


def bf16(cfg: dict) -> dict:
    cfg["bf16"] = {"enabled": True}
    return cfg


def assert_trains_like_the_reference(losses: list[float], model: torch.nn.Module, batches: list[dict]) -> None:
    """The bf16 losses follow hand-written mixed precision (fp32 masters, torch AdamW, clipping 1.0)."""
    expected, _ = reference_loop(model, batches, dtype=torch.bfloat16, accumulation=1, lr=3e-3, clip=1.0)
    assert expected[-1] < expected[0], f"the reference must learn, or agreement proves little: {expected}"
    assert losses == pytest.approx(expected, rel=1e-2)


def test_a_device_budget_below_the_weights_streams_them_and_trains():
    """0.9 times the bf16 weights (about an eighth of the model states, at 14 B/element): searched chunks small
    enough that the live slots and gradient buckets fit beside the activations."""
    seed = torch.randint(0, 10_000, ()).item()
    batches = random_batches(seed, count=8, batch=4)
    model = tiny_gpt(seed)
    budget = int(0.9 * sum(2 * p.numel() for p in model.parameters()))
    cfg = bf16(config("auto", budget))
    cfg["zero_cache"]["chunk_size"] = "auto"
    engine, optimizer, _, _ = angelptm.initialize(model=model, config=cfg)
    store = optimizer.store
    assert HOST in store.param_home, f"the budget must force params off the device, got {store.param_home}"
    losses = train_steps(engine, batches)
    assert store.tiers[DEVICE].peak_bytes <= budget
    assert_trains_like_the_reference(losses, tiny_gpt(seed), batches)


def test_the_chunk_size_search_leaves_room_for_the_cache_slots_of_a_quarter_budget():
    """The new user's case: a 0.33M-parameter model with a quarter of its states as the device budget. The
    unconstrained search packs it into two chunks, and two chunks cannot stream through one device."""
    seed = torch.randint(0, 10_000, ()).item()
    model_config = ModelConfig(flavour="gpt2", vocab_size=VOCAB, max_seq_len=SEQ, num_layers=4, hidden_size=64,
                               num_heads=4)
    torch.manual_seed(seed + 1)
    model = build_model(model_config)
    numel = sum(p.numel() for p in model.parameters())
    budget = numel * 14 // 4
    cfg = bf16(config("auto", budget))
    cfg["zero_cache"]["chunk_size"] = "auto"
    engine, optimizer, _, _ = angelptm.initialize(model=model, config=cfg)
    store = optimizer.store
    assert store.layout.num_chunks >= 4
    batches = random_batches(seed, count=6, batch=4)
    losses = train_steps(engine, batches)
    assert store.tiers[DEVICE].peak_bytes <= budget
    torch.manual_seed(seed + 1)
    assert_trains_like_the_reference(losses, build_model(model_config), batches)


def poison_one_weight(engine) -> torch.utils.hooks.RemovableHandle:
    """The attention projection of the first block gets NaN gradients until the returned handle is removed."""
    param = next(p for n, p in engine.module.named_parameters() if "attn" in n)
    return param.register_hook(lambda grad: grad * float("nan"))


def test_a_non_finite_gradient_skips_the_step_as_if_its_batch_never_came():
    """Clipping needs the global norm first, so streamed shards update after backward and a NaN skips the step:
    the masters and the shards at home stay as they were, and training goes on as without that batch."""
    seed = torch.randint(0, 10_000, ()).item()
    batches = random_batches(seed, count=4, batch=2)
    engine, optimizer, _, _ = angelptm.initialize(model=tiny_gpt(seed), config=config("host"))
    train_steps(engine, batches[:2])
    optimizer.finish_pending()
    shards, masters = [s.clone() for s in optimizer.store.shards], optimizer.master_state_dict()
    poisoned = poison_one_weight(engine)
    train_steps(engine, batches[2:3])
    poisoned.remove()
    assert engine.skipped_steps == 1
    optimizer.finish_pending()
    assert all(torch.equal(a, b) for a, b in zip(optimizer.store.shards, shards))
    kept = optimizer.master_state_dict()
    assert all(torch.equal(kept[name], value) for name, value in masters.items())
    losses = train_steps(engine, batches[3:])
    straight, straight_optimizer, _, _ = angelptm.initialize(model=tiny_gpt(seed), config=config("host"))
    expected = train_steps(straight, batches[:2] + batches[3:])
    assert losses == expected[2:]
    start = {n: p.detach().clone() for n, p in tiny_gpt(seed).named_parameters()}
    assert_close_to(optimizer.master_state_dict(), straight_optimizer.master_state_dict(), start, rtol=0)


def train_with_late_worker(seed: int, batches: list[dict], *, late: bool) -> tuple[dict, dict]:
    """Masters and counts after ``batches``. The host worker runs each step's updates made during backward as
    backward queues them (drained before ``step()``), or, ``late``, only once ``step()`` has re-sorted the ones not
    yet started into forward order: a job holds the worker until then (the slowest a loaded machine makes it)."""
    engine, optimizer, _, _ = angelptm.initialize(model=tiny_gpt(seed), config=config("host"))
    host = optimizer.host
    sort = host.in_forward_order
    for batch in batches:
        sorted_by_step = threading.Event()
        if late:
            host.submit(functools.partial(sorted_by_step.wait, timeout=60))
            host.in_forward_order = lambda: (sort(), sorted_by_step.set())
        engine.backward(engine(**batch))
        if not late:
            host.drain()
        engine.step()
    return optimizer.master_state_dict(), dict(optimizer.reports.counts)


def test_how_far_the_worker_got_when_the_step_sorts_its_queue_changes_no_bit():
    """The first step updates the host chunks during backward and clips, so some are applied (then redone) and the
    rest deferred, which agree only to an ulp. Which ones must follow from the gradients, not from how far the
    worker had got when step() re-sorted its queue: that made the NaN test above fail about 1 run in 20."""
    seed = torch.randint(0, 10_000, ()).item()
    batches = random_batches(seed, count=2, batch=2)
    kept_up, counts = train_with_late_worker(seed, batches, late=False)
    assert counts["speculated_chunks"] > 0 and counts["clipped_steps"] > 0, counts
    late, _ = train_with_late_worker(seed, batches, late=True)
    start = {n: p.detach().clone() for n, p in tiny_gpt(seed).named_parameters()}
    assert_close_to(late, kept_up, start, rtol=0)


def test_the_replan_after_the_first_step_brings_streamed_shards_home_to_the_device():
    """activation_memory holds back most of the budget for the first step, so the shards stream; the first
    step measures no activations on CPU, and the re-plan moves shards home to the device and resizes the live
    groups. The weights stay those of the resident run."""
    seed = torch.randint(0, 10_000, ()).item()
    batches = random_batches(seed, count=4, batch=2)
    budget = resident_budget(tiny_gpt(seed))
    resident_losses, resident, _ = train(tiny_gpt(seed), config("device", budget), batches)
    # Room for 9 chunks besides the activations: the fp32 scratch, 3 gradient buckets and 4 live groups, not
    # the 9 param chunks.
    cfg = config("auto", budget, activation_memory=int(0.97 * budget) - 9 * CHUNK_NUMEL * 4)
    engine, optimizer, _, _ = angelptm.initialize(model=tiny_gpt(seed), config=cfg)
    store = optimizer.store
    streamed_first = store.param_home.count(HOST)
    assert store.shard_params and streamed_first >= len(store.shards) - 1
    losses = train_steps(engine, batches[:1])
    assert store.param_home.count(HOST) < streamed_first, f"the re-plan must bring shards home: {store.param_home}"
    losses += train_steps(engine, batches[1:])
    assert store.tiers[DEVICE].peak_bytes <= budget
    assert losses == resident_losses
    start = {n: p.detach().clone() for n, p in tiny_gpt(seed).named_parameters()}
    assert_close_to(optimizer.master_state_dict(), resident, start, rtol=0)
