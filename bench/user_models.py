"""The models users bring, at the benchmark protocol's sizes: not ours, theirs.

* ``nngpt``: a GPT-2 written from ``torch.nn`` modules the way people write one (``nn.Linear`` with biases,
  ``nn.LayerNorm``, GELU, an untied head, ``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)``
  per block, the logits cast to fp32 before the cross-entropy);
* ``hf_llama`` / ``hf_gpt2``: transformers' ``LlamaForCausalLM`` / ``GPT2LMHeadModel`` built from a config, with
  ``gradient_checkpointing_enable()``.

Every model is called as ``model(input_ids=..., labels=...)`` and the loss is ``output.loss`` (transformers) or the
output itself (``nngpt``): :func:`loss_of` hides the difference. Sizes follow the protocol (vocab 50304, seq 1024);
``tiny`` is for the CPU test of the harness.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

VOCAB = 50304
SEQ = 1024
SHAPES = {  # layers, hidden, heads (GPT-2 shapes; Llama takes the same with an 8/3 SwiGLU width)
    "tiny": (2, 64, 4),
    "1.3b": (24, 2048, 16),
    "2.7b": (32, 2560, 32),
    "4.4b": (36, 3072, 24),
    "6.9b": (32, 4096, 32),
    "10b": (48, 4096, 32),
    "11b": (52, 4096, 32),
    "12b": (56, 4096, 32),
    "13b": (40, 5120, 40),
    "16.3b": (50, 5120, 40),  # the largest measured on one H200 with 125 GiB of host, fp32 states, no disk
    "16.9b": (52, 5120, 40),  # the largest the plan fits there (pretrain.py --plan, the same shape)
}
MODELS = ("nngpt", "hf_llama", "hf_gpt2")


class Block(nn.Module):
    """Pre-LayerNorm transformer block with biases (GPT-2)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln_2 = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.out = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(hidden, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, hidden // self.heads).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, hidden))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class NnGPT(nn.Module):
    """A GPT-2 as a user writes it from torch.nn modules (learned positions, untied head)."""

    def __init__(self, layers: int, hidden: int, heads: int, vocab: int = VOCAB, seq: int = SEQ,
                 checkpointing: bool = True, init_std: float | None = 0.02) -> None:
        super().__init__()
        self.checkpointing = checkpointing
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        if init_std is None:  # PyTorch's own init (Kaiming-uniform Linear, N(0, 1) Embedding): what a user's model has
            return
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=init_std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(positions)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointing and self.training else block(x)
        logits = self.head(self.ln_f(x)).float()
        if labels is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))


INITS = ("small", "default")
"""``small``: GPT-2's N(0, 0.02) weights and zero biases; ``default``: PyTorch's own init, as a user's model has it
(larger weights: at 13B and 2.7B its global gradient norm stays above 1.0 over the first tens of steps, so a clip of
1.0 clips every one). transformers' models always take their own init (``initializer_range`` 0.02)."""


def build(kind: str, size: str, init: str = "small") -> nn.Module:
    """The model ``kind`` at ``size`` with the weights ``init`` names (:data:`INITS`), built in the current default
    device and dtype (a ``zero.Init`` context decides both for a ZeRO-3 config)."""
    if init not in INITS:
        raise ValueError(f"init {init!r}: expected one of {INITS}")
    layers, hidden, heads = SHAPES[size]
    vocab = 512 if size == "tiny" else VOCAB
    if kind == "nngpt":
        return NnGPT(layers, hidden, heads, vocab=vocab, init_std=0.02 if init == "small" else None)
    import transformers

    if kind == "hf_llama":
        intermediate = 256 * math.ceil(8 * hidden / 3 / 256)
        config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                                          num_hidden_layers=layers, num_attention_heads=heads,
                                          max_position_embeddings=SEQ, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(config)
    elif kind == "hf_gpt2":
        config = transformers.GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads,
                                         n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config)
    else:
        raise ValueError(f"model {kind!r}: expected one of {MODELS}")
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def loss_of(output: Any) -> torch.Tensor:
    """The loss from a model's output: transformers' ``.loss``, or the tensor ``nngpt`` returns."""
    return output if isinstance(output, torch.Tensor) else output.loss


def shape_of(kind: str, size: str) -> tuple[int, int]:
    """(layers, hidden) of the model: the attention term of the protocol's FLOPs (12 L H S per token)."""
    layers, hidden, _ = SHAPES[size]
    return layers, hidden


def flops_per_token(num_params: int, layers: int, hidden: int, seq: int = SEQ) -> float:
    """Model FLOPs per token, the protocol's 6N + 12 L H S (PaLM, appendix B); recompute not counted."""
    return 6 * num_params + 12 * layers * hidden * seq
