"""AutoPipe's partition search against brute force, its cost model by hand, and its baselines."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from autopipe.cost import CostChain, CostSettings, StageCostModel
from autopipe.search import (
    min_max_partition,
    parameter_count_starts,
    plan_with_baselines,
    predict,
    search,
    uniform_layer_starts,
)


def random_chain(rng: random.Random, num_units: int) -> CostChain:
    return CostChain(
        forward_s=tuple(rng.uniform(0.1, 5.0) for _ in range(num_units)),
        backward_s=tuple(rng.uniform(0.1, 10.0) for _ in range(num_units)),
        param_bytes=tuple(rng.choice([0, rng.randint(1, 1000)]) for _ in range(num_units)),
        param_numel=tuple(rng.randint(0, 250) for _ in range(num_units)),
        activation_bytes=tuple(rng.randint(0, 400) for _ in range(num_units)),
        boundary_bytes=tuple(rng.randint(0, 300) for _ in range(num_units + 1)),
    )


def brute_force(chain: CostChain, settings: CostSettings) -> float:
    """Smallest bottleneck over every split that fits, by enumeration (inf if none fits)."""
    model = StageCostModel(chain, settings)
    n, chunks, best = chain.num_units, settings.num_chunks, math.inf
    for cuts in itertools.combinations(range(1, n), chunks - 1):
        starts, ends = (0, *cuts), (*cuts, n)
        if any(model.memory_bytes(c, a, b) > settings.chunk_memory_limit_bytes
               for c, (a, b) in enumerate(zip(starts, ends))):
            continue
        best = min(best, max(float(model.time_s(a, b)) for a, b in zip(starts, ends)))
    return best


def test_search_equals_brute_force_on_random_chains():
    rng = random.Random(6)
    checked_with_cap = 0
    for trial in range(150):
        n = rng.randint(1, 9)
        chain = random_chain(rng, n)
        virtual = rng.choice([1, 1, 2])
        stages = rng.randint(1, max(1, n // virtual))
        schedule = "interleaved" if virtual > 1 else rng.choice(["gpipe", "1f1b"])
        # caps drawn around the unconstrained peak so that some bind and some make the problem infeasible
        free = CostSettings(num_stages=stages, num_microbatches=rng.randint(1, 6), schedule=schedule,
                            virtual_stages_per_rank=virtual, link_bandwidth_bytes_per_s=rng.uniform(10, 1000),
                            state_bytes_per_param=rng.choice([0.0, 12.0]), recompute=rng.random() < 0.3)
        if free.num_chunks > n:
            continue
        limit = None
        if trial % 2:
            model = StageCostModel(chain, free)
            whole = max(float(model.memory_bytes(c, 0, n)) for c in range(free.num_chunks))
            limit = rng.uniform(0.2, 1.0) * whole * virtual
        settings = CostSettings(**{**{f: getattr(free, f) for f in free.__slots__}, "memory_limit_bytes": limit})
        expected = brute_force(chain, settings)
        if math.isinf(expected):
            with pytest.raises(ValueError, match="stage_memory_limit_bytes"):
                search(chain, settings)
            continue
        plan = search(chain, settings)
        checked_with_cap += limit is not None
        assert plan.bottleneck_s == pytest.approx(expected, rel=1e-12)
        assert all(stage.memory_bytes <= settings.chunk_memory_limit_bytes * (1 + 1e-12) for stage in plan.stages)
        assert len(plan.stages) == settings.num_chunks
    assert checked_with_cap >= 10, "the memory cap must have bound in some feasible trials"


def test_infeasible_memory_limit_names_the_key_and_the_need():
    chain = CostChain(forward_s=(1.0, 1.0), backward_s=(2.0, 2.0), param_bytes=(1000, 1000), param_numel=(10, 10),
                      activation_bytes=(0, 0), boundary_bytes=(0, 0, 0))
    settings = CostSettings(num_stages=2, num_microbatches=4, memory_limit_bytes=500, state_bytes_per_param=0.0)
    with pytest.raises(ValueError) as err:
        search(chain, settings)
    message = str(err.value)
    assert "autopipe.stage_memory_limit_bytes=500" in message and "1000 bytes" in message
    too_many = CostSettings(num_stages=3, num_microbatches=4)
    with pytest.raises(ValueError, match=r"only 2 pieces between its allowed cuts \(1 cut points\)"):
        search(chain, too_many)


def test_cost_model_by_hand():
    # two units; stage 1 of 2 under 1F1B holds min(S - s, M) = 1 micro-batch, stage 0 holds 2
    chain = CostChain(forward_s=(1.0, 3.0), backward_s=(2.0, 6.0), param_bytes=(100, 300), param_numel=(50, 150),
                      activation_bytes=(40, 70), boundary_bytes=(8, 20, 4))
    settings = CostSettings(num_stages=2, num_microbatches=4, link_bandwidth_bytes_per_s=10.0,
                            state_bytes_per_param=2.0)
    plan = predict(chain, settings, (0, 1), "by-hand")
    first, last = plan.stages
    assert first.time_s == pytest.approx(1.0 + 2.0 + 20 / 10.0)  # sends its output on, nothing back
    assert last.time_s == pytest.approx(3.0 + 6.0 + 20 / 10.0)  # sends the input gradient back
    assert first.memory_bytes == pytest.approx(100 + 2.0 * 50 + 2 * 40)
    assert last.memory_bytes == pytest.approx(300 + 2.0 * 150 + 1 * 70)
    assert plan.step_time_s == pytest.approx(5.0 + 11.0 + 3 * 11.0)  # sum(T) + (M-1) * max(T)
    assert plan.bubble_fraction == pytest.approx(1 - 4 * 16.0 / (2 * 49.0))
    recompute = predict(chain, CostSettings(num_stages=2, num_microbatches=4, link_bandwidth_bytes_per_s=10.0,
                                            state_bytes_per_param=2.0, recompute=True), (0, 1), "recompute")
    assert recompute.stages[1].backward_s == pytest.approx(6.0 + 3.0)  # backward re-runs the forward
    assert recompute.stages[0].memory_bytes == pytest.approx(100 + 100 + 2 * 8 + 40)  # inputs kept, one full set
    gpipe = predict(chain, CostSettings(num_stages=2, num_microbatches=4, schedule="gpipe",
                                        state_bytes_per_param=2.0), (0, 1), "gpipe")
    assert [s.memory_bytes for s in gpipe.stages] == pytest.approx([200 + 4 * 40, 600 + 4 * 70])  # all M in flight
    # interleaved, S=2, v=2, M=4: Megatron's warm-up (S-r-1)*2 + (v-1)*S, plus one, spread over the v chunks
    settings = CostSettings(num_stages=2, num_microbatches=4, schedule="interleaved", virtual_stages_per_rank=2)
    assert [settings.in_flight_microbatches(c) for c in range(4)] == [2.5, 1.5, 2.5, 1.5]


def test_balanced_chain_bubble_is_the_textbook_fraction():
    chain = CostChain(forward_s=(1.0,) * 8, backward_s=(2.0,) * 8, param_bytes=(0,) * 8, param_numel=(0,) * 8,
                      activation_bytes=(0,) * 8, boundary_bytes=(0,) * 9)
    for stages, micro in ((2, 4), (4, 8), (8, 3)):
        plan = search(chain, CostSettings(num_stages=stages, num_microbatches=micro))
        assert plan.bubble_fraction == pytest.approx((stages - 1) / (micro + stages - 1))


def test_min_max_partition_respects_allowed_starts():
    prefix = np.concatenate(([0.0], np.cumsum([5.0, 1.0, 1.0, 1.0, 5.0])))

    def part_cost(_, a, b):
        return prefix[b] - prefix[a]

    free_value, _ = min_max_partition(5, 2, part_cost)
    assert free_value == 7.0  # 5+1 | 1+1+5 (or 5+1+1 | 1+5)
    only_four = [True, False, False, False, True]
    value, starts = min_max_partition(5, 2, part_cost, only_four)
    assert (value, starts) == (8.0, (0, 4))


def lm_like_chain() -> CostChain:
    """Embedding (cheap, big), 4 equal blocks, then a head that costs as much as 3 blocks."""
    return CostChain(forward_s=(0.1, 1.0, 1.0, 1.0, 1.0, 3.0), backward_s=(0.1, 2.0, 2.0, 2.0, 2.0, 6.0),
                     param_bytes=(400, 100, 100, 100, 100, 400), param_numel=(200, 50, 50, 50, 50, 200),
                     activation_bytes=(10,) * 6, boundary_bytes=(1,) * 7, unit_layer=(-1, 0, 1, 2, 3, 4), num_layers=4)


def test_baselines_and_predicted_speedup():
    chain = lm_like_chain()
    settings = CostSettings(num_stages=2, num_microbatches=8)
    assert uniform_layer_starts(chain, 2) == (0, 3)  # embedding + 2 blocks | 2 blocks + head
    assert parameter_count_starts(chain, 2) == (0, 3)  # 600 | 600 bytes
    report = plan_with_baselines(chain, settings)
    assert report.auto.stage_starts == (0, 4)  # embedding + 3 blocks | 1 block + head
    assert report.speedup_over("uniform-layers") > 1.15
    assert report.speedup_over("parameters") >= 1.0
    text = report.format()
    assert "uniform-layers" in text and "parameters" in text and "speedup" in text


def test_chain_rejects_bad_input():
    with pytest.raises(ValueError, match="boundary_bytes"):
        CostChain(forward_s=(1.0,), backward_s=(1.0,), param_bytes=(0,), param_numel=(0,), activation_bytes=(0,),
                  boundary_bytes=(0,))
    with pytest.raises(ValueError, match="forward_s"):
        CostChain(forward_s=(-1.0,), backward_s=(1.0,), param_bytes=(0,), param_numel=(0,), activation_bytes=(0,),
                  boundary_bytes=(0, 0))
    with pytest.raises(ValueError, match="schedule"):
        CostSettings(num_stages=2, num_microbatches=2, schedule="zigzag")


def test_parameter_baseline_refuses_more_stages_than_layer_starts():
    # 3 layer-granular starts (embedding, layer 0, layer 1 + head); 4 stages would have to cut inside a layer
    chain = CostChain(forward_s=(1.0,) * 6, backward_s=(2.0,) * 6, param_bytes=(10,) * 6, param_numel=(1,) * 6,
                      activation_bytes=(0,) * 6, boundary_bytes=(0,) * 7, unit_layer=(-1, 0, 0, 1, 1, 1),
                      num_layers=2)
    assert parameter_count_starts(chain, 3) == (0, 1, 3)
    with pytest.raises(ValueError, match="layer-granular"):
        parameter_count_starts(chain, 4)
    report = plan_with_baselines(chain, CostSettings(num_stages=4, num_microbatches=4))
    assert [b.method for b in report.baselines] == []  # neither by-layer baseline exists; none is made up
