"""``python -m angelptm.checkpoints.export --hf``: checkpoints written as save_pretrained directories (CPU, fp32)."""

from __future__ import annotations

import json

import pytest
import torch

import angelptm
from angelptm.checkpoints import export, hf_export
from angelptm.errors import CheckpointError
from angelptm.pretraining.models import ModelConfig, build_model

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 64, 16


def trained_checkpoint(model: torch.nn.Module, save_dir) -> angelptm.Engine:
    """Two fp32 AdamW steps (so the weights are not the initial ones), then a checkpoint."""
    engine, _, _, _ = angelptm.initialize(model=model, config={
        "train_batch_size": 2, "bf16": {"enabled": False}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out if isinstance(out, torch.Tensor) else out.loss)
        engine.step()
    engine.save_checkpoint(save_dir)
    return engine


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model.eval()(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


@pytest.mark.parametrize("flavour, options", [
    ("llama", {}),
    ("llama", {"num_kv_heads": 2, "tie_embeddings": False, "bias": True, "norm_eps": 1e-6, "rope_theta": 500.0}),
    ("gpt2", {}),
])
def test_our_gpt_loads_into_the_hf_class_with_equal_logits(tmp_path, flavour, options):
    torch.manual_seed(0)
    config = ModelConfig(flavour=flavour, vocab_size=VOCAB, max_seq_len=SEQ, num_layers=2, hidden_size=32,
                         num_heads=4, **options)
    engine = trained_checkpoint(build_model(config), tmp_path / "ckpt")
    assert export.main([str(tmp_path / "ckpt"), "--hf", str(tmp_path / "hf"), "--max-shard-size", "20000"]) == 0
    index = json.loads((tmp_path / "hf" / hf_export.INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 1, "a small max_shard_size must shard"
    hf_class = transformers.LlamaForCausalLM if flavour == "llama" else transformers.GPT2LMHeadModel
    loaded = hf_class.from_pretrained(tmp_path / "hf")
    ids = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(1))
    ours = logits(engine.module, ids)
    assert ours.abs().max() > 0.1
    torch.testing.assert_close(logits(loaded, ids), ours, rtol=0, atol=1e-5)


def test_a_transformers_model_trained_on_the_engine_exports_under_its_own_names(tmp_path):
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                      tie_word_embeddings=True)
    engine = trained_checkpoint(transformers.Qwen2ForCausalLM(config), tmp_path / "ckpt")
    written = export.export_hf(tmp_path / "ckpt", tmp_path / "hf")
    assert written == ["config.json", "model.safetensors"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(loaded).__name__ == "Qwen2ForCausalLM"
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(logits(loaded, ids), logits(engine.module, ids), rtol=0, atol=1e-5)


@pytest.mark.parametrize("options, option", [
    ({"flavour": "llama", "norm": "layernorm"}, "model.norm='layernorm'"),
    ({"flavour": "gpt2", "position": "rotary"}, "model.position='rotary'"),
])
def test_a_flavour_without_hf_equivalent_is_refused_naming_the_option(tmp_path, options, option):
    model = build_model(ModelConfig(vocab_size=VOCAB, max_seq_len=SEQ, num_layers=1, hidden_size=32, num_heads=4,
                                    **options))
    trained_checkpoint(model, tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match=option.replace("(", r"\(")):
        export.export_hf(tmp_path / "ckpt", tmp_path / "hf")
    assert not (tmp_path / "hf").exists(), "nothing is written for a refused model"
    assert export.main([str(tmp_path / "ckpt"), "--hf", str(tmp_path / "hf")]) == 1


def test_a_module_of_unknown_kind_is_refused_with_the_way_out(tmp_path):
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB))
    engine, _, _, _ = angelptm.initialize(model=model, config={"train_batch_size": 1, "bf16": {"enabled": False}})
    engine.save_checkpoint(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="records no model architecture.*OUT.safetensors"):
        export.export_hf(tmp_path / "ckpt", tmp_path / "hf")
