"""Shared by the engine tests on CPU and GPU: a tiny GPT, learnable random batches, and a
hand-written mixed-precision AdamW loop to compare the engine against."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from angelptm.pretraining.models import ModelConfig, build_model

SEQ, VOCAB = 16, 64


def tiny_gpt(seed: int, flavour: str = "gpt2") -> nn.Module:
    torch.manual_seed(seed)
    return build_model(ModelConfig(flavour=flavour, vocab_size=VOCAB, max_seq_len=SEQ, num_layers=2,
                                   hidden_size=32, num_heads=4))


def random_batches(seed: int, count: int, batch: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    # Random starts, then a fixed bigram rule with 10% random tokens: fresh inputs that a model can learn.
    for _ in range(count):
        ids = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=generator)
        noise = torch.rand(batch, SEQ + 1, generator=generator) < 0.1
        for t in range(1, SEQ + 1):
            ids[:, t] = torch.where(noise[:, t], ids[:, t], (ids[:, t - 1] * 5 + 3) % VOCAB)
        out.append({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
    return out


class RandomTokens(torch.utils.data.Dataset):
    """``count`` windows of SEQ + 1 tokens drawn once from a seeded generator, identical in every process
    (a stand-in for :class:`angelptm.pretraining.data.TokenDataset`)."""

    seq_len = SEQ

    def __init__(self, seed: int = 0, count: int = 64) -> None:
        self.ids = torch.randint(0, VOCAB, (count, SEQ + 1), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index, :-1], "labels": self.ids[index, 1:]}


def ds_config(**overrides) -> dict:
    """The tests' engine config, no clipping unless ``gradient_clipping`` is overridden; ``overrides`` replace keys."""
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "steps_per_print": 1000,
        # Off, as reference_loop's clip=0.0: a config without the key clips at 1.0 (DeepSpeed's default).
        "gradient_clipping": 0.0,
    }
    config.update(overrides)
    return config


def reference_loop(model: nn.Module, batches: list[dict], *, dtype: torch.dtype, accumulation: int, lr: float,
                   clip: float = 0.0, device: str = "cpu",
                   deepspeed_adam: bool = False) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Hand-written mixed precision: compute-dtype weights, fp32 masters and fp32 gradient sums, torch AdamW (with
    ``deepspeed_adam``: stepped by DeepSpeed's C++ Adam, as the engine steps the config's AdamW on a CPU)."""
    model = model.to(device=device, dtype=dtype)
    params = [p for p in model.parameters()]
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    hypers = dict(lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    if deepspeed_adam:
        from angelptm.engine import deepspeed_cpu_adam

        kernel = deepspeed_cpu_adam.load_kernel(True, hypers["betas"])
        optimizer = deepspeed_cpu_adam.DeepSpeedCpuAdam(masters, kernel, decoupled_weight_decay=True, **hypers)
    else:
        optimizer = torch.optim.AdamW(masters, **hypers)
    losses = []
    for start in range(0, len(batches), accumulation):
        sums = [torch.zeros_like(m) for m in masters]
        for batch in batches[start:start + accumulation]:
            loss = model(**{k: v.to(device) for k, v in batch.items()})
            (loss.float() * (1.0 / accumulation)).backward()
            losses.append(loss.item())
            for total, p in zip(sums, params):
                total += p.grad.float()
                p.grad = None
        for master, total in zip(masters, sums):
            master.grad = total
        norm = torch.linalg.vector_norm(torch.cat([m.grad.flatten() for m in masters])).item()
        if clip and norm > clip:  # clip_grad_norm_'s rule, with the norm taken over all gradients at once
            for master in masters:
                master.grad.mul_(clip / (norm + 1e-6))
        optimizer.step()
        with torch.no_grad():
            for p, master in zip(params, masters):
                p.copy_(master)
    names = [name for name, _ in model.named_parameters()]
    return losses, {name: m.detach() for name, m in zip(names, masters)}


def train_steps(engine, batches: list[dict]) -> list[float]:
    """Forward, backward and step an engine once per batch; returns the losses."""
    losses = []
    for batch in batches:
        loss = engine(**batch)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def end_job() -> None:
    """Leave a finished multi-process job: destroy the process group, flush, and exit at once.

    Now and then (about one run in fifty on the 2-core CI machine, with the replicated and the
    ZeRO-Cache jobs alike) a job whose results were already written aborted in interpreter teardown
    with "terminate called without an active exception": torch's gloo threads were still being torn
    down while the interpreter finalized. Exiting without the finalizer keeps that race out of the
    tests' verdicts; everything the tests check is on disk by then.
    """
    import os
    import sys

    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def assert_masters_close(masters: dict, expected_masters: dict, initial: dict) -> None:
    """All masters together within a tenth of how far training moved them (fused vs foreach Adam, bf16
    rounding). Taken over the whole model: a parameter whose gradient is pure rounding noise (a
    key bias, which softmax ignores) takes steps of random sign, in any two implementations."""
    diff = moved = 0.0
    for name, expected in expected_masters.items():
        start = initial[name].detach().cpu().float()
        moved += (expected.cpu().float() - start).square().sum().item()
        diff += (masters[name] - expected.cpu()).square().sum().item()
    assert diff ** 0.5 < 0.1 * moved ** 0.5, f"masters differ by {diff ** 0.5:.2e} (norm), moved {moved ** 0.5:.2e}"


def train_on_seeded_tokens(engine, steps: int, vocab: int = 64) -> None:
    """``steps`` steps of batch 2 x 16 tokens drawn from a generator seeded by the engine's step (a run resumed
    at step k sees the batches an uninterrupted one saw from step k on)."""
    generator = torch.Generator().manual_seed(engine.global_steps)
    for _ in range(steps):
        ids = torch.randint(0, vocab, (2, 17), generator=generator)
        engine.backward(engine(input_ids=ids[:, :-1], labels=ids[:, 1:]))
        engine.step()


def open_files_under(directory: Path) -> int:
    """This process's descriptors of files under ``directory`` (a nameless swap file shows as "<dir>/#n (deleted)")."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith(str(directory))
        except OSError:
            continue
    return count
