"""The MoE layer names its all-to-all choice and why (INFO, when it changes), and an exchange step can run
over a transport object instead of a process group (one process, no process group needed)."""

from __future__ import annotations

import logging

import torch

from moe import GroupedExperts, MoEConfig, MoELayer
from moe.alltoall import Exchange, flat_plan
from moe.topology import ExpertParallelGroups


class LoopbackTransport:
    """One rank: what it sends to itself is what it receives; counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes):
        assert output_split_sizes == input_split_sizes
        self.calls += 1
        output.copy_(input)
        return self

    def wait(self) -> None:
        pass


def groups(size: int, ranks_per_node: int) -> ExpertParallelGroups:
    """Stand-in groups: the choice reads only the sizes and whether there is an intra-node subgroup."""
    two_level = size > ranks_per_node
    return ExpertParallelGroups(group=object(), rank=0, size=size, ranks_per_node=ranks_per_node,
                                intra=object() if two_level else None, inter=object() if two_level else None)


def layer(ep_size: int, hierarchical) -> MoELayer:
    cfg = MoEConfig(num_experts=2 * ep_size, top_k=2, ep_size=ep_size, hierarchical_all_to_all=hierarchical)
    return MoELayer(8, GroupedExperts(2, 8, 8, impl="loop"), cfg)


def test_auto_on_one_node_picks_flat_and_says_why(caplog):
    moe = layer(4, "auto")
    moe.ep_groups = groups(4, 4)
    counts = [[[10] * 8] for _ in range(4)]
    with caplog.at_level(logging.INFO, logger="moe.layer"):
        assert moe._use_hierarchical(counts, 4096) is False
        moe._use_hierarchical(counts, 4096)  # same choice: not logged again
    assert len(caplog.records) == 1
    assert "MoE all-to-all: flat (moe.hierarchical_all_to_all='auto')" in caplog.text
    assert "one node" in caplog.text


def test_auto_on_two_nodes_logs_the_prediction_links_and_crossover(caplog):
    moe = layer(4, "auto")
    moe.ep_groups = groups(4, 2)
    with caplog.at_level(logging.INFO, logger="moe.layer"):
        small = moe._use_hierarchical([[[1] * 8] for _ in range(4)], 16)
        large = moe._use_hierarchical([[[100_000] * 8] for _ in range(4)], 4096)
    text = caplog.text
    assert "predicted flat" in text and "inter 15 us + 50 GB/s" in text and "hierarchical wins" in text
    assert len(caplog.records) == (1 if small == large else 2)


def test_an_exchange_step_runs_over_a_transport_forward_and_backward():
    transport = LoopbackTransport()
    counts_WE = [[3, 0, 2]]  # one rank, three experts
    plan = flat_plan(counts_WE, 0, transport)
    rows = torch.randn(5, 4, requires_grad=True)
    out = Exchange(plan.ops, rows).finish()
    torch.testing.assert_close(out, rows)
    out.square().sum().backward()
    torch.testing.assert_close(rows.grad, 2 * rows)
    assert transport.calls == 2  # the forward's step and the backward's reverse step
