"""Top-k gating: which experts each token goes to, with what weight, and which routes an expert drops.

Shape legend: T = tokens on this rank, D = model dim, E = experts (all ranks), K = top_k,
R = T * K routes.

``route`` is the routing math as a pure function of the logits (noise and random priorities are
inputs, so it is deterministic and tested on CPU); :class:`Router` is the module around it that owns
the gate weight and draws the noise. The semantics follow ``deepspeed.moe.sharded_moe`` so that a
DeepSpeed-MoE model routes identically:

* capacity per expert = ceil(capacity_factor * T * K / E), at least min_capacity (GShard, Lepikhin et
  al. 2020, sec. 2.2), or no limit in dropless mode;
* k = 1: the combine weight is the softmax probability (Switch, Fedus et al. 2021); k >= 2: the
  probabilities of the routes that survive the capacity check, renormalised to sum to 1;
* the load-balancing loss is E * sum_e f_e * P_e (Switch eq. 4), with P_e the mean router
  probability and f_e the share of tokens whose first choice is e for k <= 2 (GShard), or the share
  of all K routes for k > 2;
* the router z-loss is mean_t logsumexp(logits_t)^2 (ST-MoE, Zoph et al. 2022, eq. 5).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe.config import MoEConfig

JITTER_EPS = 1e-2
"""Multiplicative input jitter range [1 - eps, 1 + eps] (Switch Transformer, sec. 2.4)."""


@dataclass(frozen=True, slots=True)
class Routing:
    """The gate's decision for one batch of tokens."""

    expert_TK: Tensor
    """int64 [T, K]: the experts each token chose, best first."""
    weight_TK: Tensor
    """fp32 [T, K]: combine weight of each route; 0 where the route was dropped."""
    kept_TK: Tensor
    """bool [T, K]: the route survived the capacity check (and the token is used)."""
    counts_E: Tensor
    """int64 [E]: routes that chose each expert before the capacity check (DeepSpeed's exp_counts)."""
    balance_loss: Tensor
    """fp32 scalar: the Switch/GShard load-balancing loss, unweighted."""
    z_loss: Tensor
    """fp32 scalar: the router z-loss, unweighted."""
    capacity: int | None
    """Routes each expert may keep; None in dropless mode."""


def count_per_bin(index: Tensor, num_bins: int, mask: Tensor | None = None) -> Tensor:
    """int64 [num_bins]: how many entries of ``index`` (where ``mask``) fall in each bin.

    ``torch.bincount`` and boolean indexing read a size to the host on CUDA (a device sync each);
    a scatter-add into a fixed-size histogram does not.
    """
    values = torch.ones_like(index) if mask is None else mask.to(index.dtype)
    return torch.zeros(num_bins, dtype=torch.int64, device=index.device).scatter_add_(0, index, values)


def _rank_within_expert(expert_R: Tensor, priority_R: Tensor | None, num_experts: int) -> Tensor:
    """Position of each route in its expert's queue: 0 for the highest priority.

    Routes are ordered by expert, then by descending ``priority_R`` (or by their index R when None),
    with stable sorts so ties keep index order.
    """
    order_R = torch.arange(expert_R.numel(), device=expert_R.device)
    if priority_R is not None:
        order_R = torch.argsort(priority_R, descending=True, stable=True)
    order_R = order_R[torch.argsort(expert_R[order_R], stable=True)]
    counts_E = count_per_bin(expert_R, num_experts)
    start_E = torch.cumsum(counts_E, 0) - counts_E
    rank_R = torch.empty_like(expert_R)
    rank_R[order_R] = torch.arange(expert_R.numel(), device=expert_R.device) - start_E[expert_R[order_R]]
    return rank_R


def route(logits_TE: Tensor, *, top_k: int, capacity: int | None, drop_policy: str = "position",
          selection_logits_TE: Tensor | None = None, priority_TK: Tensor | None = None,
          used_T: Tensor | None = None, noisy_after_first: bool = False) -> Routing:
    """Route tokens to their top-k experts under a capacity limit.

    Args:
        logits_TE: router logits (computed in fp32).
        top_k: experts per token.
        capacity: routes each expert may keep, or None to keep every route (dropless).
        drop_policy: which routes an over-full expert keeps: "position" (choice 1 of every token
            before choice 2, then token order), "probs" (highest probability) or "random"
            (highest ``priority_TK``).
        selection_logits_TE: logits the top-k choice is made on (noisy logits for "RSample");
            the combine weights always come from ``logits_TE``.
        priority_TK: random priorities, needed by the "random" policy.
        used_T: optional 0/1 mask; routes of unused tokens are neither counted nor dispatched.
        noisy_after_first: take the first choice from the clean probabilities and only the later
            ones from ``selection_logits_TE`` (DeepSpeed's ``top2_2nd_expert_sampling``).

    Returns:
        The :class:`Routing`.

    Raises:
        ValueError: unknown ``drop_policy`` or "random" without ``priority_TK``.
    """
    num_tokens, num_experts = logits_TE.shape
    probs_TE = torch.softmax(logits_TE.float(), dim=-1)
    choice_TE = probs_TE if selection_logits_TE is None else selection_logits_TE
    expert_TK = torch.topk(choice_TE, top_k, dim=-1).indices
    if noisy_after_first and selection_logits_TE is not None and top_k > 1:
        first_T1 = probs_TE.argmax(-1, keepdim=True)
        rest_TE = selection_logits_TE.scatter(1, first_T1, float("-inf"))
        expert_TK = torch.cat([first_T1, torch.topk(rest_TE, top_k - 1, dim=-1).indices], dim=1)
    prob_TK = probs_TE.gather(1, expert_TK)
    used_TK = torch.ones_like(expert_TK, dtype=torch.bool)
    if used_T is not None:
        used_TK = used_T.bool().unsqueeze(1).expand_as(expert_TK)
    # k-major flattening (all first choices, then all second choices): GShard's priority order.
    expert_R, used_R = expert_TK.t().reshape(-1), used_TK.t().reshape(-1)
    counts_E = count_per_bin(expert_R, num_experts, used_R)
    kept_TK = used_TK
    if capacity is not None:
        priorities = {"position": None, "probs": prob_TK, "random": priority_TK}
        if drop_policy not in priorities:
            raise ValueError(f"drop_policy: must be one of {sorted(priorities)}, got {drop_policy!r}")
        if drop_policy == "random" and priority_TK is None:
            raise ValueError("drop_policy='random' needs priority_TK (random priorities per route)")
        priority = priorities[drop_policy]
        priority_R = None if priority is None else priority.t().reshape(-1)
        sink = num_experts  # unused routes queue behind a sink expert and never count against capacity
        queue_R = torch.where(used_R, expert_R, torch.full_like(expert_R, sink))
        rank_R = _rank_within_expert(queue_R, priority_R, num_experts + 1)
        kept_TK = ((rank_R < capacity) & used_R).view(top_k, num_tokens).t()
    weight_TK = prob_TK * kept_TK
    if top_k > 1:  # renormalise over the surviving routes (DeepSpeed's top2gating / topkgating)
        weight_TK = weight_TK / weight_TK.sum(-1, keepdim=True).clamp(min=torch.finfo(weight_TK.dtype).eps)
    return Routing(expert_TK=expert_TK, weight_TK=weight_TK, kept_TK=kept_TK, counts_E=counts_E,
                   balance_loss=balance_loss(probs_TE, expert_TK, used_TK),
                   z_loss=z_loss(logits_TE), capacity=capacity)


