"""Host-held optimizer groups stepped on the device after backward (zero_cache.device_steps), on CPU.

The reference is the same engine with every host group updated by the host worker after backward
(``device_steps: 0``, ``update_in_backward: false``): on CPU both paths then run torch's fused AdamW on
the same fp32 gradients, and agree to its vectorisation's rounding (a few 1e-8 relative; stepped
chunks go through the device's update scratch in pieces of chunk_numel / 15 elements, so parameters
straddle pieces and the kernel's vector tails fall elsewhere).
"""

from __future__ import annotations

import pytest
import torch
from reference import SEQ, VOCAB, random_batches, train_steps
from test_zero_cache_streamed import CHUNK_NUMEL, assert_close_to, config, poison_one_weight, state_bytes

import angelptm
from angelptm.pretraining.models import ModelConfig, build_model
from zero_cache.config import ZeroCacheConfig
from zero_cache.optim.device_steps import DeviceSteps
from zero_cache.plan.planner import HOST
from zero_cache.plan.step_cost import NOMINAL_RATES, HostChunk, StepTraffic, cheapest_device_steps, with_device_steps
from zero_cache.runtime.jobs import JobQueue


def tiny_llama(seed: int, *, tied: bool = True) -> torch.nn.Module:
    """Without biases: a GPT-2 key bias gets pure rounding noise for a gradient, which Adam turns into steps of
    random sign, so two kernels that round apart by an ulp part there by 1e-4 within a few steps."""
    torch.manual_seed(seed)
    return build_model(ModelConfig(flavour="llama", vocab_size=VOCAB, max_seq_len=SEQ, num_layers=4, hidden_size=32,
                                   num_heads=4, tie_embeddings=tied, activation_checkpointing=True))


def resident_budget(model: torch.nn.Module) -> int:
    """fp32 params and one fp32 scratch chunk, over the 3% margin: no room for an optimizer group."""
    return int((state_bytes(model, 4) + CHUNK_NUMEL * 4) / 0.97) + 4 * CHUNK_NUMEL


def counting_device_steps(monkeypatch) -> list[int]:
    """Record every chunk stepped on the device (by any engine built after this call)."""
    stepped: list[int] = []
    original = DeviceSteps.step

    def step(self, chunk, *args, **kwargs):
        stepped.append(chunk)
        return original(self, chunk, *args, **kwargs)

    monkeypatch.setattr(DeviceSteps, "step", step)
    return stepped


def train(cfg: dict, seed: int, batches: list[dict], **model) -> tuple[list[float], dict, object]:
    engine, optimizer, _, _ = angelptm.initialize(model=tiny_llama(seed, **model), config=cfg)
    losses = train_steps(engine, batches)
    optimizer.finish_pending()
    return losses, optimizer.master_state_dict(), optimizer


@pytest.mark.parametrize("param_home, accumulation, clip, tied", [
    ("host", 1, 1.0, True),  # streamed: gradients from the shard's home, params back to it
    ("host", 3, 1.0, True),  # streamed, fp32 accumulators on the host
    ("device", 1, 0.0, False),  # resident params: gradients read and params written on the device
    ("device", 2, 1.0, True),
])
def test_stepping_host_groups_on_the_device_gives_the_host_updates_weights(monkeypatch, param_home, accumulation,
                                                                         clip, tied):
    seed = torch.randint(0, 10_000, ()).item()
    batches = random_batches(seed, count=4 * accumulation, batch=2)
    start = {n: p.detach().clone() for n, p in tiny_llama(seed, tied=tied).named_parameters()}
    budget = resident_budget(tiny_llama(seed, tied=tied)) if param_home == "device" else "auto"

    def run(device_steps: int, **after_backward):
        cfg = config(param_home, budget, clip=clip, accumulation=accumulation, device_steps=device_steps,
                     **after_backward)
        return train(cfg, seed, batches, tied=tied)

    host_losses, host_masters, host_optimizer = run(0, update_in_backward=False)
    stepped = counting_device_steps(monkeypatch)
    losses, masters, optimizer = run(2)
    store = optimizer.store
    assert all(group.tier == HOST for group in store.groups)
    assert len(optimizer.device_stepped) == 2 and not host_optimizer.device_stepped
    assert stepped == sorted(optimizer.device_stepped) * 4, "each step must update both planned chunks on the device"
    assert not any(store.groups[c].kept is not None for c in optimizer.device_stepped), "they need no kept gradient"
    assert losses == pytest.approx(host_losses, rel=1e-6)
    assert_close_to(masters, host_masters, start, rtol=1e-6)


def test_every_host_group_stepped_on_the_device_leaves_the_host_worker_idle(monkeypatch):
    seed = torch.randint(0, 10_000, ()).item()
    batches = random_batches(seed, count=3, batch=2)
    stepped = counting_device_steps(monkeypatch)
    _, _, optimizer = train(config("host", device_steps=1000), seed, batches)
    chunks = optimizer.store.layout.num_chunks
    assert sorted(optimizer.device_stepped) == list(range(chunks))
    assert sorted(stepped) == sorted(list(range(chunks)) * 3)
    assert optimizer.reports.counts["speculated_chunks"] == 0, "a chunk stepped on the device is not updated then"
    # Each step's device steps are timed when the next step begins (on CPU by the host's clock): the re-plan drops
    # the warm-up's, the second step's are timed by the third, the third's by none yet.
    elements, seconds = optimizer.device_steps.timing.work.take()
    assert elements == chunks * optimizer.store.layout.chunk_numel and seconds > 0


