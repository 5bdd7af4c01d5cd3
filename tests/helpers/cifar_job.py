"""DeepSpeedExamples' ``training/cifar/cifar10_deepspeed.py`` (its CNN, its config, its loop) on one backend.

    python cifar_job.py deepspeed|angelptm OUT.json [--samples N] [--epochs E]

``deepspeed``: real DeepSpeed (CPU: the caller sets DS_ACCELERATOR=cpu and a one-rank launcher environment, as
``cifar10_deepspeed.py`` is started by the ``deepspeed`` launcher). ``angelptm``: ``import angelptm as deepspeed``.
The model, the config (``get_ds_config`` with ``--dtype fp32 --stage 0``) and the loop ``for epoch: for data in
trainloader`` are the example's (seeded: the example is not); the data are random images of CIFAR-10's shape, a
pure function of the index (the stand-in of bench/ds_examples). Writes each step's loss and lr, the labels of each
step's batch (the data order), those of a fresh ``iter()`` after the epochs, the class of the optimizer that steps
the weights, and (to OUT.weights.pt) the final weights.
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


class FakeCifar(torch.utils.data.Dataset):
    """Random 3x32x32 images in [-1, 1] (the example's Normalize(0.5, 0.5) of [0, 1]) and labels, per index."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        generator = torch.Generator().manual_seed(index)
        image = torch.rand(3, 32, 32, generator=generator)
        target = int(torch.randint(0, 10, (1,), generator=generator))
        return (image - 0.5) / 0.5, target


class Net(nn.Module):
    """The example's CNN (``--moe`` off)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def ds_config() -> dict:
    """``get_ds_config`` of cifar10_deepspeed.py with ``--dtype fp32 --stage 0``, verbatim."""
    return {
        "train_batch_size": 16,
        "steps_per_print": 2000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                 "weight_decay": 3e-7}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                     "warmup_num_steps": 1000}},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": False},
        "fp16": {"enabled": False, "fp16_master_weights_and_grads": False, "loss_scale": 0,
                 "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 15},
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": 0, "allgather_partitions": True, "reduce_scatter": True,
                              "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000,
                              "overlap_comm": True, "contiguous_gradients": True, "cpu_offload": False},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("backend", choices=("deepspeed", "angelptm"))
    parser.add_argument("out")
    parser.add_argument("--samples", type=int, default=320)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    deepspeed = importlib.import_module(args.backend)  # `import X as deepspeed`
    if args.backend == "deepspeed":  # gloo alone: no JIT build of DeepSpeed's CPU shared-memory all-reduce
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed()
    torch.manual_seed(0)
    net = Net()
    engine, _, trainloader, _ = deepspeed.initialize(
        model=net, model_parameters=filter(lambda p: p.requires_grad, net.parameters()),
        training_data=FakeCifar(args.samples), config=ds_config())
    criterion = nn.CrossEntropyLoss()
    losses, labels, lrs = [], [], []
    for _ in range(args.epochs):
        for data in trainloader:
            outputs = engine(data[0])
            loss = criterion(outputs, data[1])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            labels.append(data[1].tolist())
            lrs.append(engine.get_lr()[0])
    # A fresh iter() after the epochs: DeepSpeed's loader starts the epoch over.
    fresh = next(iter(trainloader))[1].tolist()
    torch.save({name: p.detach().clone() for name, p in net.named_parameters()}, f"{args.out}.weights.pt")
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    Path(args.out).write_text(json.dumps({"losses": losses, "labels": labels, "lrs": lrs, "fresh": fresh,
                                          "optimizer": type(inner).__name__}))


if __name__ == "__main__":
    main()
