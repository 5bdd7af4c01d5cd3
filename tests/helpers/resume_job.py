"""Train a tiny GPT for some steps through the engine, optionally resuming first; dump the final state.

Run as a script (a fresh process, as a resumed job would be):
    python tests/helpers/resume_job.py --data PREFIX --precision bf16 --steps 4 --save-dir D [--load] --out FILE
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import angelptm  # noqa: E402
from angelptm.pretraining.data import TokenDataset, repeat_batches  # noqa: E402
from angelptm.pretraining.models import ModelConfig, build_model  # noqa: E402

SEQ = 16


def config(precision: str, total_steps: int) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"total_num_steps": total_steps, "warmup_num_steps": 2, "warmup_max_lr": 2e-3}},
        "gradient_clipping": 1.0,
        "seed": 7,
        "steps_per_print": 1000,
    }
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 3}
    elif precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--total-steps", type=int, default=8)
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--load", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=64, max_seq_len=SEQ, num_layers=2, hidden_size=32, num_heads=4,
                                    dropout=0.1))
    engine, optimizer, loader, scheduler = angelptm.initialize(
        model=model, training_data=TokenDataset(args.data, SEQ), config=config(args.precision, args.total_steps))
    if args.load:
        path, client = engine.load_checkpoint(args.save_dir)
        assert path is not None and client == {"note": "hello"}, (path, client)
    batches = repeat_batches(loader)
    losses = []
    for _ in range(args.steps * engine.gradient_accumulation_steps()):
        loss = engine(**next(batches))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.save_checkpoint(args.save_dir, client_state={"note": "hello"})
    torch.save({
        "losses": losses, "masters": optimizer.master_state_dict(), "optimizer": optimizer.optimizer.state_dict(),
        "module": engine.module.state_dict(), "lr": engine.get_lr(), "loss_scale": engine.loss_scale,
        "global_steps": engine.global_steps, "data": loader.state_dict(), "rng": torch.get_rng_state(),
    }, args.out)


if __name__ == "__main__":
    main()
