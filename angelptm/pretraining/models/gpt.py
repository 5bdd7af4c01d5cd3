"""Reference decoder-only GPT for pretraining (GPT-2 and Llama flavours).

Shapes in comments: B = batch, S = sequence, H = hidden, V = vocab, N = heads,
K = key/value heads, D = head dim, F = MLP inner width, E = experts.

With an enabled ``moe.MoEConfig`` every ``moe_every``-th block's MLP is a mixture of experts
(GShard: every other layer) and the router losses are added to the LM loss.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from moe import GroupedExperts, MoEConfig, MoELayer
from moe.topology import ExpertParallelGroups

from .config import ModelConfig

IGNORE_INDEX = -100
"""Label value that does not contribute to the loss."""


def rotary_tables(
    seq_len: int, head_dim: int, theta: float, device: torch.device | str | None = None
) -> tuple[Tensor, Tensor]:
    """Cosine and sine tables of rotary position embeddings (RoPE), in fp32.

    Uses the Llama / GPT-NeoX "rotate half" layout: frequency i applies to the dims
    i and i + D/2.

    Args:
        seq_len: number of positions.
        head_dim: width D of one head (even).
        theta: base of the frequencies.
        device: where to build the tables.

    Returns:
        ``(cos, sin)``, each fp32 of shape [seq_len, D].
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)  # [S, D/2]
    angles = torch.cat((angles, angles), dim=-1)  # [S, D]
    return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate query or key heads by their positions (computed in fp32).

    Args:
        x: [B, N, S, D] queries or keys.
        cos: [S, D] from :func:`rotary_tables`.
        sin: [S, D] from :func:`rotary_tables`.

    Returns:
        [B, N, S, D] rotated tensor in the dtype of ``x``.
    """
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def _norm(config: ModelConfig) -> nn.Module:
    if config.norm == "layernorm":
        return nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.bias)
    return nn.RMSNorm(config.hidden_size, eps=config.norm_eps)


class Attention(nn.Module):
    """Causal multi-head self-attention with optional grouped-query heads and RoPE."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        qkv_width = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.qkv = nn.Linear(config.hidden_size, qkv_width, bias=config.bias)  # rows: [q | k | v]
        self.proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=config.bias)
        self.proj.residual_proj = True
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, cos: Tensor | None, sin: Tensor | None) -> Tensor:
        """[B, S, H] -> [B, S, H]; ``cos``/``sin`` are [S, D] RoPE tables or None."""
        B, S, _ = x.shape
        N, K, D = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.qkv(x).split((N * D, K * D, K * D), dim=-1)
        q = q.view(B, S, N, D).transpose(1, 2)  # [B, N, S, D]
        k = k.view(B, S, K, D).transpose(1, 2)  # [B, K, S, D]
        v = v.view(B, S, K, D).transpose(1, 2)  # [B, K, S, D]
        if cos is not None:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if K != N:  # each kv head serves N/K consecutive query heads
            k = k.repeat_interleave(N // K, dim=1)  # [B, N, S, D]
            v = v.repeat_interleave(N // K, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).reshape(B, S, N * D)  # [B, S, N*D]
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """Feed-forward block: GELU (tanh approximation, as GPT-2) or SwiGLU (as Llama)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.swiglu = config.mlp == "swiglu"
        width = config.ffn_hidden_size * (2 if self.swiglu else 1)
        self.fc = nn.Linear(config.hidden_size, width, bias=config.bias)  # swiglu rows: [gate | up]
        self.proj = nn.Linear(config.ffn_hidden_size, config.hidden_size, bias=config.bias)
        self.proj.residual_proj = True
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        """[B, S, H] -> [B, S, H]."""
        h = self.fc(x)  # [B, S, F] or [B, S, 2F]
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")
        return self.drop(self.proj(h))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, mlp: Callable[[], nn.Module] | None = None) -> None:
        super().__init__()
        self.norm1 = _norm(config)
        self.attn = Attention(config)
        self.norm2 = _norm(config)
        self.mlp = mlp() if mlp is not None else MLP(config)

    def forward(self, x: Tensor, cos: Tensor | None = None, sin: Tensor | None = None) -> Tensor:
        """[B, S, H] -> [B, S, H]."""
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class MoEBlock(Block):
    """Pre-norm block whose MLP is a mixture of experts (same activation and bias as the dense MLP).

    Its forward returns ``(x, router_loss, expert_counts_E)``: the router loss is
    aux_loss_coef * balance + z_loss_coef * z (Switch / ST-MoE), already weighted.
    """

    def __init__(self, config: ModelConfig, moe: MoEConfig, ep_groups: ExpertParallelGroups | None = None) -> None:
        def moe_layer() -> MoELayer:
            experts = GroupedExperts(moe.num_experts // moe.ep_size, config.hidden_size,
                                     moe.ffn_hidden_size or config.ffn_hidden_size, bias=config.bias,
                                     activation="swiglu" if config.mlp == "swiglu" else "gelu_tanh")
            return MoELayer(config.hidden_size, experts, moe, ep_groups)

        super().__init__(config, moe_layer)  # builds no dense MLP only to replace it
        self.moe_config = moe
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, cos: Tensor | None = None, sin: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """[B, S, H] -> ([B, S, H], router loss scalar, int64 [E] routes per expert)."""
        x = x + self.attn(self.norm1(x), cos, sin)
        moe = self.mlp(self.norm2(x))
        loss = self.moe_config.aux_loss_coef * moe.balance_loss + self.moe_config.z_loss_coef * moe.z_loss
        return x + self.drop(moe.output), loss, moe.expert_counts


class GPT(nn.Module):
    """Decoder-only transformer language model, optionally with mixture-of-experts blocks.

    Args:
        config: architecture; see :class:`ModelConfig`.
        moe: when given and enabled, every ``moe.moe_every``-th block (blocks moe_every-1,
            2*moe_every-1, ...) is a :class:`MoEBlock`.
        ep_groups: expert-parallel groups for ``moe.ep_size > 1``.
    """

    def __init__(self, config: ModelConfig, moe: MoEConfig | None = None,
                 ep_groups: ExpertParallelGroups | None = None) -> None:
        super().__init__()
        self.config = config
        self.moe_config = moe if moe is not None and moe.enabled else None
        self.moe_stats: dict[str, Tensor] = {}  # last forward's router loss and expert load, detached
        self.tok_emb = nn.Embedding(config.vocab_size, config.hidden_size)
        self.pos_emb = nn.Embedding(config.max_seq_len, config.hidden_size) if config.position == "learned" else None
        self.drop = nn.Dropout(config.dropout)
        every = self.moe_config.moe_every if self.moe_config else 0
        self.blocks = nn.ModuleList(MoEBlock(config, self.moe_config, ep_groups) if every and (i + 1) % every == 0
                                    else Block(config) for i in range(config.num_layers))
        self.norm_f = _norm(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.rope_cos: Tensor | None
        self.rope_sin: Tensor | None
        self.register_buffer("rope_cos", None, persistent=False)
        self.register_buffer("rope_sin", None, persistent=False)
        if config.position == "rotary":
            self._build_rope(self.tok_emb.weight.device)
        self._init_weights()

    def _build_rope(self, device: torch.device) -> None:
        c = self.config
        self.rope_cos, self.rope_sin = rotary_tables(c.max_seq_len, c.head_dim, c.rope_theta, device)

    def _apply(self, fn, *args, **kwargs):  # keep the RoPE tables in fp32 through .to(dtype) / .half()
        super()._apply(fn, *args, **kwargs)
        if self.rope_cos is not None and self.rope_cos.dtype != torch.float32:
            self._build_rope(self.rope_cos.device)
        return self

    @torch.no_grad()
    def _init_weights(self) -> None:
        std = self.config.init_std
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                if module is self.lm_head and self.config.tie_embeddings:
                    continue
                nn.init.normal_(module.weight, 0.0, std)
                if getattr(module, "residual_proj", False):  # GPT-2 paper: scale by 1/sqrt(2 * layers)
                    module.weight.mul_(1.0 / math.sqrt(2 * self.config.num_layers))
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, GroupedExperts):
                module.reset_parameters(std, std / math.sqrt(2 * self.config.num_layers))
            elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                nn.init.ones_(module.weight)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, input_ids: Tensor, labels: Tensor | None = None) -> Tensor:
        """Run the model.

        Args:
            input_ids: [B, S] token ids, S <= ``config.max_seq_len``.
            labels: optional [B, S] target ids aligned with ``input_ids`` position by position
                (labels[:, s] is the token to predict after reading input_ids[:, :s+1]; the
                caller shifts). Positions equal to -100 are ignored.

        Returns:
            The mean cross-entropy loss (fp32 scalar) when ``labels`` is given, else the
            logits [B, S, V] in the model's dtype.

        Raises:
            ValueError: if ``input_ids`` is not 2-D, is longer than ``max_seq_len``, or
                ``labels`` has a different shape.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        S = input_ids.shape[1]
        if S > self.config.max_seq_len:
            raise ValueError(f"sequence length {S} exceeds ModelConfig.max_seq_len={self.config.max_seq_len}")
        if labels is not None and labels.shape != input_ids.shape:
            raise ValueError(f"labels shape {tuple(labels.shape)} != input_ids shape {tuple(input_ids.shape)}")
        x = self.tok_emb(input_ids)  # [B, S, H]
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(S, device=input_ids.device))
        x = self.drop(x)
        cos = sin = None
        if self.rope_cos is not None:
            cos, sin = self.rope_cos[:S], self.rope_sin[:S]  # [S, D]
        recompute = self.config.activation_checkpointing and self.training
        router_losses, counts = [], []
        for block in self.blocks:
            out = checkpoint(block, x, cos, sin, use_reentrant=False) if recompute else block(x, cos, sin)
            if isinstance(block, MoEBlock):
                out, router_loss, counts_E = out
                router_losses.append(router_loss)
                counts.append(counts_E)
            x = out
        logits = self.lm_head(self.norm_f(x))  # [B, S, V]
        if router_losses:
            router_loss = torch.stack(router_losses).sum()
            self.moe_stats = {"router_loss": router_loss.detach(), "expert_counts": torch.stack(counts).detach()}
        if labels is None:
            return logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
        return loss + router_loss if router_losses else loss

    def moe_metrics(self) -> dict[str, float]:
        """Router loss and expert load of the last forward, for logs ({} without MoE blocks).

        ``moe_load_max`` is the busiest expert's routes over the mean (1.0 = balanced), worst layer.
        """
        if not self.moe_stats:
            return {}
        counts_LE = self.moe_stats["expert_counts"].float()
        load = (counts_LE.max(-1).values / counts_LE.mean(-1).clamp(min=1e-9)).max()
        return {"moe_router_loss": self.moe_stats["router_loss"].item(), "moe_load_max": load.item()}

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters, counting tied weights once.

        Args:
            exclude_embeddings: leave out the input embedding tables (token and learned
                position). With tied embeddings this also removes the LM head; an untied
                LM head is kept (it is a matmul like any other).

        Returns:
            The parameter count.
        """
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            total -= self.tok_emb.weight.numel()
            if self.pos_emb is not None:
                total -= self.pos_emb.weight.numel()
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs per token of one forward + backward pass.

        ``6 * N + 12 * L * H * S`` with N = all parameters (tied counted once), L = layers,
        H = hidden size, S = sequence length (PaLM, Chowdhery et al. 2022, appendix B).
        Activation recomputation is not counted (model FLOPs, not hardware FLOPs), and the
        attention term counts the full S x S score matrix, ignoring the causal mask. With MoE
        blocks N counts the active parameters (:meth:`num_active_params`).

        Args:
            seq_len: training sequence length S.

        Returns:
            FLOPs per token; multiply by tokens per step and divide by step time for model FLOP/s.
        """
        c = self.config
        return float(6 * self.num_active_params() + 12 * c.num_layers * c.hidden_size * seq_len)

    def num_active_params(self) -> int:
        """Parameters one token uses: all, less each MoE layer's experts it is not routed to
        (expert weights count top_k / num_experts of all ep_size ranks' experts)."""
        adjust = 0.0
        for block in self.blocks:
            if isinstance(block, MoEBlock):
                local_numel = sum(p.numel() for p in block.mlp.experts.parameters())  # this rank's E / ep_size
                moe = block.moe_config
                adjust += local_numel * moe.ep_size * moe.top_k / moe.num_experts - local_numel
        return self.num_params() + int(adjust)

    def param_groups(self, weight_decay: float) -> list[dict]:
        """Optimizer parameter groups: weight decay on matrices, none on vectors.

        Parameters with ``dim >= 2`` (linear weights and embedding tables) get
        ``weight_decay``; those with ``dim < 2`` (biases, norm weights) get 0.
        Tied weights appear once; parameters with ``requires_grad=False`` are left out.

        Args:
            weight_decay: decay coefficient of the first group.

        Returns:
            ``[{"params": [...], "weight_decay": weight_decay}, {"params": [...], "weight_decay": 0.0}]``.
        """
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_model(config: ModelConfig, moe: MoEConfig | None = None,
                ep_groups: ExpertParallelGroups | None = None) -> GPT:
    """Build a freshly initialised :class:`GPT`.

    Args:
        config: model architecture.
        moe: the ``"moe"`` config section; MoE blocks when enabled.
        ep_groups: expert-parallel groups, needed when ``moe.ep_size > 1``.

    Returns:
        The model on the default device and dtype, in training mode.
    """
    return GPT(config, moe, ep_groups)
