"""A user's model under a small GPU's cap: no CUDA out-of-memory where the plan said the model fits.

The model is ``bench/user_models.py``'s GPT written from torch.nn modules (fp32 logits: a 6.9B model's logits and
their gradient take 3.3 GB at micro-batch 8), driven by the ZeRO-Offload JSON a DeepSpeed user has, in its own
process so the 22 GB cap binds it alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_6p9b_written_from_torch_nn_trains_under_a_22gb_cap():
    command = [sys.executable, str(ROOT / "bench/user_workloads.py"), "--child", "nngpt", "6.9b",
               str(ROOT / "bench/configs/zero_offload.json"), "angelptm", "--steps", "4", "--memory-cap", "22GB"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=540)
    results = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and results, done.stderr[-4000:]
    result = json.loads(results[-1].removeprefix("RESULT "))
    assert result["params"] > 6.5e9 and len(result["losses"]) == 4
    assert all(loss == loss and loss < 12 for loss in result["losses"])  # finite, and a language model's
    assert result["peak_gib"] <= 22e9 / 2**30, "the cap held every allocation"
