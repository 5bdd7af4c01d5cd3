"""The MoE layer: gate -> sort -> (all-to-all) -> grouped experts -> (all-to-all back) -> combine.

Shape legend: T = tokens on this rank, D = model dim, E = experts (all ranks), K = top_k,
C = token chunks, W = expert-parallel ranks, N = rows of one chunk.

:class:`MoELayer` is the engine-facing module (typed config, separate loss terms);
:class:`MoE` has ``deepspeed.moe.layer.MoE``'s constructor and returns ``(output, l_aux,
exp_counts)``, so a DeepSpeed-MoE model switches by changing the import.

One host sync per forward: the [C, E] kept-route counts (all-gathered over the expert-parallel
group when W > 1) are copied to the host, because ``all_to_all_single`` takes its split sizes as
host integers. Everything else (routing, the sort, grouped GEMM offsets) stays on the device.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from moe.alltoall import Exchange, ExchangePlan, flat_plan, hierarchical_plan
from moe.config import MoEConfig
from moe.dispatch import ChunkRows, chunk_rows, combine, permute, sort_routes
from moe.experts import experts_from_module
from moe.gate import Router
from moe.topology import (
    ExpertParallelGroups,
    Link,
    build_expert_parallel_groups,
    crossover_bytes,
    flat_all_to_all_s,
    hierarchical_all_to_all_s,
    ranks_per_node_from_env,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MoEOutput:
    """What one MoE layer call returns."""

    output: Tensor
    """Same shape and dtype as the input."""
    balance_loss: Tensor
    """Switch/GShard load-balancing loss (unweighted, fp32 scalar)."""
    z_loss: Tensor
    """ST-MoE router z-loss (unweighted, fp32 scalar)."""
    expert_counts: Tensor
    """int64 [E]: routes per expert before the capacity check on this rank."""


class MoELayer(nn.Module):
    """Mixture-of-experts layer with expert parallelism and chunked compute/communication overlap.

    Args:
        hidden_size: D.
        experts: this rank's experts (``GroupedExperts`` or ``LoopExperts``), E / W of them.
        config: routing, capacity, topology and overlap settings.
        ep_groups: the expert-parallel groups; None for a single rank (W = 1).
        second_expert_sampling: see :class:`moe.gate.Router`.

    Raises:
        ValueError: expert count or group size inconsistent with the config.
    """

    def __init__(self, hidden_size: int, experts: nn.Module, config: MoEConfig,
                 ep_groups: ExpertParallelGroups | None = None, *, second_expert_sampling: bool = False) -> None:
        super().__init__()
        if experts.num_local_experts * config.ep_size != config.num_experts:
            raise ValueError(f"moe.num_experts={config.num_experts}: {experts.num_local_experts} local experts x "
                             f"ep_size {config.ep_size} do not add up")
        self.config = config
        self.router = Router(hidden_size, config, second_expert_sampling=second_expert_sampling)
        self.experts = experts
        self.ep_groups: ExpertParallelGroups | None = None
        self.last_hierarchical = False  # whether the last forward used the hierarchical exchange (logs, tests)
        self._logged_choice: bool | None = None  # the exchange last logged: the choice is logged when it changes
        if ep_groups is not None:
            self.set_ep_groups(ep_groups)

    def set_ep_groups(self, ep_groups: ExpertParallelGroups) -> None:
        """Attach the expert-parallel groups (needed before the first forward when ep_size > 1).

        Raises:
            ValueError: the group size is not ep_size, or hierarchical exchange is forced on one node.
        """
        if ep_groups.size != self.config.ep_size:
            raise ValueError(
                f"moe.ep_size={self.config.ep_size} but the expert-parallel group has {ep_groups.size} ranks"
            )
        if self.config.hierarchical_all_to_all is True and ep_groups.intra is None:
            raise ValueError("moe.hierarchical_all_to_all=true: the expert-parallel group must span more than one "
                             "node (ep_size > ranks_per_node); use false or 'auto'")
        self.ep_groups = ep_groups if ep_groups.size > 1 else None

    def forward(self, x: Tensor, used_token: Tensor | None = None) -> MoEOutput:
        """Route ``x`` ([..., D]) to the experts and combine their outputs.

        Args:
            x: tokens, any leading shape.
            used_token: optional 0/1 mask over the flattened tokens; masked tokens are not routed.

        Returns:
            The :class:`MoEOutput`.
        """
        if self.config.ep_size > 1 and self.ep_groups is None:
            raise RuntimeError(f"MoELayer: ep_size={self.config.ep_size} but no expert-parallel groups; call "
                               "set_ep_groups(build_expert_parallel_groups(...)) on every rank first")
        x_TD = x.reshape(-1, x.shape[-1])
        num_tokens = x_TD.shape[0]
        routing = self.router(x_TD, used_token)
        # The same on every rank (the all-gather and the per-chunk collectives must match): never
        # derived from this rank's token count; chunk_bounds leaves surplus chunks empty.
        num_chunks = self.config.overlap_chunks if self.ep_groups is not None else 1
        sorted_routes = sort_routes(routing, self.config.num_experts, num_chunks)
        counts_WCE = self._counts_on_host(sorted_routes.rows_CE)  # the one D2H sync
        rows = [chunk_rows(sorted_routes, routing.weight_TK, num_tokens, counts_WCE[self._rank], c)
                for c in range(num_chunks)]
        if self.ep_groups is None:
            y_ND = self.experts(permute(x_TD, rows[0]), counts_WCE[0][0])
            y_chunks = [y_ND]
        else:
            y_chunks = self._exchange_and_compute(x_TD, rows, counts_WCE)
        token_N = torch.cat([r.token_N for r in rows])
        weight_N = torch.cat([r.weight_N for r in rows])
        out_TD = combine(torch.cat(y_chunks), token_N, weight_N, num_tokens)
        return MoEOutput(output=out_TD.view_as(x), balance_loss=routing.balance_loss, z_loss=routing.z_loss,
                         expert_counts=routing.counts_E)

    @property
    def _rank(self) -> int:
        return self.ep_groups.rank if self.ep_groups is not None else 0

    def _counts_on_host(self, rows_CE: Tensor) -> list[list[list[int]]]:
        """[W][C][E] kept rows every rank sends to every expert, per chunk, as host integers."""
        if self.ep_groups is None:
            return [rows_CE.tolist()]
        flat = rows_CE.new_empty(self.ep_groups.size * rows_CE.numel())  # 1-D: gloo wants dim-0 concatenation
        # torch >= 2.13 renames all_gather_into_tensor to all_gather_single.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(flat, rows_CE.reshape(-1), group=self.ep_groups.group)
        return flat.view(self.ep_groups.size, *rows_CE.shape).tolist()

    def _use_hierarchical(self, counts_WCE: list[list[list[int]]], row_bytes: int) -> bool:
        """Same answer on every rank: decided from the all-gathered counts only. Logged (INFO) when it changes."""
        choice, reason = self._exchange_choice(counts_WCE, row_bytes)
        if choice != self._logged_choice:
            logger.info("MoE all-to-all: %s (moe.hierarchical_all_to_all=%r): %s",
                        "hierarchical" if choice else "flat", self.config.hierarchical_all_to_all, reason)
            self._logged_choice = choice
        return choice

    def _exchange_choice(self, counts_WCE: list[list[list[int]]], row_bytes: int) -> tuple[bool, str]:
        """(hierarchical?, why), from the setting, the groups and moe.topology's cost model."""
        setting, groups = self.config.hierarchical_all_to_all, self.ep_groups
        if groups.intra is None:
            return False, (f"the {groups.size} expert-parallel ranks are one node ({groups.ranks_per_node} ranks per "
                           "node): there is no inter-node link to save")
        if setting != "auto":
            return setting, "as configured"
        cfg, chunks = self.config, len(counts_WCE[0])
        rows = sum(sum(map(sum, rank_counts)) for rank_counts in counts_WCE)
        bytes_per_rank = rows * row_bytes / groups.size / chunks
        intra = Link(cfg.intra_node_latency_us * 1e-6, cfg.intra_node_bandwidth_gbs * 1e9)
        inter = Link(cfg.inter_node_latency_us * 1e-6, cfg.inter_node_bandwidth_gbs * 1e9)
        args = (bytes_per_rank, groups.ranks_per_node, groups.nodes, intra, inter)
        flat_s, hier_s = flat_all_to_all_s(*args), hierarchical_all_to_all_s(*args)
        cross = crossover_bytes(*args[1:])
        return hier_s < flat_s, (
            f"{groups.nodes} nodes x {groups.ranks_per_node}, {bytes_per_rank / 2**20:.3f} MiB per rank per chunk, "
            f"predicted flat {flat_s * 1e3:.3f} ms / hierarchical {hier_s * 1e3:.3f} ms with the moe config's links "
            f"(assumed, not measured): intra {cfg.intra_node_latency_us:g} us + {cfg.intra_node_bandwidth_gbs:g} GB/s, "
            f"inter {cfg.inter_node_latency_us:g} us + {cfg.inter_node_bandwidth_gbs:g} GB/s; hierarchical wins "
            + ("never" if cross is None else f"below {cross / 2**20:.2f} MiB per rank"))

    def _plan(self, counts_WCE: list[list[list[int]]], chunk: int, hierarchical: bool) -> ExchangePlan:
        counts_WE = [rank_counts[chunk] for rank_counts in counts_WCE]
        groups = self.ep_groups
        if hierarchical:
            return hierarchical_plan(counts_WE, groups.rank, groups.ranks_per_node, groups.intra, groups.inter)
        return flat_plan(counts_WE, groups.rank, groups.group)

    def _exchange_and_compute(self, x_TD: Tensor, rows: list[ChunkRows], counts_WCE: list) -> list[Tensor]:
        """Pipeline over chunks: chunk c+1's dispatch and chunk c-1's return are in flight while
        chunk c's experts compute. Collectives are issued in the same order on every rank."""
        hierarchical = self._use_hierarchical(counts_WCE, x_TD.shape[-1] * x_TD.element_size())
        self.last_hierarchical = hierarchical
        plans = [self._plan(counts_WCE, c, hierarchical) for c in range(len(rows))]
        dispatches = [Exchange(plan.ops, permute(x_TD, r)) for plan, r in zip(plans, rows)]
        returns = []
        dispatches[0].advance()
        for c, plan in enumerate(plans):
            if c + 1 < len(plans):
                dispatches[c + 1].advance()
            y_ND = self.experts(dispatches[c].finish(), plan.rows_per_local_expert)
            back = Exchange(plan.inverse_ops(), y_ND)
            back.advance()
            returns.append(back)
        return [back.finish() for back in returns]