def test_a_non_finite_gradient_skips_a_device_step_and_leaves_its_states(monkeypatch):
    seed = torch.randint(0, 10_000, ()).item()
    batches = random_batches(seed, count=4, batch=2)
    cfg = config("host", device_steps=1000)
    engine, optimizer, _, _ = angelptm.initialize(model=tiny_llama(seed), config=cfg)
    train_steps(engine, batches[:2])
    optimizer.finish_pending()
    shards = [s.clone() for s in optimizer.store.shards]
    states = [group.states.clone() for group in optimizer.store.groups]
    poisoned = poison_one_weight(engine)
    train_steps(engine, batches[2:3])
    poisoned.remove()
    assert engine.skipped_steps == 1
    optimizer.finish_pending()
    assert all(torch.equal(a, b) for a, b in zip(optimizer.store.shards, shards)), "the homes were restored"
    assert all(torch.equal(group.states, kept) for group, kept in zip(optimizer.store.groups, states))
    losses = train_steps(engine, batches[3:])
    straight, _, _, _ = angelptm.initialize(model=tiny_llama(seed), config=cfg)
    assert losses == train_steps(straight, batches[:2] + batches[3:])[2:]


# ---------------------------------------------------------------------------------------------- the choice
N = 150_000_000  # elements per chunk, about a 4.4B model's


def test_a_device_step_moves_its_states_both_ways_and_spares_the_host_one_chunk():
    base = StepTraffic(h2d_bytes=10 * 2**30, d2h_bytes=5 * 2**30, host_adam_elements=20 * N)
    streamed, resident = HostChunk(True, False), HostChunk(False, False)
    accumulating = HostChunk(True, True)
    after = with_device_steps(base, [streamed, resident, accumulating], chunk_numel=N, param_bytes_per_element=2)
    # streamed: 12 + 2 (gradient from home) in, 12 + 2 (params home) out; resident: the host path's 2 + 2 saved;
    # accumulating and streamed: 12 + 4 (fp32 accumulator) in, 12 + 2 out
    assert after.h2d_bytes - base.h2d_bytes == (14 + 10 + 16) * N
    assert after.d2h_bytes - base.d2h_bytes == (14 + 10 + 14) * N
    assert base.host_adam_elements - after.host_adam_elements == 3 * N
    assert after.device_stepped == 3


def test_the_count_balances_host_adam_against_pcie():
    host_chunks = [HostChunk(True, False)] * 24
    base = StepTraffic(h2d_bytes=int(13.5 * 2**30), d2h_bytes=7 * 2**30, host_adam_elements=24 * N)
    count = cheapest_device_steps(base, host_chunks, chunk_numel=N, param_bytes_per_element=2)
    floors = [with_device_steps(base, host_chunks[:k], chunk_numel=N, param_bytes_per_element=2).seconds
              for k in range(25)]
    assert 0 < count < 24 and floors[count] == min(floors)
    assert floors[count] < 0.75 * floors[0], "the host's Adam bound the step; moving chunks off it must pay"
    # PCIe already the bound: none
    busy = StepTraffic(h2d_bytes=2 * 24 * N * 14, d2h_bytes=0, host_adam_elements=24 * N)
    assert busy.h2d_bytes / NOMINAL_RATES.h2d_bytes_per_s > busy.seconds - 1e-9
    assert cheapest_device_steps(busy, host_chunks, chunk_numel=N, param_bytes_per_element=2) == 0
    # a configured count is taken as it is, within the candidates
    assert cheapest_device_steps(busy, host_chunks, chunk_numel=N, param_bytes_per_element=2, most=3) == 3
    assert cheapest_device_steps(busy, host_chunks[:2], chunk_numel=N, param_bytes_per_element=2, most=3) == 2


def test_the_plan_steps_the_first_host_groups_of_the_forward_on_the_device():
    from zero_cache.plan.planner import PlanInputs, make_plan
    inputs = dict(num_chunks=12, chunk_numel=N, param_bytes_per_element=2, device_budget_bytes=24 * 2**30,
                  host_budget_bytes=400 * 2**30, grad_bytes_per_element=0, param_chunks_held=12, param_home="host",
                  live_groups=3, gather_ahead=1, trace=tuple(reversed(range(12))), kept_bytes_per_element=2)
    auto = make_plan(PlanInputs(**inputs, device_steps=None))
    off = make_plan(PlanInputs(**inputs, device_steps=0))
    assert auto.device_stepped and not off.device_stepped
    host_groups = [c for c in reversed(range(12)) if auto.optimizer_tier[c] == HOST]  # the forward's order
    assert list(auto.device_stepped) == host_groups[:len(auto.device_stepped)]
    assert not set(auto.device_stepped) & set(auto.kept_gradients)
    assert auto.traffic.seconds < off.traffic.seconds
    assert "stepped on the device" in auto.summary()


def test_reordering_the_updates_lane_keeps_barriers_and_each_chunks_order():
    queue = JobQueue()
    jobs = [("update", 5, "a"), ("update", 2, "a"), ("update", 5, "b"), ("barrier",), ("update", 3, "a"),
            ("update", 1, "a")]
    for job in jobs:
        queue.put(job)
    queue.reorder(lambda job: job[1] if job[0] == "update" else None)
    assert [queue.get(block=False) for _ in jobs] == [("update", 2, "a"), ("update", 5, "a"), ("update", 5, "b"),
                                                       ("barrier",), ("update", 1, "a"), ("update", 3, "a")]


@pytest.mark.parametrize("value", [-1, "many", 1.5, True])
def test_a_bad_device_steps_value_names_the_key(value):
    with pytest.raises(ValueError, match="zero_cache.device_steps"):
        ZeroCacheConfig(device_steps=value)
