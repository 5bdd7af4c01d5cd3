"""The users' workloads bench (bench/user_workloads.py) on CPU at its tiny size: the harness the BENCHMARKS.md
tables come from runs a user's script on a DeepSpeed NVMe JSON and reports its disk bytes; between runs it
removes what a run left in the swap directories (a run ends with os._exit: DeepSpeed's swap files stay)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from launch import load_script

ROOT = Path(__file__).resolve().parents[2]


def user_workloads():
    return load_script("bench/user_workloads.py")


def test_the_nvme_json_runs_and_reports_disk_bytes(tmp_path):
    swap = tmp_path / "swap"
    swap.mkdir()
    (swap / "a_file_of_someone_else").write_text("kept")
    nvme_paths = [f"--set=zero_optimization.{offload}.nvme_path={swap}" for offload in ("offload_param",
                                                                                       "offload_optimizer")]
    done = subprocess.run([sys.executable, str(ROOT / "bench/user_workloads.py"), "--sizes", "tiny", "--engines",
                           "angelptm", "--anchor", "angelptm", "--steps", "3", "--warmup-steps", "0",
                           "--tuning-steps", "0",
                           "--configs", str(ROOT / "bench/configs/zero_infinity_nvme.json"), *nvme_paths,
                           "--set", "gradient_clipping=0.01", "--require-clip"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    header, _, row = done.stdout.strip().splitlines()[-3:]
    assert "disk read / written GiB per step" in header
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[:4] == ["nngpt", "tiny", "zero_infinity_nvme", "angelptm"] and cells[9] == "1.00x"
    assert cells[10] == "3 of 3"  # a clip far under the tiny model's norms: every measured step clipped
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
    assert cells[-1] == f"{result['disk_read_gib']:.2f} / {result['disk_written_gib']:.2f}"  # the steps' mean
    assert "step 2" in done.stdout and "disk read" in done.stdout  # each step's line
    assert "pending work after the last step" in done.stdout
    norms = result["grad_norms"]  # each step's global norm, as the engine computed it (whether it clipped)
    assert len(norms) == 3 and all(norm > 0 for norm in norms)
    assert float(cells[6]) == pytest.approx(result["mean_step_s"], abs=1e-3)
    # the settled plan's host bytes per parameter, and the host tier's peak (the warm-up's included) beside it
    assert 0 < result["host_bytes_per_param_plan"] <= result["host_bytes_per_param_peak"]
    assert sorted(p.name for p in swap.iterdir()) == ["a_file_of_someone_else"]


def test_a_failed_run_keeps_the_others_rows_and_makes_the_bench_exit_non_zero(tmp_path):
    """Two configs, one refused by the engine (an unknown ZeRO stage): the other's row is printed, the failure is
    named, and the bench exits non-zero, so a script running it sees that a row is missing."""
    refused = json.loads((ROOT / "bench/configs/zero_offload.json").read_text())
    refused["zero_optimization"]["stage"] = 7
    (tmp_path / "refused.json").write_text(json.dumps(refused))
    done = subprocess.run([sys.executable, str(ROOT / "bench/user_workloads.py"), "--sizes", "tiny", "--engines",
                           "angelptm", "--anchor", "angelptm", "--steps", "2", "--warmup-steps", "0",
                           "--tuning-steps", "0", "--configs", str(tmp_path / "refused.json"),
                           str(ROOT / "bench/configs/zero_offload.json")],
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
    57.6, 0.53 s): the median takes one of them, the mean of the measured steps with the drained work is what a step
    costs; the disk bytes per step count the drained ones too."""
    bench = user_workloads()
    times, gib = [30.0, 0.55, 25.5, 57.6, 0.53, 0.6, 26.0], 2**30
    disk = [(0, 0), (0, 0), (24 * gib, 20 * gib), (53 * gib, 52 * gib), (0, 0), (0, 0), (25 * gib, 21 * gib)]
    config = {"train_micro_batch_size_per_gpu": 8}
    result = bench.timings("nngpt", "tiny", "angelptm", 10**6, times, [1.0] * 7, disk, (24.0, (30 * gib, 28 * gib)),
                           config, 4)
    last = times[-4:]
    assert result["measured_steps"] == 4 and result["pending_s"] == 24.0
    assert result["step_s"] == pytest.approx(sorted(last)[1:3][0] / 2 + sorted(last)[1:3][1] / 2)
    assert result["mean_step_s"] == pytest.approx((sum(last) + 24.0) / 4)
    assert result["tflops"] / result["mean_tflops"] == pytest.approx(result["mean_step_s"] / result["step_s"])
    assert result["disk_read_gib"] == pytest.approx((53 + 25 + 30) / 4)
    assert result["disk_written_gib"] == pytest.approx((52 + 21 + 28) / 4)


