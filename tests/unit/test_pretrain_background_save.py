"""pretrain.py writes its checkpoints beside training (``train.background_save``, ZeRO-Cache or AutoPipe, one process):
the saves return before their files are written, the run resumes from one exactly as from a synchronous save, and a stop
(Ctrl-C, the run's end) waits for the save in progress before it writes its own."""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from checkpoint_compare import assert_equal, load_states
from launch import shipped_config

import angelptm
from angelptm.checkpoints import files as checkpoint
from angelptm.checkpoints import manifest as checkpoint_manifest
from angelptm.checkpoints import streamed

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import pretrain as job  # noqa: E402  (the job script at the repository's root)


def zero_cache_job(tmp_path: Path, name: str, *, steps: int, save_interval: int, **train: object) -> Path:
    """The shipped ZeRO-Cache config in fp32 at a smaller size: a device budget that holds some of its chunks' states
    and a host tier for the rest, a save every ``save_interval`` steps, every step's loss logged."""
    config = shipped_config("tiny_zero_cache.json")
    config.pop("scheduler")
    config["train_micro_batch_size_per_gpu"] = 4
    config["model"].update(num_layers=2, hidden_size=64, max_seq_len=64)
    config["zero_cache"].update(chunk_size=1 << 18, device_memory_budget="12MiB", host_memory_budget="256MiB")
    config["data"]["cache_dir"] = str(ROOT / ".cache" / "angelptm")
    config["train"] = {"steps": steps, "save_dir": str(tmp_path / name), "save_interval": save_interval,
                       "log_interval": 1, "keep_last": 100, **train}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    return path


WRITER_DELAY_S = {"per_chunk": 0.3}
"""What the slowed writer sleeps per chunk (a slow disk; the synchronous reference run needs none)."""


def writer_alive() -> bool:
    return any(t.name.startswith("checkpoint-writer") for t in threading.enumerate())


@pytest.fixture
def saves(monkeypatch) -> list[dict]:
    """Each save pretrain.py makes: its step, whether it was asked to go on in the background, and whether its writer
    was still writing when it returned and when the next step had run. The writer is slowed (a slow disk)."""
    real_write, real_save = streamed._ArchiveWriter.write_chunk, angelptm.Engine.save_checkpoint
    real_step = angelptm.Engine.step
    seen: list[dict] = []

    def write_chunk(self, staged, snapshot):
        if self.plan.refs:
            time.sleep(WRITER_DELAY_S["per_chunk"])
        return real_write(self, staged, snapshot)

    def save_checkpoint(self, *args, **kwargs):
        path = real_save(self, *args, **kwargs)
        seen.append({"step": self.global_steps, "background": kwargs.get("background", False),
                     "writing_at_return": writer_alive(), "writing_after_a_step": None})
        return path

    def step(self, *args, **kwargs):
        if seen and seen[-1]["writing_after_a_step"] is None:
            seen[-1]["writing_after_a_step"] = writer_alive()  # before this step's update, after its forward/backward
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(streamed._ArchiveWriter, "write_chunk", write_chunk)
    monkeypatch.setattr(angelptm.Engine, "save_checkpoint", save_checkpoint)
    monkeypatch.setattr(angelptm.Engine, "step", step)
    return seen




def logged_losses(out: str) -> dict[int, str]:
    return {int(step): loss for step, loss in re.findall(r"step (\d+)/\d+ \| loss (\S+) ", out)}


def resume_from(root: Path, step: int, later: tuple[int, ...], config: Path, capsys) -> dict[int, str]:
    """Resume the run under ``root`` from its save of ``step`` as after a crash there: the ``later`` checkpoints gone,
    ``latest`` back on it; returns the losses the resumed run logs."""
    for later_step in later:
        for entry in (root / f"global_step{later_step}").iterdir():
            entry.unlink()
        (root / f"global_step{later_step}").rmdir()
    checkpoint.point_latest(root, f"global_step{step}")
    assert job.main(["--config", str(config)]) == 0
    return logged_losses(capsys.readouterr().out)


