"""Two checkpoints compared bit for bit (the background-save and streamed-save tests)."""

from __future__ import annotations

from pathlib import Path

import torch

from angelptm.checkpoints import files as checkpoint


def load_states(path: Path) -> tuple[dict, dict]:
    """A checkpoint directory's model and optimizer files, as torch reads them."""
    return (torch.load(path / checkpoint.MODEL_FILE, weights_only=True),
            torch.load(path / checkpoint.OPTIM_FILE, weights_only=True))


def assert_equal(a, b, where: str = "") -> None:
    """Equal structure, and tensors equal bit for bit (dtype and shape too)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert sorted(a, key=str) == sorted(b, key=str), where
        for key in a:
            assert_equal(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)