class MoE(nn.Module):
    """Drop-in for ``deepspeed.moe.layer.MoE``: same constructor, returns ``(output, l_aux, exp_counts)``.

    Args:
        hidden_size: D.
        expert: the expert module; ``Sequential(Linear, GELU|ReLU|SiLU, Linear)`` runs as grouped GEMMs,
            anything else as a loop over copies.
        num_experts: E over all expert-parallel ranks.
        ep_size: expert-parallel ranks W.
        k: top-k (any k).
        capacity_factor, eval_capacity_factor, min_capacity: GShard capacity in training / eval.
        use_residual: Residual MoE (PR-MoE, Rajbhandari et al. 2022): mix with a dense copy of ``expert``.
        noisy_gate_policy: None, "None", "Jitter" or "RSample".
        drop_tokens: False = dropless.
        use_rts: random token selection for k = 1.
        use_tutel, enable_expert_tensor_parallelism: accepted for compatibility; tutel is not used and
            expert tensor parallelism is not supported (ValueError if True).
        top2_2nd_expert_sampling: Gumbel-sample the second choice in training (k >= 2).
        ep_groups: expert-parallel groups to share between layers; built on first use when None and ep_size > 1.
        ranks_per_node, hierarchical_all_to_all, overlap_chunks, z_loss_coef: see :class:`moe.MoEConfig`.
            ``l_aux`` includes ``z_loss_coef * z_loss``.
    """

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: str | None = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True, *, ep_groups: ExpertParallelGroups | None = None,
                 ranks_per_node: int | None = None, hierarchical_all_to_all: bool | str = "auto",
                 overlap_chunks: int = 1, z_loss_coef: float = 0.0) -> None:
        super().__init__()
        if enable_expert_tensor_parallelism:
            raise ValueError("enable_expert_tensor_parallelism=True: expert tensor parallelism is not supported")
        self.config = MoEConfig(enabled=True, num_experts=num_experts, top_k=k, capacity_factor=capacity_factor,
                                eval_capacity_factor=eval_capacity_factor, min_capacity=min_capacity,
                                drop_tokens=drop_tokens, ep_size=ep_size, use_rts=use_rts, z_loss_coef=z_loss_coef,
                                noisy_gate_policy=None if noisy_gate_policy == "None" else noisy_gate_policy,
                                ranks_per_node=ranks_per_node, hierarchical_all_to_all=hierarchical_all_to_all,
                                overlap_chunks=overlap_chunks)
        self.ep_size, self.num_experts, self.num_local_experts = ep_size, num_experts, num_experts // ep_size
        self.use_residual = use_residual
        self.deepspeed_moe = MoELayer(hidden_size, experts_from_module(expert, self.num_local_experts), self.config,
                                      ep_groups, second_expert_sampling=top2_2nd_expert_sampling)
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False, *,
                                  ep_groups: ExpertParallelGroups | None = None) -> None:
        """Attach expert-parallel groups, building them when none are given (as DeepSpeed's method does).

        Every rank must call this in the same order (it creates process groups); pass one
        ``ep_groups`` to all layers to share communicators.
        """
        if use_data_before_expert_parallel_:
            raise ValueError("use_data_before_expert_parallel_=True is not supported")
        if ep_groups is None:
            ep_groups = build_expert_parallel_groups(self.ep_size, ranks_per_node_from_env(self.config.ranks_per_node))
        self.deepspeed_moe.set_ep_groups(ep_groups)

    def forward(self, hidden_states: Tensor, used_token: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Returns ``(output, l_aux, exp_counts)`` like DeepSpeed's MoE; groups are built on first use if needed."""
        if self.ep_size > 1 and self.deepspeed_moe.ep_groups is None:
            self.set_deepspeed_parallelism()
        result = self.deepspeed_moe(hidden_states, used_token)
        output = result.output
        if self.use_residual:
            dense = self.mlp(hidden_states)
            dense = dense[0] if isinstance(dense, tuple) else dense
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + dense * coef[..., 1:]
        l_aux = result.balance_loss + self.config.z_loss_coef * result.z_loss
        return output, l_aux, result.expert_counts