def test_background_saves_resume_bit_exactly_like_synchronous_ones(tmp_path, saves, capsys, monkeypatch):
    monkeypatch.setitem(WRITER_DELAY_S, "per_chunk", 0.0)
    assert job.main(["--config", str(zero_cache_job(tmp_path, "sync", steps=8, save_interval=2)),
                     "--no-background-save"]) == 0
    sync_losses = logged_losses(capsys.readouterr().out)
    assert [s["background"] for s in saves] == [False] * 4 and not any(s["writing_at_return"] for s in saves)
    saves.clear()
    monkeypatch.setitem(WRITER_DELAY_S, "per_chunk", 0.3)

    background = zero_cache_job(tmp_path, "background", steps=8, save_interval=2)
    assert job.main(["--config", str(background)]) == 0
    assert logged_losses(capsys.readouterr().out) == sync_losses, "the saves beside training changed the training"
    periodic, final = saves[:3], saves[3]
    assert [s["step"] for s in periodic] == [2, 4, 6] and all(s["background"] for s in periodic), saves
    assert all(s["writing_at_return"] and s["writing_after_a_step"] for s in periodic), \
        f"each periodic save must return before its files are written, and a step run beside the writer: {saves}"
    assert not final["background"] and not writer_alive()  # the last save is written before the run ends
    root = tmp_path / "background"
    assert (root / "latest").read_text() == "global_step8"
    for step in (2, 4, 6, 8):
        for saved, expected in zip(load_states(root / f"global_step{step}"),
                                   load_states(tmp_path / "sync" / f"global_step{step}")):
            assert_equal(saved, expected, f"global_step{step}")

    # Resume the run from the background save of step 4 (as after a crash there): the same steps 5..8, bit for bit.
    resumed_losses = resume_from(root, 4, (6, 8), background, capsys)
    assert resumed_losses == {s: sync_losses[s] for s in range(5, 9)}, resumed_losses
    for saved, expected in zip(load_states(root / "global_step8"), load_states(tmp_path / "sync" / "global_step8")):
        assert_equal(saved, expected, "resumed global_step8")


def verified(path: Path) -> bool:
    """Every file of the checkpoint at ``path`` matches its manifest (sizes and CRC-32)."""
    listed = checkpoint_manifest.read_manifest(path)
    return bool(listed) and all(checkpoint_manifest.verify_file(path, name, entry) is None
                                for name, entry in listed["files"].items())


def test_a_stop_waits_for_the_save_in_the_background_then_saves_its_step(tmp_path, saves, caplog, monkeypatch):
    """Ctrl-C one step after a background save (still being written: the writer is slowed): the run saves its own
    step once that one is published, and both checkpoints verify."""

    class StopAfterFourSteps:
        def __init__(self) -> None:
            self.checks = 0

        @property
        def requested(self) -> bool:  # checked before each step: true before the fifth
            self.checks += 1
            return self.checks > 4

    monkeypatch.setattr(job, "StopRequest", StopAfterFourSteps)
    config = zero_cache_job(tmp_path, "run", steps=100, save_interval=3)
    assert job.main(["--config", str(config)]) == 0
    assert "interrupted at step 4" in caplog.text
    assert [(s["step"], s["background"]) for s in saves] == [(3, True), (4, False)], saves
    assert saves[0]["writing_at_return"] and saves[0]["writing_after_a_step"], \
        "the save of step 3 must still have been writing when step 4 ran"
    assert not writer_alive()
    root = tmp_path / "run"
    assert (root / "latest").read_text() == "global_step4"
    assert verified(root / "global_step3") and verified(root / "global_step4")
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["global_step3", "global_step4",
                                                                                    "latest"]


def test_train_background_save_is_on_by_default_and_the_flag_turns_it_off():
    defaults = job.read_config(job.parse_args(["--config", str(ROOT / "configs" / "tiny_zero_cache.json")]))
    off = job.read_config(job.parse_args(["--config", str(ROOT / "configs" / "tiny_zero_cache.json"),
                                          "--no-background-save"]))
    from angelptm.config import load_config

    assert load_config(defaults).train.background_save is True
    assert load_config(off).train.background_save is False


def test_writes_longer_than_the_save_interval_still_keep_the_last_checkpoints(tmp_path, saves, monkeypatch):
    """A save every step, each write (slowed) longer than a step: the next save waits for it and prunes first, so
    no more than ``keep_last`` checkpoints and the one being written are ever on disk (once, every save found the
    previous one still writing, no prune ran until the end, and checkpoints piled up to the run's length)."""
    root, on_disk = tmp_path / "run", []
    real_save = angelptm.Engine.save_checkpoint

    def counting_save(self, *args, **kwargs):
        on_disk.append(sum(1 for p in root.glob("global_step*") if p.is_dir()) if root.exists() else 0)
        return real_save(self, *args, **kwargs)

    monkeypatch.setattr(angelptm.Engine, "save_checkpoint", counting_save)
    config = zero_cache_job(tmp_path, "run", steps=7, save_interval=1, keep_last=2)
    assert job.main(["--config", str(config)]) == 0
    assert sum(bool(s["writing_after_a_step"]) for s in saves) >= 3, f"the writes must outlast a step: {saves}"
    assert max(on_disk) <= 2 + 1, on_disk
    kept = sorted(p.name for p in root.glob("global_step*"))
    assert kept[-1] == "global_step7" and len(kept) <= 3, kept


