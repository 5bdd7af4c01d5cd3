"""A checkpoint as a Hugging Face ``save_pretrained`` directory: ``config.json`` + safetensors shards.

Two kinds of model are written (``angelptm.checkpoints.architecture`` records which one a checkpoint holds):

- a ``transformers`` model trained here: its own config and state-dict names, unchanged;
- our reference GPT (``angelptm.pretraining.models``): Llama flavour as ``LlamaForCausalLM``, GPT-2 flavour as
  ``GPT2LMHeadModel``, with their names and layouts. Both use the layouts of the Hugging Face
  classes already: RoPE rotates halves (``rotate_half``, so no q/k row permutation as Meta's
  interleaved checkpoints need), grouped-query heads serve consecutive query heads (``repeat_kv``),
  and the fused ``qkv`` rows are ``[q | k | v]``, the SwiGLU ``fc`` rows ``[gate | up]``.

Any other mix of ``model.position`` / ``norm`` / ``mlp`` (or MoE blocks) has no Hugging Face class to
load into and is refused, naming the option. ``transformers`` is imported only here, when asked for.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from angelptm.checkpoints import architecture
from angelptm.checkpoints.files import save_safetensors
from angelptm.errors import CheckpointError
from angelptm.pretraining.models import ModelConfig

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"


def pretrained_files(record: dict[str, Any] | None, state: dict[str, torch.Tensor],
                     aliases: dict[str, str], *, eos_token_id: int | None = None
                     ) -> tuple[Any, dict[str, torch.Tensor]]:
    """The Hugging Face config object and state dict for a checkpoint's model.

    Args:
        record: the checkpoint's ``architecture`` entry (:func:`angelptm.checkpoints.architecture.describe`).
        state: the consolidated fp32 state dict (``angelptm.checkpoints.export.consolidated_fp32_state_dict``).
        aliases: the checkpoint's ``param_aliases`` (state-dict key -> parameter name).
        eos_token_id: the end-of-text id of the tokenizer the run used, when known (our GPT): written as the
            config's ``bos_token_id`` and ``eos_token_id``. Unknown, a default id outside the vocabulary is left
            out, with a warning (:func:`_token_ids_inside`).

    Raises:
        CheckpointError: the checkpoint records no architecture, or one without a Hugging Face class, or an
            ``eos_token_id`` outside the model's vocabulary.
    """
    if record is None:
        raise CheckpointError("the checkpoint records no model architecture (it was saved before checkpoints "
                              "carried one, or the model is neither a transformers model nor "
                              "angelptm.pretraining.models.GPT), so no config.json can be written; export the weights "
                              "with `python -m "
                              "angelptm.checkpoints.export CHECKPOINT OUT.safetensors` instead")
    if record["library"] == architecture.TRANSFORMERS:
        return _transformers_files(record, state, aliases)
    if record["moe_enabled"]:
        raise CheckpointError("moe.enabled: our GPT with mixture-of-experts blocks has no Hugging Face class to load "
                              "into; export the weights with `python -m angelptm.checkpoints.export CHECKPOINT "
                              "OUT.safetensors`")
    config = ModelConfig(**json.loads(record["config_json"]))
    hf_config, out = _llama_files(config, state) if config.flavour == "llama" else _gpt2_files(config, state)
    _token_ids_inside(hf_config, config.vocab_size, eos_token_id)
    return hf_config, out


def _token_ids_inside(config: Any, vocab_size: int, eos_token_id: int | None) -> None:
    """Special-token ids inside the vocabulary: the run's end-of-text id when known; else the class's defaults
    that fall outside it (GPT2Config's 50256 in a 4096-token model: ``generate()`` would never stop) are left out."""
    if eos_token_id is not None:
        if not 0 <= eos_token_id < vocab_size:
            raise CheckpointError(f"eos_token_id {eos_token_id} is outside the model's vocabulary (model.vocab_size "
                                  f"{vocab_size}: ids 0-{vocab_size - 1}); give the end-of-text id of the tokenizer "
                                  "the run used")
        config.bos_token_id = config.eos_token_id = eos_token_id
        return
    for name in ("bos_token_id", "eos_token_id"):
        value = getattr(config, name, None)
        if value is not None and not 0 <= value < vocab_size:
            setattr(config, name, None)
            logger.warning("%s %d (the %s default) is outside this model's %d-token vocabulary: left out of "
                           "config.json; set it to your tokenizer's end-of-text id before generate()", name, value,
                           type(config).__name__, vocab_size)


def _transformers_files(record: dict[str, Any], state: dict[str, torch.Tensor],
                        aliases: dict[str, str]) -> tuple[Any, dict[str, torch.Tensor]]:
    from transformers import CONFIG_MAPPING

    values = json.loads(record["config_json"])
    model_type = values.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise CheckpointError(f"the checkpoint's model_type {model_type!r} is not registered with this transformers "
                              "install (a custom model: register it with AutoConfig.register, or upgrade "
                              "transformers)")
    config = CONFIG_MAPPING[model_type].from_dict(values)
    config.architectures = [record["class_name"]]
    # Tied weights appear under each name; save_pretrained keeps one (from_pretrained ties the other back).
    return config, {key: value for key, value in state.items() if aliases.get(key, key) == key}


def _refuse(config: ModelConfig, hf_class: str, needs: dict[str, Any]) -> None:
    for option, value in needs.items():
        if getattr(config, option) != value:
            wanted = ", ".join(f"model.{k}={v!r}" for k, v in needs.items())
            raise CheckpointError(
                f"model.{option}={getattr(config, option)!r} has no Hugging Face equivalent for flavour "
                f"{config.flavour!r}: {hf_class} needs {wanted}. Export the weights with `python -m "
                "angelptm.checkpoints.export CHECKPOINT OUT.safetensors` and load them into "
                "angelptm.pretraining.models.GPT instead")


def _llama_files(c: ModelConfig, state: dict[str, torch.Tensor]) -> tuple[Any, dict[str, torch.Tensor]]:
    from transformers import LlamaConfig

    _refuse(c, "LlamaForCausalLM", {"position": "rotary", "norm": "rmsnorm", "mlp": "swiglu"})
    config = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.ffn_hidden_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, max_position_embeddings=c.max_seq_len, rms_norm_eps=c.norm_eps, rope_theta=c.rope_theta,
        hidden_act="silu", attention_bias=c.bias, mlp_bias=c.bias, attention_dropout=c.dropout,
        tie_word_embeddings=c.tie_embeddings, initializer_range=c.init_std, architectures=["LlamaForCausalLM"])
    q_width, kv_width = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    out = {"model.embed_tokens.weight": state["tok_emb.weight"], "model.norm.weight": state["norm_f.weight"]}
    if not c.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    for i in range(c.num_layers):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        out[theirs + "input_layernorm.weight"] = state[ours + "norm1.weight"]
        out[theirs + "post_attention_layernorm.weight"] = state[ours + "norm2.weight"]
        for kind in ("weight", "bias") if c.bias else ("weight",):
            q, k, v = state[f"{ours}attn.qkv.{kind}"].split((q_width, kv_width, kv_width))
            gate, up = state[f"{ours}mlp.fc.{kind}"].chunk(2)
            out.update({f"{theirs}self_attn.q_proj.{kind}": q, f"{theirs}self_attn.k_proj.{kind}": k,
                        f"{theirs}self_attn.v_proj.{kind}": v,
                        f"{theirs}self_attn.o_proj.{kind}": state[f"{ours}attn.proj.{kind}"],
                        f"{theirs}mlp.gate_proj.{kind}": gate, f"{theirs}mlp.up_proj.{kind}": up,
                        f"{theirs}mlp.down_proj.{kind}": state[f"{ours}mlp.proj.{kind}"]})
    return config, out


