"""Typed configuration of the MoE layers (the ``"moe"`` section of the JSON config)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

NOISY_GATE_POLICIES = (None, "Jitter", "RSample")
DROP_POLICIES = (None, "position", "probs", "random")


MAX_LOSS_COEF = 1e3
"""Largest router loss weight accepted: beyond it the router's loss outweighs the language-model loss a
thousandfold and more (1e30 gave a loss of 2e30 and no language modelling at all)."""


MAX_EXPERT_PARAMS = 10**14
"""Most expert parameters accepted over all MoE layers (100 T: some sixty times the largest MoE trained, Switch-C's
1.6 T). A size beyond it is a typo (``ffn_hidden_size: 2**63``), refused by arithmetic before any tensor is shaped:
torch's own refusal is an overflow traceback from inside ``torch.empty``."""


@dataclass(kw_only=True, slots=True)
class MoEConfig:
    """Mixture-of-experts layers and how their tokens travel between expert-parallel ranks.

    Names follow ``deepspeed.moe.layer.MoE`` where DeepSpeed has the same knob.
    """

    enabled: bool = False
    """Replace the MLP of every ``moe_every``-th transformer block with an MoE layer."""

    num_experts: int = 8
    """Experts per MoE layer, over all expert-parallel ranks."""

    top_k: int = 2
    """Experts each token is routed to (DeepSpeed's ``k``)."""

    capacity_factor: float = 1.25
    """Training capacity per expert = capacity_factor * tokens * top_k / num_experts."""

    eval_capacity_factor: float = 2.0
    """Capacity factor in eval mode."""

    min_capacity: int = 4
    """Lower bound on each expert's capacity, in tokens."""

    drop_tokens: bool = True
    """Drop tokens over capacity; False is dropless routing (capacity = the busiest expert's load)."""

    ep_size: int = 1
    """Expert-parallel group size; must divide num_experts."""

    noisy_gate_policy: str | None = None
    """None, "Jitter" (multiplicative input noise) or "RSample" (Gumbel noise on the logits)."""

    aux_loss_coef: float = 0.01
    """Weight of the Switch/GShard load-balancing loss."""

    z_loss_coef: float = 0.0
    """Weight of the router z-loss (ST-MoE); 0 disables it."""

    moe_every: int = 2
    """Every n-th block is an MoE block (2 = every other block, as in GShard)."""

    hierarchical_all_to_all: bool | str = "auto"
    """True, False, or "auto": pick by the topology cost model."""

    ranks_per_node: int | None = None
    """Override the launcher's LOCAL_WORLD_SIZE when planning the hierarchical exchange."""

    drop_policy: str | None = None
    """Which routes an over-full expert keeps: "position" (GShard: first choices before second
    choices, then token order), "probs" (highest gate probability), "random" (Switch's random token
    selection). None = what deepspeed.moe does for top_k: "random" for k=1 with use_rts, "position"
    for k=2 (and k=1 without use_rts), "probs" for k>2."""

    use_rts: bool = True
    """Random token selection for k=1 (DeepSpeed's ``use_rts``); only read when drop_policy is None."""

    ffn_hidden_size: int | None = None
    """Inner width of each expert; None = the model's ffn_hidden_size."""

    overlap_chunks: int = 1
    """Split each MoE layer's tokens into this many chunks so one chunk's all-to-all overlaps
    another's expert compute (1 = no split)."""

    intra_node_bandwidth_gbs: float = 350.0
    """Per-GPU all-to-all bandwidth inside a node in GB/s (1e9 bytes/s), for the "auto" choice.
    350 is an NVLink-4 (H100/H200) figure; bench/moe_alltoall.py measures it."""

    inter_node_bandwidth_gbs: float = 50.0
    """Per-GPU bandwidth between nodes in GB/s (50 = one 400 Gb/s InfiniBand NIC per GPU)."""

    intra_node_latency_us: float = 5.0
    """Per-message latency inside a node, microseconds."""

    inter_node_latency_us: float = 15.0
    """Per-message latency between nodes, microseconds."""

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"moe.num_experts: must be >= 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"moe.top_k: must be between 1 and num_experts={self.num_experts}, got {self.top_k}")
        for name in ("capacity_factor", "eval_capacity_factor"):
            if getattr(self, name) <= 0:
                raise ValueError(f"moe.{name}: must be > 0, got {getattr(self, name)}")
        if self.min_capacity < 0:
            raise ValueError(f"moe.min_capacity: must be >= 0, got {self.min_capacity}")
        if self.ep_size < 1 or self.num_experts % self.ep_size:
            raise ValueError(
                f"moe.ep_size: must divide num_experts={self.num_experts} so each rank holds whole experts, "
                f"got {self.ep_size}"
            )
        if self.noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(
                f"moe.noisy_gate_policy: must be one of {NOISY_GATE_POLICIES}, got {self.noisy_gate_policy!r}"
            )
        for name in ("aux_loss_coef", "z_loss_coef"):
            if not 0 <= getattr(self, name) <= MAX_LOSS_COEF:
                raise ValueError(f"moe.{name}: must be between 0 and {MAX_LOSS_COEF:g} (typical: 0.01 for the "
                                 f"balancing loss, 0.001 for the z-loss), got {getattr(self, name):g}")
        if self.moe_every < 1:
            raise ValueError(f"moe.moe_every: must be >= 1, got {self.moe_every}")
        if isinstance(self.hierarchical_all_to_all, str) and self.hierarchical_all_to_all != "auto":
            raise ValueError(
                f"moe.hierarchical_all_to_all: true, false or 'auto', got {self.hierarchical_all_to_all!r}"
            )
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise ValueError(f"moe.ranks_per_node: must be >= 1, got {self.ranks_per_node}")
        if self.drop_policy not in DROP_POLICIES:
            raise ValueError(f"moe.drop_policy: must be one of {DROP_POLICIES}, got {self.drop_policy!r}")
        if self.ffn_hidden_size is not None and self.ffn_hidden_size < 1:
            raise ValueError(f"moe.ffn_hidden_size: must be >= 1 or null, got {self.ffn_hidden_size}")
        if self.overlap_chunks < 1:
            raise ValueError(f"moe.overlap_chunks: must be >= 1, got {self.overlap_chunks}")
        for name in ("intra_node_bandwidth_gbs", "inter_node_bandwidth_gbs", "intra_node_latency_us",
                     "inter_node_latency_us"):
            if not getattr(self, name) > 0:
                raise ValueError(f"moe.{name}: must be > 0, got {getattr(self, name)}")

    def expert_numel(self, *, num_layers: int, hidden_size: int, ffn_hidden_size: int, gated: bool) -> int:
        """Parameters of all experts and gates in a model of ``num_layers`` blocks (every ``moe_every``-th is MoE).

        Args:
            num_layers, hidden_size: the model's blocks and width.
            ffn_hidden_size: the model's MLP width, used where this section leaves its own unset.
            gated: the experts are gated (swiglu: three matrices) rather than two.

        Returns:
            Weights, biases left out (a lower bound); exact integer arithmetic, so 2**63 does not overflow.
        """
        width = self.ffn_hidden_size or ffn_hidden_size
        per_expert = (3 if gated else 2) * hidden_size * width
        return (num_layers // self.moe_every) * self.num_experts * (per_expert + hidden_size)

    def check_expert_numel(self, *, num_layers: int, hidden_size: int, ffn_hidden_size: int, gated: bool) -> None:
        """Refuse sizes whose experts no machine could hold (:data:`MAX_EXPERT_PARAMS`).

        Raises:
            ValueError: naming the sizes and the count they make.
        """
        numel = self.expert_numel(num_layers=num_layers, hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size,
                                  gated=gated)
        if numel <= MAX_EXPERT_PARAMS:
            return
        width = (f"moe.ffn_hidden_size {self.ffn_hidden_size}" if self.ffn_hidden_size
                 else f"model.ffn_hidden_size {ffn_hidden_size}")
        raise ValueError(f"{width}, moe.num_experts {self.num_experts} and {num_layers // self.moe_every} MoE layers "
                         f"(model.num_layers {num_layers} / moe.moe_every {self.moe_every}) of model.hidden_size "
                         f"{hidden_size} make {numel:.3g} expert parameters, beyond any trainable model (at most "
                         f"{MAX_EXPERT_PARAMS:.0e}); check moe.ffn_hidden_size and moe.num_experts for a typo")

    @property
    def resolved_drop_policy(self) -> str:
        """The drop policy in effect (``drop_policy``, or deepspeed.moe's choice for ``top_k``)."""
        if self.drop_policy is not None:
            return self.drop_policy
        if self.top_k == 1:
            return "random" if self.use_rts else "position"
        return "position" if self.top_k == 2 else "probs"

    def capacity(self, num_tokens: int, *, training: bool) -> int:
        """Tokens each expert may take for a batch of ``num_tokens`` (GShard's capacity formula).

        Args:
            num_tokens: tokens entering the gate on this rank.
            training: use capacity_factor (True) or eval_capacity_factor (False).

        Returns:
            ceil(factor * num_tokens * top_k / num_experts), at least min_capacity.
        """
        factor = self.capacity_factor if training else self.eval_capacity_factor
        # Exact rational arithmetic on the factor as written (1.1, not 1.100000000000000088...), so an
        # exact multiple such as 1.1 * 200 * 2 / 8 = 55 is not rounded up to 56.
        capacity = math.ceil(Fraction(repr(factor)) * num_tokens * self.top_k / self.num_experts)
        return max(capacity, self.min_capacity)
