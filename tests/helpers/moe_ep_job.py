"""Expert-parallel MoE job for the multi-process test; started by torchrun with 4 gloo ranks.

    torchrun --nproc-per-node 4 tests/helpers/moe_ep_job.py --ranks-per-node 2 --seed S --out-dir DIR

Every rank builds the same 8 experts and gate from the seed and keeps its 2 experts. Each rank has
its own token count and inputs; the gate is skewed so one expert receives no token at all. For each
routing scenario the layer runs with flat and hierarchical all-to-all (and chunked overlap), and
every rank compares outputs and gradients with a single-process reference holding all experts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from reference import end_job  # noqa: E402

from moe import GroupedExperts, MoEConfig, MoELayer, build_expert_parallel_groups  # noqa: E402

D, F, E, WORLD = 16, 24, 8, 4
SCENARIOS = {  # name -> MoEConfig overrides
    "top2_capacity": dict(top_k=2, capacity_factor=1.0, min_capacity=1),
    "top1_capacity": dict(top_k=1, capacity_factor=0.75, min_capacity=1, use_rts=False),
    "top2_dropless": dict(top_k=2, drop_tokens=False),
}
MODES = {"flat": dict(hierarchical_all_to_all=False), "hier": dict(hierarchical_all_to_all=True),
         "hier_chunks3": dict(hierarchical_all_to_all=True, overlap_chunks=3),
         "flat_chunks2": dict(hierarchical_all_to_all=False, overlap_chunks=2),
         # more chunks than rank 0 has tokens (20) but fewer than the others: every rank must still
         # agree on the chunk count (empty chunks), or the count all-gather and the exchanges mismatch
         "flat_chunks24": dict(hierarchical_all_to_all=False, overlap_chunks=24)}


def rank_inputs(seed: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed * 100 + rank)
    tokens = 20 + 7 * rank  # uneven token counts per rank
    x = torch.randn(tokens, D, generator=generator)
    x[:, 0] = x[:, 0].abs() + 3.0  # a positive feature the gate uses to shut expert 5 out
    return x, torch.randn(tokens, D, generator=generator)


def make_layer(config: MoEConfig, full: dict[str, torch.Tensor], first: int, count: int, groups=None) -> MoELayer:
    experts = GroupedExperts(count, D, F, activation="gelu_tanh", bias=True, impl="loop")
    layer = MoELayer(D, experts, config, groups)
    with torch.no_grad():
        layer.router.wg.weight.copy_(full["gate"])
        for name, param in experts.named_parameters():
            param.copy_(full[name][first:first + count])
    return layer


def run(layer: MoELayer, x: torch.Tensor, probe: torch.Tensor) -> dict[str, torch.Tensor]:
    x = x.clone().requires_grad_()
    result = layer(x)
    ((result.output * probe).sum() + 0.5 * result.balance_loss + 0.1 * result.z_loss).backward()
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    layer.zero_grad()
    return {"out": result.output.detach(), "x_grad": x.grad, "counts": result.expert_counts, **grads}


def reference(config: MoEConfig, full: dict, seed: int, rank: int) -> dict[str, torch.Tensor]:
    """All experts in one process: my tokens give outputs and gate/input grads; every rank's tokens
    add to the expert grads (as the expert-parallel backward sums them on the owner)."""
    layer = make_layer(config, full, 0, E)
    mine = run(layer, *rank_inputs(seed, rank))
    for other in range(WORLD):
        if other != rank:
            for name, grad in run(layer, *rank_inputs(seed, other)).items():
                if name.startswith("experts."):
                    mine[name] = mine[name] + grad
    per_rank = E // WORLD
    for name in [n for n in mine if n.startswith("experts.")]:
        mine[name] = mine[name][rank * per_rank:(rank + 1) * per_rank]
    return mine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks-per-node", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--out-dir", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    groups = build_expert_parallel_groups(WORLD, args.ranks_per_node)
    assert groups.nodes == WORLD // args.ranks_per_node and groups.intra is not None
    torch.manual_seed(args.seed)  # identical weights on every rank
    template = GroupedExperts(E, D, F, activation="gelu_tanh", bias=True)
    full = {name: p.detach() + 0.1 * torch.randn_like(p) for name, p in template.named_parameters()}
    full["gate"] = torch.randn(E, D)
    full["gate"][5] = 0.0
    full["gate"][5, 0] = -20.0  # expert 5 (on rank 2) is never chosen: zero rows from every rank
    full["gate"][0] *= 3.0  # and expert 0 is popular, so capacity drops happen
    per_rank = E // WORLD
    for scenario, overrides in SCENARIOS.items():
        expected = reference(MoEConfig(num_experts=E, **overrides), full, args.seed, rank)
        results = {}
        for mode, extra in MODES.items():
            config = MoEConfig(num_experts=E, ep_size=WORLD, **overrides, **extra)
            layer = make_layer(config, full, rank * per_rank, per_rank, groups)
            results[mode] = run(layer, *rank_inputs(args.seed, rank))
            assert layer.last_hierarchical == (mode.startswith("hier")), mode
            for name, value in expected.items():
                torch.testing.assert_close(results[mode][name], value, rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"{scenario}/{mode}/{name} on rank {rank}: {m}")
        for name in expected:  # same rows in the same order: bit-identical, not merely close
            assert torch.equal(results["flat"][name], results["hier"][name]), f"{scenario}: flat != hier for {name}"
        assert int(expected["counts"][5]) == 0
        single = MoEConfig(num_experts=E, **overrides)
        if single.drop_tokens:  # the capacity limit dropped routes on some rank
            routing = make_layer(single, full, 0, E).router(rank_inputs(args.seed, rank)[0])
            dropped = torch.tensor([int((~routing.kept_TK).sum())])
            dist.all_reduce(dropped)
            assert dropped.item() > 0, scenario
    (Path(args.out_dir) / f"ok.{rank}").write_text("ok")
    end_job()  # destroys the process group and exits


if __name__ == "__main__":
    main()