def _gpt2_files(c: ModelConfig, state: dict[str, torch.Tensor]) -> tuple[Any, dict[str, torch.Tensor]]:
    from transformers import GPT2Config

    _refuse(c, "GPT2LMHeadModel", {"position": "learned", "norm": "layernorm", "mlp": "gelu", "bias": True,
                                   "num_kv_heads": c.num_heads})
    config = GPT2Config(
        vocab_size=c.vocab_size, n_positions=c.max_seq_len, n_embd=c.hidden_size, n_layer=c.num_layers,
        n_head=c.num_heads, n_inner=c.ffn_hidden_size, activation_function="gelu_new",  # tanh approximation
        resid_pdrop=c.dropout, embd_pdrop=c.dropout, attn_pdrop=c.dropout, layer_norm_epsilon=c.norm_eps,
        initializer_range=c.init_std, tie_word_embeddings=c.tie_embeddings, architectures=["GPT2LMHeadModel"])
    out = {"transformer.wte.weight": state["tok_emb.weight"], "transformer.wpe.weight": state["pos_emb.weight"],
           "transformer.ln_f.weight": state["norm_f.weight"], "transformer.ln_f.bias": state["norm_f.bias"]}
    if not c.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    # GPT-2's Conv1D stores [in, out]: our nn.Linear weights transposed.
    linears = {"attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj", "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}
    for i in range(c.num_layers):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        for norm, ln in (("norm1", "ln_1"), ("norm2", "ln_2")):
            out.update({f"{theirs}{ln}.{kind}": state[f"{ours}{norm}.{kind}"] for kind in ("weight", "bias")})
        for our_name, their_name in linears.items():
            out[f"{theirs}{their_name}.weight"] = state[f"{ours}{our_name}.weight"].t()
            out[f"{theirs}{their_name}.bias"] = state[f"{ours}{our_name}.bias"]
    return config, out


def write_pretrained(out_dir: str | Path, config: Any, state: dict[str, torch.Tensor], *,
                     max_shard_size: int | str = "5GB") -> list[str]:
    """Write ``config.json`` and the weights as ``from_pretrained`` reads them.

    One ``model.safetensors`` when the weights fit in ``max_shard_size``, else
    ``model-0000i-of-0000n.safetensors`` shards and ``model.safetensors.index.json`` (the
    layout and file names ``save_pretrained`` uses).

    Returns:
        The names of the files written.
    """
    from huggingface_hub import split_torch_state_dict_into_shards

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    split = split_torch_state_dict_into_shards(state, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    for filename, keys in split.filename_to_tensors.items():
        # Copies, one shard at a time: the q/k/v and gate/up slices are views of one tensor, and
        # safetensors refuses tensors that share memory.
        tensors = {key: state[key].clone(memory_format=torch.contiguous_format) for key in keys}
        save_safetensors(tensors, out / filename, metadata={"format": "pt"})
    written = ["config.json", *split.filename_to_tensors]
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                 "weight_map": split.tensor_to_filename}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        written.append(INDEX_FILE)
    return written
