"""The eviction rule is one function, Belady's: gathering applies it, and the re-plan's estimate of how often a group
is gathered per step is that rule run over the recorded acquisitions, equal to what the runtime does."""

from __future__ import annotations

import pytest
import torch
from reference import SEQ, VOCAB, ds_config, random_batches, train_steps

import angelptm
import zero_cache.runtime.gathered
from angelptm.pretraining.models import ModelConfig, build_model
from zero_cache.plan.eviction import belady_misses, belady_victim, gathers_per_group
from zero_cache.plan.planner import PlanInputs
from zero_cache.warmup import with_measured_gathers


class CountingBelady:
    """Belady's rule that counts the victims it was asked for."""

    def __init__(self) -> None:
        self.asked = 0

    def __call__(self, candidates, next_use, recording):
        self.asked += 1
        return belady_victim(candidates, next_use, recording)


def streamed_engine(seed: int, checkpointing: bool):
    torch.manual_seed(seed)
    model = build_model(ModelConfig(flavour="gpt2", vocab_size=VOCAB, max_seq_len=SEQ, num_layers=4, hidden_size=32,
                                    num_heads=4, activation_checkpointing=checkpointing))
    config = ds_config(zero_cache={"enabled": True, "chunk_size": 8192, "param_home": "host",
                                   "device_memory_budget": "auto", "host_memory_budget": "1GiB"})
    engine, optimizer, _, _ = angelptm.initialize(model=model, config=config)
    return engine, optimizer


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_gathers_the_replan_expects_are_the_gathers_the_runtime_makes(checkpointing, monkeypatch):
    seed = torch.randint(0, 10_000, ()).item()
    engine, optimizer = streamed_engine(seed, checkpointing)
    gathered = optimizer.exchange.gathered
    counting = CountingBelady()
    monkeypatch.setattr(zero_cache.runtime.gathered, "belady_victim", counting)
    batches = random_batches(seed, count=3, batch=2)
    train_steps(engine, batches[:1])  # the warm-up records the acquisitions
    groups = len(set(gathered.trace.groups))
    expected = with_measured_gathers(any_inputs(), optimizer).gathers_per_step
    assert expected == gathers_per_group(gathered.trace.groups, gathered.max_live - gathered.ahead) > 1
    for batch in batches[1:]:
        before = gathered.gathers
        train_steps(engine, [batch])
        assert (gathered.gathers - before) / groups == pytest.approx(expected)
    assert counting.asked > 0, "the runtime must ask Belady's rule for its victims"


def any_inputs() -> PlanInputs:
    """Plan inputs (the estimate replaces one field of them)."""
    return PlanInputs(num_chunks=1, chunk_numel=1, param_bytes_per_element=4, device_budget_bytes=1,
                      host_budget_bytes=1)


def test_belady_over_a_forward_and_backward_trace():
    # forward 0 1 2, backward 2 1 0, room for 2: fetching 2 evicts 0 (used last); 1 and 2 stay for backward.
    misses, events = belady_misses((0, 1, 2, 2, 1, 0), capacity=2)
    assert (misses, events) == (4, [(0, None), (1, None), (2, 0), (0, 1)])  # (then 1 and 2 are never used again)
    assert gathers_per_group((0, 1, 2, 2, 1, 0), 2) == pytest.approx(4 / 3)
    assert belady_victim([0, 1, 2], {0: 5, 1: 9, 2: 7}.__getitem__, recording=False) == 1  # furthest next use
    assert belady_victim([2, 0, 1], {0: 5, 1: 9, 2: 7}.__getitem__, recording=True) == 2  # least recently used
