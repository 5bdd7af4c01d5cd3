"""Train, save a checkpoint, train on, then die by SIGKILL halfway through writing the next one.

    python tests/helpers/kill_during_save_job.py --save-dir D --out FILE
FILE gets the consolidated weights, optimizer state and step of the first (complete) checkpoint.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from reference import train_on_seeded_tokens as train  # noqa: E402

import angelptm  # noqa: E402
from angelptm.checkpoints import files as checkpoint  # noqa: E402
from angelptm.checkpoints import manifest as checkpoint_manifest  # noqa: E402
from angelptm.pretraining.models import ModelConfig, build_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=64, max_seq_len=16, num_layers=1, hidden_size=32, num_heads=4))
    engine, optimizer, _, _ = angelptm.initialize(model=model, config={
        "train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    train(engine, 2)
    engine.save_checkpoint(args.save_dir)
    torch.save({"module": engine.consolidated_state_dict(), "optimizer": optimizer.optimizer.state_dict(),
                "global_steps": engine.global_steps}, args.out)
    train(engine, 2)
    real_write = checkpoint_manifest._HashingFile.write

    def die_halfway(self, data):  # the optimizer file is the largest: die once part of it is on disk
        written = real_write(self, data)
        if self._handle.name.endswith(checkpoint.OPTIM_FILE) and self.size_bytes > 4096:
            os.kill(os.getpid(), signal.SIGKILL)
        return written

    checkpoint_manifest._HashingFile.write = die_halfway
    engine.save_checkpoint(args.save_dir)
    raise AssertionError("the process should have died while saving")


if __name__ == "__main__":
    main()