def test_no_work_is_drained_outside_the_clock(monkeypatch):
    """A step that leaves its host work (10 s, 5 GiB of disk) to the next one, as a user's loop meets it: every step
    after the first pays the one before it, the window's first step included (the protocol drains nothing before
    the window), and the work the last step left is drained once, at the end, into the figures."""
    import torch

    bench = user_workloads()
    clock, disk, pending, drains, batches = [0.0], [0], [0.0], [], []

    def finish() -> None:  # the previous step's host work: its time, and 5 GiB of disk per 10 s
        drains.append(clock[0])
        clock[0] += pending[0]
        disk[0] += int(pending[0] / 10 * 5 * 2**30)
        pending[0] = 0.0

    def step(ids, index):
        batches.append(ids)
        clock[0] += pending[0]  # (what the last step queued runs under this one)
        pending[0] = 0.0
        clock[0] += 1.0
        pending[0] = 10.0
        return torch.tensor(1.0)

    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(bench, "disk_bytes", lambda: (disk[0], 0))
    steps, window = 7, 4
    config = {"train_micro_batch_size_per_gpu": 1}
    times, _, _, drained = bench.timed_steps(step, steps, config, "tiny", torch.device("cpu"), "fake", drain=finish)
    assert len(drains) == 1 and times == [1.0] + [11.0] * (steps - 1)  # the drain ran once, after the last step
    assert drained[0] == 10.0 and drained[1][0] == 5 * 2**30
    result = bench.timings("nngpt", "tiny", "angelptm", 10**6, times, [1.0] * steps, [(0, 0)] * steps, drained,
                           config, window)
    assert result["step_s"] == pytest.approx(11.0)
    assert result["mean_step_s"] == pytest.approx((11.0 * window + 10.0) / window)
    assert len({id(ids) for ids in batches}) == steps  # fresh data: a new batch every step
    batches.clear()
    bench.timed_steps(step, 3, config, "tiny", torch.device("cpu"), "fake", data="reused", drain=finish)
    assert len({id(ids) for ids in batches}) == 1
    with pytest.raises(ValueError, match="data 'replayed'"):
        bench.timed_steps(step, 3, config, "tiny", torch.device("cpu"), "fake", data="replayed")


def test_a_clip_row_counts_its_clipped_steps_and_is_refused_when_none_clipped():
    bench = user_workloads()
    norms = [3.7, 1.5, 1.24, 1.02, 0.87, 0.86, None, 0.84]
    # the window: the last 4 steps (one without a norm reported): none above 1.0, so it measured unclipped steps
    counted = bench.clipped_steps(norms, 1.0, 4)
    assert counted == {"clip_threshold": 1.0, "clipped_steps": 0, "norm_range": [0.84, 0.87]}
    why = bench.not_a_clip_row({**counted, "measured_steps": 4})
    assert "none of its 4 measured steps clipped" in why and "0.84-0.87" in why and "threshold 1" in why
    counted = bench.clipped_steps(norms, 1.0, 6)  # two of the last six exceed it
    assert counted["clipped_steps"] == 2 and bench.not_a_clip_row({**counted, "measured_steps": 6}) is None
    assert bench.clipped_steps([5.0, 6.0], 1.0, 2)["clipped_steps"] == 2
    # a norm equal to the threshold does not clip (the factor is min(1, max_norm / norm) = 1)
    assert bench.clipped_steps([1.0], 1.0, 1)["clipped_steps"] == 0
    # no clip configured: nothing to count, and the row is not held to clipping
    unclipped = bench.clipped_steps(norms, 0.0, 4)
    assert unclipped["clipped_steps"] == 0 and bench.not_a_clip_row({**unclipped, "measured_steps": 4}) is None


def test_the_default_init_is_pytorchs_and_the_small_one_gpt2s():
    import torch
    import user_models  # (bench/, on the path through user_workloads)

    user_workloads()
    torch.manual_seed(0)
    small, default = user_models.build("nngpt", "tiny", "small"), user_models.build("nngpt", "tiny", "default")
    assert small.blocks[0].fc.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert small.blocks[0].fc.bias.abs().max().item() == 0.0
    # PyTorch's Linear: Kaiming-uniform, bound 1/sqrt(fan_in) (std 1/sqrt(3 fan_in)); biases uniform in that bound
    fan_in = default.blocks[0].fc.in_features
    assert default.blocks[0].fc.weight.std().item() == pytest.approx((3 * fan_in) ** -0.5, rel=0.1)
    assert default.blocks[0].fc.bias.abs().max().item() > 0.0
    assert default.wte.weight.std().item() == pytest.approx(1.0, rel=0.1)  # nn.Embedding: N(0, 1)
    with pytest.raises(ValueError, match="init 'xavier'"):
        user_models.build("nngpt", "tiny", "xavier")
