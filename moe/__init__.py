"""Mixture-of-experts layers with expert parallelism and topology-aware all-to-all.

Never imports ``angelptm``; owns its typed config and takes process groups as arguments.
``from moe.layer import MoE`` is a drop-in for ``deepspeed.moe.layer.MoE``.
"""

from moe.config import MoEConfig
from moe.experts import GroupedExperts, LoopExperts, experts_from_module
from moe.gate import Router, Routing, route
from moe.layer import MoE, MoELayer, MoEOutput
from moe.topology import ExpertParallelGroups, build_expert_parallel_groups, ranks_per_node_from_env

__all__ = ["ExpertParallelGroups", "GroupedExperts", "LoopExperts", "MoE", "MoEConfig", "MoELayer", "MoEOutput",
           "Router", "Routing", "build_expert_parallel_groups", "experts_from_module", "ranks_per_node_from_env",
           "route"]
