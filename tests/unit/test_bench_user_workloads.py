"""The users' workloads bench (bench/user_workloads.py) on CPU at its tiny size: the harness the BENCHMARKS.md
tables come from runs a user's script on a DeepSpeed NVMe JSON and reports its disk bytes; between runs it
removes what a run left in the swap directories (a run ends with os._exit: DeepSpeed's swap files stay)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def user_workloads():
    spec = importlib.util.spec_from_file_location("user_workloads", ROOT / "bench/user_workloads.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_nvme_json_runs_and_reports_disk_bytes(tmp_path):
    swap = tmp_path / "swap"
    swap.mkdir()
    (swap / "a_file_of_someone_else").write_text("kept")
    nvme_paths = [f"--set=zero_optimization.{offload}.nvme_path={swap}" for offload in ("offload_param",
                                                                                       "offload_optimizer")]
    done = subprocess.run([sys.executable, str(ROOT / "bench/user_workloads.py"), "--sizes", "tiny", "--engines",
                           "angelptm", "--anchor", "angelptm", "--steps", "3", "--tuning-steps", "0", "--configs",
                           str(ROOT / "bench/configs/zero_infinity_nvme.json"), *nvme_paths],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    header, _, row = done.stdout.strip().splitlines()[-3:]
    assert "disk read / written GiB per step" in header
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[:4] == ["nngpt", "tiny", "zero_infinity_nvme", "angelptm"] and cells[9] == "1.00x"
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
    assert cells[-1] == f"{result['disk_read_gib']:.2f} / {result['disk_written_gib']:.2f}"  # the steps' mean
    assert "step 2" in done.stdout and "disk read" in done.stdout  # each step's line
    assert "pending work after the last step" in done.stdout
    norms = result["grad_norms"]  # each step's global norm, as the engine computed it (whether it clipped)
    assert len(norms) == 3 and all(norm > 0 for norm in norms)
    assert float(cells[6]) == pytest.approx(result["mean_step_s"], abs=1e-3)
    assert sorted(p.name for p in swap.iterdir()) == ["a_file_of_someone_else"]


def test_a_failed_run_keeps_the_others_rows_and_makes_the_bench_exit_non_zero(tmp_path):
    """Two configs, one refused by the engine (an unknown ZeRO stage): the other's row is printed, the failure is
    named, and the bench exits non-zero, so a script running it sees that a row is missing."""
    refused = json.loads((ROOT / "bench/configs/zero_offload.json").read_text())
    refused["zero_optimization"]["stage"] = 7
    (tmp_path / "refused.json").write_text(json.dumps(refused))
    done = subprocess.run([sys.executable, str(ROOT / "bench/user_workloads.py"), "--sizes", "tiny", "--engines",
                           "angelptm", "--anchor", "angelptm", "--steps", "2", "--tuning-steps", "0", "--configs",
                           str(tmp_path / "refused.json"), str(ROOT / "bench/configs/zero_offload.json")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "nngpt tiny refused angelptm: failed (exit 1)" in done.stdout
    assert "1 run(s) failed" in done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| nngpt")]
    assert len(rows) == 1 and "| zero_offload |" in rows[0]


def test_what_a_run_leaves_in_the_swap_directories_of_its_edited_config_is_removed(tmp_path):
    bench = user_workloads()
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    for directory in (ours, theirs):
        directory.mkdir()
        (directory / "there_before").write_text("kept")
    config_path = tmp_path / "config.json"
    config_path.write_text((ROOT / "bench/configs/zero_infinity_nvme.json").read_text())
    config = bench.edited_config(str(config_path), [f"zero_optimization.offload_param.nvme_path={ours}",
                                                    f"deepspeed:zero_optimization.offload_optimizer.nvme_path={theirs}",
                                                    "angelptm:zero_cache.host_memory_budget=32GiB"], "deepspeed")
    assert "zero_cache" not in config  # another engine's edit
    dirs = bench.swap_dirs(config)
    assert dirs == {ours, theirs}
    before = bench.entries(dirs)
    (ours / "zero_stage_3").mkdir()
    (ours / "zero_stage_3" / "params.swp").write_bytes(b"x" * 4096)
    (theirs / "optimizer.swp").write_bytes(b"x" * 4096)
    bench.remove_new_entries(dirs, before)
    assert [sorted(p.name for p in d.iterdir()) for d in (ours, theirs)] == [["there_before"], ["there_before"]]


def test_the_mean_step_counts_the_work_the_last_step_left_pending():
    """Steps that hand their host updates to the next one alternate short and long (4.4B on NVMe: 0.55, 25.5,
    57.6, 0.53 s): the median takes one of them, the mean of the last steps with the drained work is what a step
    costs; the disk bytes per step count the drained ones too."""
    bench = user_workloads()
    times, gib = [30.0, 0.55, 25.5, 57.6, 0.53, 0.6, 26.0], 2**30
    disk = [(0, 0), (0, 0), (24 * gib, 20 * gib), (53 * gib, 52 * gib), (0, 0), (0, 0), (25 * gib, 21 * gib)]
    config = {"train_micro_batch_size_per_gpu": 8}
    result = bench.timings("nngpt", "tiny", "angelptm", 10**6, times, [1.0] * 7, disk, (24.0, (30 * gib, 28 * gib)),
                           config)
    last = times[-4:]  # (the last steps past warm-up: min(5, 7 - 3))
    assert result["step_s"] == pytest.approx(sorted(last)[1:3][0] / 2 + sorted(last)[1:3][1] / 2)
    assert result["mean_step_s"] == pytest.approx((sum(last) + 24.0) / 4)
    assert result["disk_read_gib"] == pytest.approx((53 + 25 + 30) / 4)
    assert result["disk_written_gib"] == pytest.approx((52 + 21 + 28) / 4)


def test_the_measured_window_holds_its_own_steps_work_and_no_earlier_ones(monkeypatch):
    """A step that leaves its host work (10 s, 5 GiB of disk) to the next one: the mean of the measured steps with
    the drain is what a step costs (1 s of its own and 10 s of host work) only if the work pending before the window
    is drained first, untimed (at 11.7B on NVMe the last step with the drain held two steps' work)."""
    import torch

    bench = user_workloads()
    clock, disk, pending = [0.0], [0], [0.0]

    def finish() -> None:  # the previous step's host work: its time, and 5 GiB of disk per 10 s
        clock[0] += pending[0]
        disk[0] += int(pending[0] / 10 * 5 * 2**30)
        pending[0] = 0.0

    def step(ids, index):
        finish()
        clock[0] += 1.0
        pending[0] = 10.0
        return torch.tensor(1.0)

    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(bench, "disk_bytes", lambda: (disk[0], 0))
    steps = 7
    times, _, _, drained = bench.timed_steps(step, steps, {"train_micro_batch_size_per_gpu": 1}, "tiny",
                                             torch.device("cpu"), "fake", drain=finish)
    window = bench.measured_steps(steps)
    assert window == 4 and times[:-window] == [1.0] + [11.0] * (steps - window - 1)
    assert times[-window] == 1.0  # the work of the step before the window was drained, untimed
    result = bench.timings("nngpt", "tiny", "angelptm", 10**6, times, [1.0] * steps, [(0, 0)] * steps, drained,
                           {"train_micro_batch_size_per_gpu": 1}, drained_before=True)
    assert result["mean_step_s"] == pytest.approx(11.0) and result["step_s"] == pytest.approx(11.0)
    assert drained[1][0] == 5 * 2**30
    # 5 steps measure the last 2, the first of which found nothing pending: the s/step is the mean, not 6 s.
    pending[0] = 0.0
    times, _, _, drained = bench.timed_steps(step, 5, {"train_micro_batch_size_per_gpu": 1}, "tiny",
                                             torch.device("cpu"), "fake", drain=finish)
    result = bench.timings("nngpt", "tiny", "angelptm", 10**6, times, [1.0] * 5, [(0, 0)] * 5, drained,
                           {"train_micro_batch_size_per_gpu": 1}, drained_before=True)
    assert times[-2:] == [1.0, 11.0] and result["step_s"] == pytest.approx(11.0)
