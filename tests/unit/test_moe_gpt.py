"""GPT-MoE: every moe_every-th block is a mixture of experts, the router losses join the LM loss,
activation checkpointing recomputes it exactly, and pretrain.py trains configs/tiny_moe.json."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import torch
from launch import shipped_config

from angelptm.pretraining.models import ModelConfig, build_model
from angelptm.pretraining.models.gpt import Block, MoEBlock
from moe import MoEConfig

ROOT = Path(__file__).resolve().parents[2]
MODEL = dict(vocab_size=64, max_seq_len=16, num_layers=4, hidden_size=32, num_heads=4)


def test_every_other_block_is_moe_and_router_losses_join_the_lm_loss():
    torch.manual_seed(0)
    moe = MoEConfig(enabled=True, num_experts=4, top_k=2, moe_every=2, aux_loss_coef=0.5, z_loss_coef=0.1,
                    drop_tokens=False)
    model = build_model(ModelConfig(flavour="llama", **MODEL), moe=moe)
    assert [type(b) for b in model.blocks] == [Block, MoEBlock, Block, MoEBlock]
    ids = torch.randint(0, 64, (2, 16))
    loss = model(ids, ids)
    logits = model(ids)
    lm = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
    # Rebuild the router losses of both MoE blocks from their inputs.
    x, expected = model.tok_emb(ids), []
    cos, sin = model.rope_cos[:16], model.rope_sin[:16]
    for block in model.blocks:
        if isinstance(block, MoEBlock):
            h = x + block.attn(block.norm1(x), cos, sin)
            routing = block.mlp.router(block.norm2(h).reshape(-1, 32))
            expected.append(0.5 * routing.balance_loss + 0.1 * routing.z_loss)
        x = block(x, cos, sin)[0] if isinstance(block, MoEBlock) else block(x, cos, sin)
    torch.testing.assert_close(loss, lm + sum(expected))
    assert model.moe_stats["expert_counts"].shape == (2, 4)
    assert int(model.moe_stats["expert_counts"].sum()) == 2 * 2 * 32  # 2 layers x k=2 x 32 tokens
    metrics = model.moe_metrics()
    assert metrics["moe_load_max"] >= 1.0 and metrics["moe_router_loss"] > 0
    dense = build_model(ModelConfig(**MODEL))
    assert model.num_active_params() < model.num_params() and dense.num_active_params() == dense.num_params()


def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    moe = MoEConfig(enabled=True, num_experts=4, top_k=2, capacity_factor=1.0, min_capacity=1)
    torch.manual_seed(1)
    plain = build_model(ModelConfig(**MODEL), moe=moe)
    torch.manual_seed(1)
    recompute = build_model(ModelConfig(activation_checkpointing=True, **MODEL), moe=moe)
    ids = torch.randint(0, 64, (3, 16))
    plain(ids, ids).backward()
    recompute(ids, ids).backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), recompute.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)
    assert plain.blocks[1].mlp.experts.w_in_LDF.grad.abs().sum() > 0


def test_pretrain_trains_the_tiny_moe_config(tmp_path):
    config = shipped_config("tiny_moe.json")
    config["model"].update(num_layers=2, max_seq_len=64)
    config["train_micro_batch_size_per_gpu"] = 8
    config["train"].update(steps=10, log_interval=5, save_dir=str(tmp_path / "ckpt"))
    config["data"]["cache_dir"] = str(ROOT / ".cache" / "angelptm")  # tokenize the shipped corpus once
    path = tmp_path / "moe.json"
    path.write_text(json.dumps(config))
    result = subprocess.run([sys.executable, str(ROOT / "pretrain.py"), "--config", str(path)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = re.findall(r"step (\d+)/10 \| loss (\d+\.\d+).*moe_router_loss (\d+\.\d+) \| moe_load_max (\d+\.\d+)",
                       result.stdout + result.stderr)
    assert [int(step) for step, *_ in lines] == [5, 10]
    assert float(lines[-1][1]) < float(lines[0][1])


def test_active_params_do_not_depend_on_how_experts_are_split_over_ranks():
    # num_params() counts this rank's experts only; the active count is of the whole model.
    counts = []
    for ep_size in (1, 2, 4):
        moe = MoEConfig(enabled=True, num_experts=4, top_k=2, ep_size=ep_size)
        counts.append(build_model(ModelConfig(**MODEL), moe=moe).num_active_params())
    assert counts[0] == counts[1] == counts[2]
