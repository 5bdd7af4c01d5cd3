"""Lightning's ``DeepSpeedStrategy`` on real DeepSpeed and on angelptm (``import angelptm.integrations.lightning``):
per-step losses of the same script, ZeRO stage 2, stage 3, and stage 3 with optimizer and params offloaded.

    python bench/lightning_deepspeed.py OUT_DIR [--steps 8] [--cases stage2,stage3,stage3_offload] [--cpu]

Each (backend, case) runs in a process of its own (the switch is process-wide, and DeepSpeed keeps state); the
script under test is :func:`train` and is the same for both; only the first import differs. It trains a small
GPT-like ``LightningModule`` (embedding, two pre-LayerNorm MLP blocks, untied head, biases) on fixed random
tokens in fp32 (the config says ``bf16: false``, so neither engine picks its own precision), 1 GPU, micro-batch
8, clipping 1.0, torch ``AdamW`` (``zero_force_ds_cpu_optimizer: false``: DeepSpeed would otherwise require its
``DeepSpeedCPUAdam`` with offload). Writes ``OUT_DIR/{backend}_{case}.json`` (losses per step) and
``OUT_DIR/summary.txt``; prints per-step losses and whether they agree (max |difference| <= 1e-5).

``--cpu`` runs Lightning's CPU accelerator with the strategy's CUDA checks skipped (a subclass overrides
``setup_environment`` and ``setup_distributed``): a smoke test of the same path on a machine without a GPU, not
what Lightning supports.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = {"stage2": (2, False), "stage3": (3, False), "stage3_offload": (3, True)}
VOCAB, SEQ, WIDTH, MICRO = 512, 64, 256, 8


def ds_config(stage: int, offload: bool) -> dict:
    zero: dict = {"stage": stage}
    if offload:
        zero.update({"offload_optimizer": {"device": "cpu", "pin_memory": True},
                     "offload_param": {"device": "cpu", "pin_memory": True}})
    return {"zero_optimization": zero, "bf16": {"enabled": False}, "fp16": {"enabled": False},
            "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False}


def train(case: str, steps: int, cpu: bool) -> list[float]:
    """The Lightning script under test: a LightningModule, a Trainer with DeepSpeedStrategy, ``fit``."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.strategies import DeepSpeedStrategy
    from torch import nn

    class TinyGPT(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, WIDTH)
            self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(),
                                                      nn.Linear(4 * WIDTH, WIDTH)) for _ in range(2))
            self.head = nn.Linear(WIDTH, VOCAB)
            self.losses: list[float] = []

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            hidden = self.embed(ids)
            for block in self.blocks:
                hidden = hidden + block(hidden)
            return self.head(hidden)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            logits = self(batch[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)

    class CPUDeepSpeedStrategy(DeepSpeedStrategy):
        """Skips the strategy's CUDA checks, nothing else (see the module docstring)."""

        def setup_environment(self) -> None:
            super(DeepSpeedStrategy, self).setup_environment()

        def setup_distributed(self) -> None:  # as DeepSpeedStrategy's, less its GPU-index check
            from lightning.fabric.utilities.seed import reset_seed

            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()

        @property
        def root_device(self) -> torch.device:  # DeepSpeed reads its index as the device rank
            return torch.device("cpu", 0)

    generator = torch.Generator().manual_seed(1)
    data = torch.randint(0, VOCAB, (steps * MICRO, SEQ + 1), generator=generator)
    data[:, 1::2] = data[:, :-1:2]  # learnable: every odd token repeats the one before it
    loader = torch.utils.data.DataLoader(data, batch_size=MICRO, shuffle=False)
    pl.seed_everything(0, workers=True)
    stage, offload = CASES[case]
    strategy_class = CPUDeepSpeedStrategy if cpu else DeepSpeedStrategy
    trainer = pl.Trainer(accelerator="cpu" if cpu else "gpu", devices=1, max_steps=steps, precision="32-true",
                         strategy=strategy_class(config=ds_config(stage, offload)), gradient_clip_val=1.0,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    with trainer.init_module():
        model = TinyGPT()
    trainer.fit(model, loader)
    return model.losses


def job(backend: str, case: str, steps: int, cpu: bool, out: Path) -> None:
    if backend == "angelptm":
        import angelptm.integrations.lightning  # noqa: F401  (the switch)
    out.write_text(json.dumps({"backend": backend, "case": case, "losses": train(case, steps, cpu)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--job", nargs=2, metavar=("BACKEND", "CASE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.job:
        backend, case = args.job
        job(backend, case, args.steps, args.cpu, args.out_dir / f"{backend}_{case}.json")
        return
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    if args.cpu:
        env.update({"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""})
    lines, agree_all = [], True
    for case in args.cases.split(","):
        losses = {}
        for backend in ("deepspeed", "angelptm"):
            log = args.out_dir / f"{backend}_{case}.log"
            command = [sys.executable, __file__, str(args.out_dir), "--steps", str(args.steps), "--job", backend, case]
            command += ["--cpu"] if args.cpu else []
            with open(log, "w") as handle:
                done = subprocess.run(command, env=env, stdout=handle, stderr=subprocess.STDOUT, check=False)
            result = args.out_dir / f"{backend}_{case}.json"
            losses[backend] = json.loads(result.read_text())["losses"] if done.returncode == 0 and result.exists() \
                else None
            if losses[backend] is None:
                lines.append(f"{case} {backend}: FAILED (exit {done.returncode}); see {log}")
        if None in losses.values():
            agree_all = False
            continue
        diff = max(abs(a - b) for a, b in zip(losses["deepspeed"], losses["angelptm"]))
        agree = len(losses["deepspeed"]) == len(losses["angelptm"]) == args.steps and diff <= 1e-5
        agree_all &= agree
        lines.append(f"{case}: {'EQUAL' if agree else 'DIFFERENT'} (max |diff| {diff:.2e} over {args.steps} steps)")
        for step, (theirs, ours) in enumerate(zip(losses["deepspeed"], losses["angelptm"]), 1):
            lines.append(f"  step {step}: deepspeed {theirs:.6f}  angelptm {ours:.6f}")
    lines.append(f"all cases equal: {agree_all}")
    (args.out_dir / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    sys.exit(0 if agree_all else 1)


if __name__ == "__main__":
    main()
