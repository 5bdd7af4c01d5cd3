"""Expert parallelism under the engine: which parameters are experts, and how their gradients reduce.

With ``moe.ep_size = W > 1`` the world is split into consecutive blocks of W ranks (the expert-
parallel groups, built by :func:`moe.topology.build_expert_parallel_groups`); rank r holds the
experts of EP index ``r % W``. Dense parameters are replicated on every rank, experts only on the
ranks of one *expert-data-parallel* group ``{r % W + k W}``. So (DeepSpeed-MoE's scheme):

* replicas start from the same weights: dense parameters from global rank 0, experts from the
  first rank of their expert-data-parallel group;
* a dense gradient is averaged over all ranks; an expert's gradient already sums the losses of
  every rank of its EP group (the all-to-all's backward brings them), so it is summed over its
  expert-data-parallel group and divided by the world size: both are then the gradient of the
  mean loss over the global batch;
* the global gradient norm adds each EP index's expert norm once (a sum over the EP group).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from moe.layer import MoELayer
from moe.topology import ExpertParallelGroups, build_expert_parallel_groups, ranks_per_node_from_env


@dataclass(frozen=True, slots=True)
class ExpertParallel:
    """This rank's view of expert parallelism."""

    ep_size: int
    """W, ranks in an expert-parallel group."""
    ep_rank: int
    """This rank's index in its expert-parallel group: which slice of the experts it holds."""
    ep_group: dist.ProcessGroup
    """This rank's expert-parallel group (for the expert gradient norm)."""
    edp_group: dist.ProcessGroup | None
    """The ranks holding the same experts as this one; None when there is one EP group (world == W)."""
    edp_source: int
    """Global rank whose experts the expert-data-parallel replicas start from."""
    expert_ids: frozenset[int]
    """id() of every expert parameter."""


def moe_layers(model: nn.Module) -> list[MoELayer]:
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def setup_expert_parallel(model: nn.Module, rank: int, world_size: int) -> ExpertParallel | None:
    """Give every expert-parallel MoE layer its groups (creating them once) and describe the layout.

    Every rank must call this, in the same order relative to other group creation.

    Returns:
        None when no layer of ``model`` has ep_size > 1.

    Raises:
        ValueError: layers with different ep_size, or an ep_size that does not divide the world.
    """
    layers = [layer for layer in moe_layers(model) if layer.config.ep_size > 1]
    if not layers:
        return None
    sizes = {layer.config.ep_size for layer in layers}
    if len(sizes) > 1:
        raise ValueError(f"moe.ep_size: the model's MoE layers use different expert-parallel sizes {sorted(sizes)}")
    ep_size = sizes.pop()
    if world_size % ep_size:
        raise ValueError(f"moe.ep_size={ep_size}: must divide the number of ranks ({world_size})")
    groups: ExpertParallelGroups | None = next((layer.ep_groups for layer in layers if layer.ep_groups), None)
    if groups is None:
        groups = build_expert_parallel_groups(ep_size, ranks_per_node_from_env(layers[0].config.ranks_per_node))
    for layer in layers:
        if layer.ep_groups is None:
            layer.set_ep_groups(groups)
    edp_group = None
    for residue in range(ep_size):  # every rank creates every group, in the same order
        members = list(range(residue, world_size, ep_size))
        group = dist.new_group(members) if len(members) > 1 else None
        if rank % ep_size == residue:
            edp_group = group
    expert_ids = frozenset(id(p) for layer in layers for p in layer.experts.parameters())
    return ExpertParallel(ep_size=ep_size, ep_rank=rank % ep_size, ep_group=groups.group, edp_group=edp_group,
                          edp_source=rank % ep_size, expert_ids=expert_ids)
