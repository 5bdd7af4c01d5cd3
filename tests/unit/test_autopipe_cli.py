"""AutoPipe's timeline simulation, its CLI, and the pipeline's batch resolution in the config loader."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from angelptm.config import load_config
from angelptm.errors import ConfigError
from autopipe import cli
from autopipe.cost import CostChain, CostSettings
from autopipe.profile import OpRecord, Profile
from autopipe.search import predict
from autopipe.timeline import simulate, stage_order


def test_stage_order_of_1f1b_and_gpipe():
    assert stage_order(0, 2, 3, "1f1b") == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]
    assert stage_order(1, 2, 3, "1f1b") == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    assert stage_order(0, 2, 2, "gpipe") == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    with pytest.raises(ValueError, match="interleaved"):
        stage_order(0, 2, 2, "interleaved")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages, micro", [(2, 4), (4, 4), (3, 7)])
def test_simulated_balanced_flush_equals_the_predicted_step(schedule, stages, micro):
    chain = CostChain(forward_s=(1.0,) * stages, backward_s=(2.0,) * stages, param_bytes=(0,) * stages,
                      param_numel=(0,) * stages, activation_bytes=(0,) * stages, boundary_bytes=(0,) * (stages + 1))
    plan = predict(chain, CostSettings(num_stages=stages, num_microbatches=micro, schedule=schedule),
                   tuple(range(stages)), "balanced")
    ops = simulate(plan, micro, schedule)
    assert len(ops) == 2 * stages * micro
    assert max(op.end_s for op in ops) == pytest.approx(plan.step_time_s)  # (M + S - 1) * (F + B)
    for s in range(stages):  # one op at a time per stage
        spans = sorted((op.start_s, op.end_s) for op in ops if op.stage == s)
        assert all(a_end <= b_start + 1e-12 for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


def small_profile() -> Profile:
    ops = [OpRecord(name=f"op{i}", target="aten.linear.default", module=f"blocks.{i}" if 0 < i < 5 else "",
                    layer=-1 if i == 0 else min(i - 1, 4), forward_s=1e-3 * (3 if i == 5 else 1),
                    backward_s=2e-3 * (3 if i == 5 else 1), param_bytes=100, param_numel=25, output_bytes=64)
           for i in range(6)]
    return Profile(ops=ops, num_body_ops=6, boundary_bytes=[8, 64, 64, 64, 64, 64, 64],
                   boundary_num_tensors=[1] * 7, boundary_cuttable=[True] * 7, num_layers=4)


def test_plan_command_prints_the_split_and_refuses_bad_limits(tmp_path, capsys):
    path = tmp_path / "profile.json"
    small_profile().save(path)
    assert cli.main(["plan", "--profile", str(path), "--num-stages", "2", "--num-microbatches", "4"]) == 0
    out = capsys.readouterr().out
    assert "auto: stage starts" in out and "predicted speedup of auto over uniform-layers" in out
    assert "stage 1 starts at op" in out
    assert cli.main(["plan", "--profile", str(path), "--memory-limit-gib", "1e-9"]) == 2
    assert "autopipe.stage_memory_limit_bytes" in capsys.readouterr().err
    assert cli.main(["plan", "--profile", str(tmp_path / "none.json")]) == 2
    assert "autopipe.profile_path" in capsys.readouterr().err


def test_png_is_drawn_or_the_missing_matplotlib_is_a_clear_message(tmp_path, capsys):
    path = tmp_path / "profile.json"
    small_profile().save(path)
    status = cli.main(["plan", "--profile", str(path), "--png", str(tmp_path / "t.png")])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert status == 2 and "needs matplotlib" in capsys.readouterr().err
    else:
        assert status == 0 and (tmp_path / "t.png").stat().st_size > 1000


def test_factory_spec_errors():
    for spec, message in (("nocolon", "module:function"), ("no_such_module_xyz:f", "cannot import"),
                          ("autopipe.cli:missing", "no function")):
        with pytest.raises(ValueError, match=message):
            cli.load_factory(spec)


def test_pipeline_batch_is_resolved_over_the_replicas():
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
              "autopipe": {"enabled": True, "num_stages": 2}}
    cfg = load_config(config, world_size=4)  # 2 stages x 2 data-parallel replicas
    assert cfg.batch.world_size == 2 and cfg.batch.train_batch_size == 2 * 4 * 2
    with pytest.raises(ConfigError, match="autopipe.num_stages=2: must divide the number of ranks 3"):
        load_config(config, world_size=3)
    assert load_config({**config, "autopipe": {"num_stages": 2}}, world_size=4).batch.world_size == 4


def _pipeline_config(save_dir: str = "unused", **autopipe) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "train": {"save_dir": save_dir, "resume": True},
            "autopipe": {"enabled": True, **autopipe}}


def _context(world_size: int):
    import torch

    from angelptm.launch.distributed import DistContext
    return DistContext(rank=0, world_size=world_size, local_rank=0, device=torch.device("cpu"), group=None)


@pytest.mark.parametrize("autopipe, message", [
    ({"num_stages": 4, "num_microbatches": 2, "schedule": "1f1b"}, "1F1B needs at least num_stages=4"),
    ({"num_stages": 4, "num_microbatches": 2, "schedule": "interleaved", "virtual_stages_per_rank": 2},
     "multiple of num_stages=4"),
])
def test_pipeline_refuses_a_microbatch_count_its_schedule_cannot_run(autopipe, message):
    # Refused before any tracing or profiling, as a ConfigError naming the key.
    from angelptm.pretraining import pipeline_parallel as pipeline
    cfg = load_config(_pipeline_config(**autopipe), world_size=4)
    with pytest.raises(ConfigError, match=f"autopipe.num_microbatches=.*{message}"):
        pipeline.check_config(cfg, _context(4))


def test_resume_refuses_a_checkpoint_of_another_pipeline_layout(tmp_path):
    import torch

    from angelptm.errors import CheckpointError
    from angelptm.pretraining import pipeline_parallel as pipeline
    (tmp_path / "global_step10").mkdir()
    torch.save({"format": "autopipe", "world_size": 2, "op_starts": [0, 5], "step": 10},
               tmp_path / "global_step10" / "model_states.pt")
    (tmp_path / "latest").write_text("global_step10")
    same = load_config(_pipeline_config(str(tmp_path), num_stages=2), world_size=2)
    assert pipeline.saved_split(same, _context(2), pipeline.check_config(same, _context(2))) == [0, 5]
    interleaved = load_config(_pipeline_config(str(tmp_path), num_stages=2, schedule="interleaved",
                                               virtual_stages_per_rank=2), world_size=2)
    with pytest.raises(CheckpointError, match="2 ranks in 2 pipeline chunks; this run has 2 ranks in 4 chunks"):
        pipeline.saved_split(interleaved, _context(2), pipeline.check_config(interleaved, _context(2)))
    with pytest.raises(CheckpointError, match="this run has 4 ranks"):
        wider = load_config(_pipeline_config(str(tmp_path), num_stages=2), world_size=4)
        pipeline.saved_split(wider, _context(4), pipeline.check_config(wider, _context(4)))


@pytest.mark.parametrize("command", [[], ["profile"], ["plan"]])
def test_help_is_plain_text(command):
    """``python -m autopipe --help`` (and each command's): no reST markup, and the top level shows the commands."""
    result = subprocess.run([sys.executable, "-m", "autopipe", *command, "--help"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[2], timeout=120)
    assert result.returncode == 0, result.stderr
    for markup in ("``", ":mod:", ":class:", ":func:", "\\\\"):
        assert markup not in result.stdout, f"{markup!r} in:\n{result.stdout}"
    if not command:
        assert "python -m autopipe plan --profile profile.json" in result.stdout