def balance_loss(probs_TE: Tensor, expert_TK: Tensor, used_TK: Tensor) -> Tensor:
    """Switch/GShard auxiliary loss E * sum_e f_e * P_e.

    Args:
        probs_TE: router probabilities.
        expert_TK: chosen experts, best first.
        used_TK: routes of used tokens.

    Returns:
        fp32 scalar; 1.0 for perfectly uniform routing. f_e counts first choices for k <= 2 and all
        routes (divided by k) for k > 2, as deepspeed.moe does.
    """
    num_tokens, num_experts = probs_TE.shape
    top_k = expert_TK.shape[1]
    routes_TK = expert_TK[:, :1] if top_k <= 2 else expert_TK
    mask_TK = used_TK[:, :routes_TK.shape[1]]
    share_E = count_per_bin(routes_TK.reshape(-1), num_experts, mask_TK.reshape(-1)).float() / routes_TK.numel()
    return num_experts * torch.sum(probs_TE.mean(0) * share_E)


def z_loss(logits_TE: Tensor) -> Tensor:
    """ST-MoE router z-loss: mean over tokens of logsumexp(logits)^2 (penalises large logits)."""
    return torch.logsumexp(logits_TE.float(), dim=-1).square().mean()


class Router(nn.Module):
    """The gate: a bias-free linear layer D -> E in fp32, noise in training, then :func:`route`.

    Args:
        hidden_size: model dim D.
        config: the MoE config (experts, k, capacity factors, noise, drop policy).
        second_expert_sampling: in training, take the choices after the first from Gumbel-noised
            logits (DeepSpeed's ``top2_2nd_expert_sampling``).
    """

    def __init__(self, hidden_size: int, config: MoEConfig, *, second_expert_sampling: bool = False) -> None:
        super().__init__()
        self.config = config
        # Gumbel-sample the choices after the first in training (DeepSpeed's top2_2nd_expert_sampling).
        self.second_expert_sampling = second_expert_sampling
        self.wg = nn.Linear(hidden_size, config.num_experts, bias=False)  # DeepSpeed's TopKGate.wg

    def capacity(self, num_tokens: int) -> int | None:
        """Routes each expert may keep for ``num_tokens`` tokens in the current mode (None = dropless)."""
        if not self.config.drop_tokens:
            return None
        return self.config.capacity(num_tokens, training=self.training)

    def forward(self, x_TD: Tensor, used_T: Tensor | None = None) -> Routing:
        """Route ``x_TD`` (any dtype; the gate runs in fp32, as DeepSpeed's does)."""
        cfg = self.config
        x_TD = x_TD.float()
        noisy = cfg.noisy_gate_policy if self.training else None
        if noisy == "Jitter":
            x_TD = x_TD * torch.empty_like(x_TD).uniform_(1.0 - JITTER_EPS, 1.0 + JITTER_EPS)
        logits_TE = F.linear(x_TD, self.wg.weight.float())
        selection_TE = None
        after_first = self.second_expert_sampling and self.training and cfg.top_k > 1
        if noisy == "RSample" or after_first:  # Gumbel-max sampling of the experts; weights stay noise-free
            gumbel_TE = -torch.log(-torch.log(torch.rand_like(logits_TE).clamp(min=1e-20)).clamp(min=1e-20))
            selection_TE = logits_TE.detach() + gumbel_TE
        policy = cfg.resolved_drop_policy
        priority_TK = None
        if policy == "random" and cfg.drop_tokens:
            priority_TK = torch.rand(x_TD.shape[0], cfg.top_k, device=x_TD.device)
        return route(logits_TE, top_k=cfg.top_k, capacity=self.capacity(x_TD.shape[0]), drop_policy=policy,
                     selection_logits_TE=selection_TE, priority_TK=priority_TK, used_T=used_T,
                     noisy_after_first=after_first and noisy != "RSample")
