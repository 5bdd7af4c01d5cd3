"""Tracebacks where one line is due (issue 29, point 6): pretrain.py ends these with one ``error:`` line."""

from __future__ import annotations

import errno
import json
import os
import random
import sys
from pathlib import Path

import pytest

from zero_cache.storage.tiers import TierFullError

ROOT = Path(__file__).resolve().parents[2]
SMALL_MODEL = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "vocab_size": 512}


def run(tmp_path: Path, capsys, config: dict, *args: str) -> tuple[int, str]:
    sys.path.insert(0, str(ROOT))
    import pretrain as job

    path = tmp_path / f"cfg{random.randrange(1 << 30)}.json"
    path.write_text(json.dumps(config) if isinstance(config, dict) else config)
    code = job.main(["--config", str(path), "--save-dir", str(tmp_path / "run"), *args])
    return code, capsys.readouterr().err.strip()


def assert_one_line(err: str) -> str:
    line = err.splitlines()[-1]
    assert line.startswith("error: ") and "Traceback" not in err
    return line


@pytest.mark.parametrize("plan", [True, False])
def test_a_chunk_size_below_the_largest_parameter_is_one_line(tmp_path, capsys, plan):
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": False},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_cache": {"enabled": True, "chunk_size": 4096}, "model": SMALL_MODEL}
    code, err = run(tmp_path, capsys, config, *(["--plan"] if plan else []))
    assert code == 2
    assert "tok_emb.weight has 32,768 elements, more than chunk_size=4,096" in assert_one_line(err)


def test_lr_nan_names_the_key(tmp_path, capsys):
    code, err = run(tmp_path, capsys, '{"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": NaN}}}')
    assert code == 2 and "optimizer.params.lr: NaN is not a usable value" in err and "Traceback" not in err


@pytest.mark.parametrize("error, expected", [
    (TierFullError("host tier: allocating 4.00 MiB exceeds its budget (1.00 MiB of 2.00 MiB in use)"),
     "error: host tier: allocating 4.00 MiB exceeds its budget (1.00 MiB of 2.00 MiB in use). The plan should have"),
    (OSError(errno.ENOSPC, "writing the NVMe tier's swap file failed: " + os.strerror(errno.ENOSPC), "/nvme/x.swap"),
     "error: no space left on the disk holding /nvme/x.swap (writing the NVMe tier's swap file failed: No space "
     "left on device). Free space there, lower zero_cache.nvme_memory_budget"),
])
def test_a_full_tier_or_disk_mid_run_is_one_line(tmp_path, capsys, monkeypatch, error, expected):
    sys.path.insert(0, str(ROOT))
    import pretrain as job

    def fails(*args, **kwargs):
        raise error

    monkeypatch.setattr(job, "_train", fails)
    code, err = run(tmp_path, capsys, {"train_batch_size": 2})
    assert code == 2 and assert_one_line(err).startswith(expected)


def test_a_bug_keeps_its_traceback(tmp_path, capsys, monkeypatch):
    sys.path.insert(0, str(ROOT))
    import pretrain as job

    def fails(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(job, "_train", fails)
    with pytest.raises(KeyError):
        run(tmp_path, capsys, {"train_batch_size": 2})
