"""Nothing outside the run: the names a save_dir holds (the writer lock, ``latest``, ``.latest.tmp``, checkpoint
directories and their manifests) may be symlinks, hard links, FIFOs or huge files planted by anyone who can write
there, or left by a bad copy. A save never writes through them, a load never reads more than a small size of them
nor echoes their bytes, and ``pretrain.py`` never starts fresh over checkpoints it could not resolve.

Also the small things of the same files: the lock is given back at a clean end and at ``engine.destroy()``, an
export gets the mode of any new file, and ``angelptm-export --help`` names the command."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_checkpoint_safety import HOLD_LOCK, engine, one_step

import angelptm
from angelptm.checkpoints import writer_lock

ROOT = Path(__file__).resolve().parents[2]
OUTSIDE_TEXT = "root:x:0:0:root:/root:/bin/bash\nsecret-token-of-another-user\n"
"""What a file outside the run holds (an /etc/passwd stand-in): it must never change, nor show up in a message."""


@pytest.fixture(autouse=True)
def no_hang():
    """A save that blocks (a FIFO read) fails the test after 60 s instead of hanging the suite."""
    def hung(signum, frame):
        raise TimeoutError("the checkpoint code blocked for 60 s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture()
def outside(tmp_path) -> Path:
    path = tmp_path / "outside" / "passwd"
    path.parent.mkdir()
    path.write_text(OUTSIDE_TEXT)
    return path


def no_outside_text(text: str) -> bool:
    return not any(line in text for line in OUTSIDE_TEXT.splitlines())


# ------------------------------------------------------------------ the writer lock and .latest.tmp
@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory"])
def test_a_planted_lock_is_refused_by_name_and_nothing_outside_is_written(tmp_path, outside, kind):
    run = tmp_path / "run"
    run.mkdir()
    lock = run / ".writer.lock"
    if kind == "symlink":
        lock.symlink_to(outside)
    elif kind == "fifo":
        os.mkfifo(lock)
    else:
        lock.mkdir()
    with pytest.raises(angelptm.CheckpointError, match=rf"writer lock {re.escape(str(lock))} is .*remove it"):
        engine().save_checkpoint(run)
    assert outside.read_text() == OUTSIDE_TEXT
    assert not os.path.lexists(run / "latest") and not list(run.glob("global_step*"))


def test_a_lock_hard_linked_to_a_file_outside_is_locked_but_never_written(tmp_path, outside):
    run = tmp_path / "run"
    run.mkdir()
    os.link(outside, run / ".writer.lock")
    engine().save_checkpoint(run)
    assert (run / "latest").read_text() == "global_step0"
    writer_lock.LOCKS.release(run)
    assert outside.read_text() == OUTSIDE_TEXT


FLOCK_ONLY = """
import fcntl, os, sys, time
fd = os.open(os.path.join(sys.argv[1], ".writer.lock"), os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
print("held", flush=True)
time.sleep(60)
"""


def test_a_run_snapshotted_with_cp_al_still_resumes_and_saves(tmp_path):
    """``cp -al run run.snap`` hard-links every file, the writer lock too: every later claim used to fail."""
    run, snap = tmp_path / "run", tmp_path / "run.snap"
    source = engine()
    one_step(source)
    source.save_checkpoint(run)
    writer_lock.LOCKS.release(run)
    subprocess.run(["cp", "-al", str(run), str(snap)], check=True)
    lock_bytes = (run / ".writer.lock").read_bytes()
    resumed = engine()
    path, _ = resumed.load_checkpoint(run)
    assert path is not None
    one_step(resumed)
    resumed.save_checkpoint(run)
    assert (run / "latest").read_text() == "global_step2" and (snap / "latest").read_text() == "global_step1"
    assert (run / ".writer.lock").read_bytes() == lock_bytes  # shared with the snapshot: not written
    writer_lock.LOCKS.release(run)
    holder = subprocess.Popen([sys.executable, "-c", FLOCK_ONLY, str(snap)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(angelptm.CheckpointError, match=r"another process \(holder unknown: .* other hard links"):
            engine().save_checkpoint(run)
    finally:
        holder.kill()
        holder.wait()


LOCK_IN_SMALL_MEMORY = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))  # a 20 GiB read cannot fit
from angelptm.checkpoints import writer_lock
writer_lock.LOCKS.hold(sys.argv[1])
print("held", flush=True)
"""


def test_a_20_gib_sparse_lock_is_not_read_into_memory(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    with open(run / ".writer.lock", "wb") as handle:
        handle.truncate(20 << 30)  # sparse: no disk space, 20 GiB to a reader
    result = subprocess.run([sys.executable, "-c", LOCK_IN_SMALL_MEMORY, str(run)], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.stdout.strip() == "held", result.stderr[-2000:]
    assert json.loads((run / ".writer.lock").read_text())["pid"] > 0  # rewritten small, with the new holder


def test_a_planted_latest_tmp_symlink_is_removed_not_written_through(tmp_path, outside):
    run = tmp_path / "run"
    run.mkdir()
    (run / ".latest.tmp").symlink_to(outside)
    engine().save_checkpoint(run)
    assert outside.read_text() == OUTSIDE_TEXT
    latest = run / "latest"
    assert not latest.is_symlink() and latest.read_text() == "global_step0"
    writer_lock.LOCKS.release(run)


# ------------------------------------------------------------------ what a load reads and says
@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory):
    """``other/global_step1`` saved first, then ``run/global_step2`` and ``run/global_step3`` (latest)."""
    root = tmp_path_factory.mktemp("runs")
    source = engine()
    one_step(source)
    source.save_checkpoint(root / "other")
    time.sleep(0.05)  # the other run's checkpoint is strictly older than this run's
    for _ in range(2):
        one_step(source)
        source.save_checkpoint(root / "run")
    for name in ("run", "other"):
        writer_lock.LOCKS.release(root / name)
        (root / name / ".writer.lock").unlink()
    return root


@pytest.fixture()
def runs(saved_runs, tmp_path):
    for name in ("run", "other"):
        shutil.copytree(saved_runs / name, tmp_path / name, symlinks=True)
    return tmp_path / "run", tmp_path / "other"


@pytest.mark.parametrize("kind", ["symlink", "hard_link"])
def test_a_latest_leading_to_another_file_falls_back_and_never_echoes_it(runs, outside, kind, caplog):
    run, _ = runs
    (run / "latest").unlink()
    if kind == "symlink":
        (run / "latest").symlink_to(outside)
    else:
        os.link(outside, run / "latest")
    path, _ = engine(seed=1).load_checkpoint(run)
    assert Path(path) == run / "global_step3"
    assert "latest" in caplog.text and "damaged" in caplog.text
    assert no_outside_text(caplog.text), caplog.text


@pytest.mark.parametrize("linked", ["checkpoint_directory", "manifest"])
def test_a_checkpoint_symlinked_to_an_older_run_does_not_hide_the_valid_older_ones(runs, linked, caplog):
    """``latest`` names global_step3, which leads into the other run (saved before this one): it is damaged, and
    the other run's time is not taken for it, so this run's global_step2 is still a fallback."""
    run, other = runs
    newest = run / "global_step3"
    if linked == "checkpoint_directory":
        shutil.rmtree(newest)
        newest.symlink_to(other / "global_step1")
    else:
        (newest / "manifest.json").unlink()
        (newest / "manifest.json").symlink_to(other / "global_step1" / "manifest.json")
    path, _ = engine(seed=1).load_checkpoint(run)
    assert Path(path) == run / "global_step2"
    assert f"checkpoint {newest} does not verify" in caplog.text


# ------------------------------------------------------------------ pretrain.py never starts fresh over a run
def tiny_config(tmp_path: Path, **train) -> str:
    config = json.loads((ROOT / "configs" / "tiny.json").read_text())
    config["model"].update(num_layers=1, hidden_size=32, max_seq_len=32)
    config["train_micro_batch_size_per_gpu"] = 2
    config["data"]["cache_dir"] = str(ROOT / ".cache" / "angelptm")
    config["train"] = {"steps": 4, "save_dir": str(tmp_path / "run"), "save_interval": 2, "log_interval": 2,
                       "keep_last": 5, **train}
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.fixture()
def job(monkeypatch):
    sys.path.insert(0, str(ROOT))
    import pretrain

    return pretrain


def refuse_to_build(job, monkeypatch) -> None:
    def no_model(*args, **kwargs):
        raise AssertionError("the run should stop before building anything")

    monkeypatch.setattr(job, "build_dataset", no_model)
    monkeypatch.setattr(job, "build_model", no_model)


def test_a_deleted_latest_resumes_the_newest_checkpoint_instead_of_writing_over_it(tmp_path, job, caplog):
    caplog.set_level(logging.INFO)
    config = tiny_config(tmp_path)
    assert job.main(["--config", config]) == 0
    save_dir = tmp_path / "run"
    saved = {tag: (save_dir / tag / "manifest.json").read_text() for tag in ("global_step2", "global_step4")}
    (save_dir / "latest").unlink()
    caplog.clear()
    assert job.main(["--config", config, "--steps", "6"]) == 0
    assert f"resumed from {save_dir / 'global_step4'} at step 4" in caplog.text, caplog.text
    assert "starting fresh" not in caplog.text
    assert {tag: (save_dir / tag / "manifest.json").read_text() for tag in saved} == saved  # not written over
    assert (save_dir / "latest").read_text() == "global_step6"


def test_a_latest_that_is_a_directory_stops_the_job_at_its_start_naming_it(tmp_path, job, monkeypatch, capsys):
    refuse_to_build(job, monkeypatch)
    save_dir = tmp_path / "run"
    (save_dir / "global_step7").mkdir(parents=True)
    (save_dir / "latest").mkdir()
    before = sorted(p.name for p in save_dir.iterdir())
    assert job.main(["--save-dir", str(save_dir), "--steps", "3"]) == 2
    err = capsys.readouterr().err
    assert f"error: {save_dir / 'latest'} is a directory" in err and "Move that directory out" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in save_dir.iterdir() if p.name != ".writer.lock") == before


def test_checkpoints_that_cannot_be_resolved_stop_the_job_naming_them(tmp_path, job, capsys, runs):
    """No ``latest``; a ``global_step3`` that is a symlink into another run and a ``global_step2`` that lost its
    files: a fresh start would write over both names, so the job stops and names them."""
    save_dir = tmp_path / "job"
    (save_dir / "global_step2").mkdir(parents=True)
    (save_dir / "global_step3").symlink_to(runs[1] / "global_step1")
    assert job.main(["--config", tiny_config(tmp_path, save_dir=str(save_dir))]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {save_dir} holds 2 saved checkpoint names (global_step2, global_step3)"), err
    assert "Move them out" in err and "Traceback" not in err
    assert sorted(p.name for p in save_dir.iterdir() if p.name != ".writer.lock") == ["global_step2", "global_step3"]
    assert not any((save_dir / "global_step2").iterdir()) and (save_dir / "global_step3").is_symlink()


def test_no_resume_is_refused_over_checkpoints_without_a_latest(tmp_path, job, monkeypatch, capsys):
    refuse_to_build(job, monkeypatch)
    save_dir = tmp_path / "run"
    (save_dir / "global_step7").mkdir(parents=True)
    (save_dir / "global_step7" / "model_states.pt").write_bytes(b"")
    assert job.main(["--no-resume", "--save-dir", str(save_dir), "--steps", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {str(save_dir)!r} already holds a run's checkpoints (global_step7; latest is "
                          "missing") and "--save-dir" in err, err


# ------------------------------------------------------------------ the lock is given back; exports; --help
def test_engine_destroy_gives_the_writer_lock_back(tmp_path):
    run = tmp_path / "run"
    source = engine()
    source.save_checkpoint(run)
    source.destroy()
    assert (run / ".writer.lock").read_text() == ""  # no holder named: the next one takes over from no one
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(run)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held", holder.stderr.read() if holder.poll() is not None else ""
    finally:
        holder.kill()
        holder.wait()


def another_process_can_take(run: Path) -> bool:
    taker = subprocess.run([sys.executable, "-c", FLOCK_ONLY.replace("time.sleep(60)", ""), str(run)],
                           capture_output=True, text=True, timeout=60)
    return taker.stdout.strip() == "held"


def test_destroying_one_engine_keeps_the_lock_another_live_engine_of_the_process_holds(tmp_path):
    run = tmp_path / "run"
    first, second = engine(), engine()
    first.save_checkpoint(run)
    second.save_checkpoint(run, tag="second")
    first.destroy()
    assert not another_process_can_take(run)  # it used to be given back: a second job could write there
    second.save_checkpoint(run, tag="again")
    second.destroy()
    assert another_process_can_take(run)


def test_destroy_after_a_chdir_gives_back_the_lock_taken_by_a_relative_save_dir(tmp_path, monkeypatch):
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    source = engine()
    source.save_checkpoint("run")
    monkeypatch.chdir(tmp_path / "elsewhere")
    source.destroy()
    assert another_process_can_take(tmp_path / "run")


def test_an_export_gets_the_mode_of_a_new_file_and_help_names_the_command(runs, tmp_path, monkeypatch, capsys):
    from angelptm.checkpoints import export

    run, _ = runs
    previous = os.umask(0o022)
    try:
        assert export.main([str(run), str(tmp_path / "model.safetensors")]) == 0
        engine().save_fp32_model(str(tmp_path / "engine.safetensors"))
    finally:
        os.umask(previous)
    for name in ("model.safetensors", "engine.safetensors"):
        assert oct((tmp_path / name).stat().st_mode & 0o777) == oct(0o644), name
    capsys.readouterr()
    for argv0, usage in [("/usr/local/bin/angelptm-export", "usage: angelptm-export "),
                         (export.__file__, "usage: python -m angelptm.checkpoints.export ")]:
        monkeypatch.setattr(sys, "argv", [argv0, "--help"])
        with pytest.raises(SystemExit):
            export.main(["--help"])
        assert capsys.readouterr().out.startswith(usage)


def test_the_umask_is_read_without_being_changed(monkeypatch):
    """An export's mode comes from the umask; reading it must not set it, even for a moment (a checkpoint writer in
    another thread would create its files under the wrong one)."""
    import os

    from angelptm.checkpoints import files

    previous = os.umask(0o027)
    try:
        calls = []
        real_umask = os.umask
        monkeypatch.setattr(os, "umask", lambda mask: calls.append(mask) or real_umask(mask))
        assert files.current_umask() == 0o027
        if os.path.exists("/proc/self/status"):
            assert calls == []  # read from /proc, never set
    finally:
        monkeypatch.undo()
        os.umask(previous)