def autopipe_job(tmp_path: Path, name: str, *, steps: int, save_interval: int) -> Path:
    """The shipped AutoPipe config in fp32 at a smaller size, as one pipeline stage in one process (no launcher)."""
    config = shipped_config("tiny_autopipe.json")
    config["model"].update(num_layers=2, hidden_size=64, max_seq_len=64)
    config["autopipe"].update(num_stages=1, profile_warmup=0, profile_repeats=1)  # (one stage: one split)
    config["data"]["cache_dir"] = str(ROOT / ".cache" / "angelptm")
    config["train"] = {"steps": steps, "save_dir": str(tmp_path / name), "save_interval": save_interval,
                       "log_interval": 1, "keep_last": 100}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    return path


def pipeline_files(path: Path) -> tuple[dict, dict]:
    """An AutoPipe checkpoint's layout file and its rank's weights and optimizer states, as torch reads them."""
    return tuple(torch.load(path / name, weights_only=True) for name in (checkpoint.MODEL_FILE,
                                                                         checkpoint.rank_file(0)))


def test_autopipe_saves_in_the_background_with_the_engines_guarantees(tmp_path, capsys, monkeypatch):
    """AutoPipe's loop (one process) writes its periodic checkpoints beside training through the engine's writer: with
    every record's write slowed, a save returns while its writer writes and the next step runs beside it, yet the
    losses, the files (bit for bit) and a resume from a background save equal those of ``--no-background-save``."""
    from angelptm.pretraining import pipeline_parallel

    delay_s = {"per_record": 0.0}
    real_write = streamed._ArchiveWriter.write
    real_save, real_step = pipeline_parallel.save, pipeline_parallel.train_step
    saves: list[dict] = []

    def write(self, key, tensor):
        time.sleep(delay_s["per_record"])
        return real_write(self, key, tensor)

    def save(*args, **kwargs):
        pending = real_save(*args, **kwargs)
        saves.append({"step": args[2], "background": pending is not None, "writing_at_return": writer_alive(),
                      "writing_at_the_next_step": None})
        return pending

    def train_step(*args, **kwargs):
        if saves and saves[-1]["writing_at_the_next_step"] is None:
            saves[-1]["writing_at_the_next_step"] = writer_alive()
        return real_step(*args, **kwargs)

    monkeypatch.setattr(streamed._ArchiveWriter, "write", write)
    monkeypatch.setattr(pipeline_parallel, "save", save)
    monkeypatch.setattr(pipeline_parallel, "train_step", train_step)
    assert job.main(["--config", str(autopipe_job(tmp_path, "sync", steps=6, save_interval=2)),
                     "--no-background-save"]) == 0
    sync_losses = logged_losses(capsys.readouterr().out)
    assert len(sync_losses) == 6 and [s["background"] for s in saves] == [False] * 3, saves
    saves.clear()
    delay_s["per_record"] = 0.005  # (150 records a save, 0.7 s: a save outlasts a step, 0.05 s)

    background = autopipe_job(tmp_path, "background", steps=6, save_interval=2)
    assert job.main(["--config", str(background)]) == 0
    assert logged_losses(capsys.readouterr().out) == sync_losses, "the saves beside training changed the training"
    periodic, final = saves[:2], saves[2]
    assert [(s["step"], s["background"]) for s in saves] == [(2, True), (4, True), (6, False)], saves
    assert all(s["writing_at_return"] and s["writing_at_the_next_step"] for s in periodic), \
        f"each periodic save must return before its files are written, and a step run beside its writer: {saves}"
    assert not final["writing_at_return"] and not writer_alive()  # the last save is written before the run ends
    root = tmp_path / "background"
    assert (root / "latest").read_text() == "global_step6"
    for step in (2, 4, 6):
        assert verified(root / f"global_step{step}"), f"global_step{step} is incomplete"
        for saved, expected in zip(pipeline_files(root / f"global_step{step}"),
                                   pipeline_files(tmp_path / "sync" / f"global_step{step}")):
            assert_equal(saved, expected, f"global_step{step}")

    # Resume from the background save of step 2 (as after a crash there): the same steps 3..6, bit for bit.
    resumed_losses = resume_from(root, 2, (4, 6), background, capsys)
    assert resumed_losses == {s: sync_losses[s] for s in range(3, 7)}, resumed_losses
    resumed, expected = pipeline_files(root / "global_step6"), pipeline_files(tmp_path / "sync" / "global_step6")
    assert_equal(resumed, expected, "resumed global_step6")
