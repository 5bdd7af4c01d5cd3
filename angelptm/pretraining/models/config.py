"""Configuration of the reference decoder-only GPT (:class:`ModelConfig`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

_FLAVOURS: dict[str, dict[str, object]] = {
    "gpt2": {"position": "learned", "norm": "layernorm", "mlp": "gelu", "bias": True},
    "llama": {"position": "rotary", "norm": "rmsnorm", "mlp": "swiglu", "bias": False},
}
_CHOICES: dict[str, tuple[str, ...]] = {
    "position": ("learned", "rotary"),
    "norm": ("layernorm", "rmsnorm"),
    "mlp": ("gelu", "swiglu"),
}

MAX_SIZES: dict[str, int] = {
    "num_layers": 16_384,
    "hidden_size": 2**20,
    "ffn_hidden_size": 2**22,
    "num_heads": 2**16,
    "num_kv_heads": 2**16,
    "vocab_size": 2**24,
    "max_seq_len": 2**24,
}
"""Upper bounds of the sizes, far above any model trained (a 1T-parameter GPT has ~128 layers of width ~25k):
a typo such as ``num_layers: 4611686018427387904`` is refused here, by arithmetic, before any model (even a
meta-device one, built layer by layer) is made, and before a shape overflows torch's storage arithmetic."""


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Architecture of a decoder-only transformer language model.

    Fields left as ``None`` are resolved in ``__post_init__`` (from ``flavour`` or
    from the other sizes), so after construction every field holds a concrete value.
    Invalid values raise ``ValueError`` naming the field, the value and what is allowed.
    """

    flavour: str = "gpt2"
    """Architecture family, "gpt2" or "llama". Sets the defaults of ``position``, ``norm``,
    ``mlp`` and ``bias``: gpt2 -> learned, layernorm, gelu (tanh approximation, GPT-2's
    ``gelu_new``), bias=True; llama -> rotary, rmsnorm, swiglu, bias=False."""

    position: str | None = None
    """Position encoding: "learned" (absolute embedding table) or "rotary" (RoPE)."""

    norm: str | None = None
    """Normalisation layer: "layernorm" or "rmsnorm"."""

    mlp: str | None = None
    """Feed-forward block: "gelu" (2 matrices, tanh-approximated GELU) or "swiglu" (3 matrices)."""

    bias: bool | None = None
    """Whether linear layers (and LayerNorm) carry a bias."""

    vocab_size: int = 4096
    """Number of token ids (rows of the embedding table)."""

    max_seq_len: int = 256
    """Longest sequence the model accepts (size of the position table / RoPE cache)."""

    num_layers: int = 4
    """Number of transformer blocks."""

    hidden_size: int = 128
    """Width of the residual stream; must be divisible by ``num_heads``."""

    num_heads: int = 4
    """Number of query attention heads."""

    num_kv_heads: int | None = None
    """Number of key/value heads (grouped-query attention); None means ``num_heads``.
    Must divide ``num_heads``."""

    ffn_hidden_size: int | None = None
    """Inner width of the MLP. None means 4*hidden_size for gelu and, for swiglu,
    round(8/3*hidden_size) rounded up to a multiple of 64."""

    dropout: float = 0.0
    """Dropout probability for embeddings, attention weights and residual branches; in [0, 1)."""

    tie_embeddings: bool = True
    """Share the LM head weight with the token embedding."""

    activation_checkpointing: bool = False
    """Recompute each block's activations in backward (only while the module is training)."""

    init_std: float = 0.02
    """Standard deviation of the normal weight init (residual projections are scaled down
    by 1/sqrt(2*num_layers))."""

    rope_theta: float = 10000.0
    """Base of the RoPE frequencies (only used with position="rotary")."""

    norm_eps: float = 1e-5
    """Epsilon of LayerNorm / RMSNorm."""

    def __post_init__(self) -> None:
        if self.flavour not in _FLAVOURS:
            raise ValueError(f"model.flavour={self.flavour!r} is not supported; use one of {sorted(_FLAVOURS)}")
        for name, default in _FLAVOURS[self.flavour].items():
            if getattr(self, name) is None:
                setattr(self, name, default)
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"model.{name}={getattr(self, name)!r} is not supported; use one of {list(allowed)}"
                )
        for name in ("bias", "tie_embeddings", "activation_checkpointing"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"model.{name}={getattr(self, name)!r} must be a bool (True or False)")
        self._check_sizes()
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        else:
            self._check_positive_int("num_kv_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads} "
                f"(e.g. one of {[d for d in range(1, self.num_heads + 1) if self.num_heads % d == 0]})"
            )
        if self.position == "rotary" and self.head_dim % 2:
            raise ValueError(
                f"position='rotary' needs an even head dim, but hidden_size={self.hidden_size} / "
                f"num_heads={self.num_heads} = {self.head_dim}; change hidden_size or num_heads"
            )
        if self.ffn_hidden_size is None:
            if self.mlp == "gelu":
                self.ffn_hidden_size = 4 * self.hidden_size
            else:
                self.ffn_hidden_size = 64 * math.ceil(round(8 * self.hidden_size / 3) / 64)
        else:
            self._check_positive_int("ffn_hidden_size")

    def _check_positive_int(self, name: str) -> None:
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"model.{name}={value!r} must be a positive integer")
        if value > MAX_SIZES[name]:
            raise ValueError(f"model.{name}={value} is beyond any trainable model: it must be at most "
                             f"{MAX_SIZES[name]:,}")

    def _check_sizes(self) -> None:
        for name in ("vocab_size", "max_seq_len", "num_layers", "hidden_size", "num_heads"):
            self._check_positive_int(name)
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads}"
            )
        dropout = self.dropout
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"model.dropout={self.dropout!r} must be in [0, 1)")
        for name in ("init_std", "rope_theta", "norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"model.{name}={value!r} must be a positive number")

    @property
    def head_dim(self) -> int:
        """Width of one attention head (hidden_size // num_heads)."""
        return self.hidden_size // self.num_heads
