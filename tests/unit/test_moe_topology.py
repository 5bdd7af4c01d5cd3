"""The all-to-all cost model (alpha-beta) by hand, and the flat / hierarchical exchange plans run on
a simulated process group (every rank's buffers in one process, groups as tuples of ranks)."""

from __future__ import annotations

import pytest
import torch

from moe.alltoall import AllToAll, Reorder, flat_plan, hierarchical_plan
from moe.dispatch import reorder_chunks
from moe.topology import (
    Link,
    crossover_bytes,
    flat_all_to_all_s,
    hierarchical_all_to_all_s,
    prefer_hierarchical,
    ranks_per_node_from_env,
)

INTRA, INTER = Link(5e-6, 300e9), Link(20e-6, 50e9)


def test_cost_model_by_hand():
    # 2 nodes x 4 ranks, 8 MB per rank.
    b = 8e6
    intra_flat = 3 * 5e-6 + b * 3 / 8 / 300e9
    inter_flat = 4 * 20e-6 + b * 4 / 8 / 50e9
    assert flat_all_to_all_s(b, 4, 2, INTRA, INTER) == pytest.approx(max(intra_flat, inter_flat))
    hier = 3 * 5e-6 + b * 3 / 4 / 300e9 + 1 * 20e-6 + b * 1 / 2 / 50e9
    assert hierarchical_all_to_all_s(b, 4, 2, INTRA, INTER) == pytest.approx(hier)


def test_hierarchical_wins_small_messages_on_many_nodes_and_loses_large_ones():
    crossover = crossover_bytes(8, 16, INTRA, INTER)
    assert crossover is not None and 1e3 < crossover < 1e10
    assert prefer_hierarchical(0.9 * crossover, 8, 16, INTRA, INTER)
    assert not prefer_hierarchical(1.1 * crossover, 8, 16, INTRA, INTER)
    assert crossover_bytes(8, 16, INTRA, INTER) > crossover_bytes(8, 2, INTRA, INTER)  # more nodes, later crossover
    assert crossover_bytes(8, 1, INTRA, INTER) is None  # one node: nothing to save
    assert not prefer_hierarchical(1.0, 1, 16, INTRA, INTER)


def test_ranks_per_node_from_env(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert ranks_per_node_from_env() == 4
    assert ranks_per_node_from_env(2) == 2
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert ranks_per_node_from_env() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "four")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        ranks_per_node_from_env()


def simulate(plans_by_rank, buffers):
    """Run every rank's ops in lockstep; an AllToAll's group is a tuple of global ranks."""
    buffers = dict(buffers)
    for step in range(len(plans_by_rank[0])):
        ops = {r: plans_by_rank[r][step] for r in buffers}
        if isinstance(ops[0], Reorder):
            buffers = {r: reorder_chunks(buffers[r], ops[r].sizes, ops[r].order) for r in buffers}
            continue
        sent = {r: buffers[r].split(ops[r].send) for r in buffers}
        received = {}
        for r, op in ops.items():
            members = op.group
            assert [len(sent[m][members.index(r)]) for m in members] == op.recv
            received[r] = torch.cat([sent[m][members.index(r)] for m in members])
        buffers = received
    return buffers


@pytest.mark.parametrize("nodes,per_node,experts_per_rank", [(2, 2, 2), (3, 2, 1), (2, 3, 2)])
def test_flat_and_hierarchical_plans_deliver_every_row_to_its_expert_in_source_order(nodes, per_node,
                                                                                    experts_per_rank):
    world = nodes * per_node
    num_experts = world * experts_per_rank
    counts = torch.randint(0, 4, (world, num_experts))
    counts[:, 1] = 0  # an expert nobody sends to
    counts[0] = 0  # a rank that sends nothing
    counts_WE = counts.tolist()
    # Row tag = (source rank, global expert, index), rows sorted by expert as the dispatch produces them.
    buffers = {s: torch.tensor([[s, e, i] for e in range(num_experts) for i in range(counts_WE[s][e])],
                               dtype=torch.int64).reshape(-1, 3) for s in range(world)}
    everyone = tuple(range(world))
    flat = {r: flat_plan(counts_WE, r, everyone) for r in range(world)}
    hier = {}
    for r in range(world):
        node, local = divmod(r, per_node)
        intra = tuple(range(node * per_node, (node + 1) * per_node))
        inter = tuple(n * per_node + local for n in range(nodes))
        hier[r] = hierarchical_plan(counts_WE, r, per_node, intra, inter)
    out_flat = simulate({r: p.ops for r, p in flat.items()}, buffers)
    out_hier = simulate({r: p.ops for r, p in hier.items()}, buffers)
    for r in range(world):
        expected = [[s, e, i] for e in range(r * experts_per_rank, (r + 1) * experts_per_rank)
                    for s in range(world) for i in range(counts_WE[s][e])]
        assert out_flat[r].tolist() == expected
        assert torch.equal(out_hier[r], out_flat[r])
        assert hier[r].rows_per_local_expert == flat[r].rows_per_local_expert
        assert sum(isinstance(op, AllToAll) for op in hier[r].ops) == 2
    back = simulate({r: p.inverse_ops() for r, p in hier.items()}, out_hier)
    for r in range(world):
        assert torch.equal(back[r], buffers[r])  # the combine returns every row to where it came from
