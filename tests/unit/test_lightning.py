"""Lightning's DeepSpeedStrategy on angelptm (``import angelptm.integrations.lightning``) against real DeepSpeed.

Lightning's strategy requires CUDA; on the CPU, ``bench/lightning_deepspeed.py --cpu`` runs the same script with
only the strategy's CUDA checks skipped (its GPU run is the benchmark's). Each backend runs in its own process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")
pytest.importorskip("deepspeed")

ROOT = Path(__file__).resolve().parents[2]


def test_stage3_offload_losses_equal_deepspeeds_on_the_cpu(tmp_path) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "lightning_deepspeed.py"), str(tmp_path), "--cpu",
                           "--steps", "3", "--cases", "stage3_offload"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MASTER_PORT": str(32000 + os.getpid() % 900)})
    logs = "".join(path.read_text()[-2000:] for path in tmp_path.glob("*.log"))
    assert done.returncode == 0, done.stdout + logs
    theirs = json.loads((tmp_path / "deepspeed_stage3_offload.json").read_text())["losses"]
    ours = json.loads((tmp_path / "angelptm_stage3_offload.json").read_text())["losses"]
    assert len(ours) == len(theirs) == 3 and theirs[-1] < theirs[0] - 0.1  # it learns, so agreement means something
    assert max(abs(a - b) for a, b in zip(ours, theirs)) <= 1e-5
