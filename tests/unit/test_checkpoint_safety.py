"""Checkpoint safety (issue 38): the unpickling allowlist, paths that stay inside a checkpoint, reserved tags,
one writer per save_dir, and an export that never writes into a checkpoint."""

from __future__ import annotations

import argparse
import builtins
import cProfile
import io
import json
import os
import pydoc
import shutil
import socket
import subprocess
import sys
import timeit
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import angelptm
from angelptm.checkpoints import files as checkpoint
from angelptm.checkpoints import manifest as checkpoint_manifest
from angelptm.checkpoints import safe_pickle, writer_lock
from angelptm.pretraining.models import ModelConfig, build_model


def gpt(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build_model(ModelConfig(vocab_size=64, max_seq_len=16, num_layers=1, hidden_size=32, num_heads=4))


def engine(seed: int = 0, **extra):
    config = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, **extra}
    return angelptm.initialize(model=gpt(seed), config=config)[0]


def one_step(engine_) -> None:
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = engine_.module(tokens).float().mean()
    engine_.backward(loss)
    engine_.step()


CLIENT_STATE = {"epoch": 3, "lr": 1e-3, "name": "run", "flags": [True, None], "shape": (2, 3), "ids": {1, 2},
                "raw": b"\x00\x01", "nested": {"t": torch.arange(3), "f16": torch.ones(2, dtype=torch.float16)}}


def saved_globals(root: Path) -> set[str]:
    return {name for path in root.rglob("*.pt") for name in safe_pickle.pickle_globals(path)}


def test_the_allowlist_covers_what_each_kind_of_checkpoint_names(tmp_path):
    """Plain (fp32, bf16), ZeRO-Cache and pipeline checkpoints with every RNG state and a client_state of plain
    types name only allowlisted globals, and load back."""
    found: set[str] = set()
    kinds = {"plain": {}, "bf16": {"bf16": {"enabled": True}},
             "zero_cache": {"zero_cache": {"enabled": True, "chunk_size": 4096}}}
    for kind, extra in kinds.items():
        source = engine(**extra)
        one_step(source)
        source.save_checkpoint(tmp_path / kind, client_state=CLIENT_STATE)
        found |= saved_globals(tmp_path / kind)
        _, client = engine(**extra).load_checkpoint(tmp_path / kind)
        assert client["ids"] == {1, 2} and torch.equal(client["nested"]["t"], torch.arange(3))
    layers = [nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)]
    pipe = angelptm.pipe.PipelineModule(layers, num_stages=1, loss_fn=nn.MSELoss())
    pipe_engine, *_ = angelptm.initialize(model=pipe, model_parameters=pipe.parameters(), config={
        "train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    pipe_engine.save_checkpoint(tmp_path / "pipe", client_state=CLIENT_STATE)
    found |= saved_globals(tmp_path / "pipe")
    assert "torch._utils._rebuild_tensor_v2" in found and "collections.OrderedDict" in found
    assert found <= safe_pickle.ENGINE_GLOBALS, found - safe_pickle.ENGINE_GLOBALS


class Calls:
    """Unpickling this calls ``function(*args)``: the stand-in for any code an attacker wants run."""

    def __init__(self, function, *args) -> None:
        self.function, self.args = function, args

    def __reduce__(self):
        return self.function, self.args


def hostile_payloads(marker: Path) -> dict[str, Calls]:
    """Each would create ``marker`` if it ran."""
    code = f"open({str(marker)!r}, 'w').close()"
    return {"timeit": Calls(timeit.timeit, code, "pass", timeit.default_timer, 1),
            "pipepager": Calls(pydoc.pipepager, "text", f"touch {marker}"),
            "cProfile": Calls(cProfile.run, code), "io.open": Calls(io.open, str(marker), "w"),
            "os.system": Calls(os.system, f"touch {marker}"), "eval": Calls(builtins.eval, code),
            "exec": Calls(builtins.exec, code), "subprocess.run": Calls(subprocess.run, ["touch", str(marker)]),
            "subprocess.Popen": Calls(subprocess.Popen, ["touch", str(marker)])}


@pytest.mark.parametrize("opt_in", [False, True])
def test_code_running_globals_are_refused_by_name_in_both_modes_and_nothing_runs(tmp_path, opt_in):
    marker = tmp_path / "pwned"
    for name, payload in hostile_payloads(marker).items():
        path = tmp_path / f"{name}.pt"
        torch.save({"module": {}, "x": payload}, path)
        with pytest.raises(angelptm.CheckpointError) as refused:
            safe_pickle.load(path, allow_unsafe_pickle=opt_in)
        message = str(refused.value)
        named = f"{payload.function.__module__}.{payload.function.__qualname__}"
        assert f"names {named}" in message and "which no checkpoint of this engine holds" in message, (name, message)
        assert "nothing in it ran" in message and "numpy RNG" not in message and "opt in with" not in message
    assert not marker.exists()


def test_the_opt_in_admits_numpy_arrays_and_namespaces_only(tmp_path):
    path = tmp_path / "legacy.pt"
    torch.save({"keys": np.arange(4, dtype=np.uint32), "args": argparse.Namespace(lr=0.1)}, path)
    with pytest.raises(angelptm.CheckpointError, match=r"numpy arrays, as checkpoints of the previous format hold "
                                                       r"numpy's RNG state.*allow_unsafe_pickle=True"):
        safe_pickle.load(path)
    loaded = safe_pickle.load(path, allow_unsafe_pickle=True)
    assert loaded["keys"].tolist() == [0, 1, 2, 3] and loaded["args"].lr == 0.1
    torch.save({"args": argparse.Namespace(lr=0.1)}, path)
    with pytest.raises(angelptm.CheckpointError, match=r"holds an argparse.Namespace \(argparse.Namespace\)"):
        safe_pickle.load(path)


def test_saving_an_object_loading_would_refuse_is_refused_at_the_save(tmp_path):
    with pytest.raises(angelptm.CheckpointError, match=r"argparse.Namespace.*vars\(args\)"):
        engine().save_checkpoint(tmp_path, client_state={"args": argparse.Namespace(lr=0.1)})
    assert not (tmp_path / "latest").exists()


# ------------------------------------------------------------------ paths stay inside the checkpoint directory
@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    source = engine()
    for step in (1, 2):
        one_step(source)
        source.save_checkpoint(root / "run")
    one_step(source)
    source.save_checkpoint(root / "other")
    for name in ("run", "other"):
        (root / name / ".writer.lock").unlink()
        writer_lock.LOCKS.release(root / name)
    return root


@pytest.fixture()
def two_runs(saved_runs, tmp_path):
    """``run/`` with global_step1 and global_step2 (latest), and ``other/`` with global_step3 (fresh copies)."""
    for name in ("run", "other"):
        shutil.copytree(saved_runs / name, tmp_path / name)
    return tmp_path / "run", tmp_path / "other"


@pytest.mark.parametrize("latest", ["../other/global_step3", "ABSOLUTE", "global_step2\x00x", b"\xff\xfeglobal"])
def test_a_latest_leading_outside_or_unreadable_is_damaged_and_falls_back(two_runs, latest, caplog):
    run, other = two_runs
    text = str(other / "global_step3") if latest == "ABSOLUTE" else latest
    (run / "latest").write_bytes(text if isinstance(text, bytes) else text.encode())
    path, _ = engine(seed=1).load_checkpoint(run)
    assert Path(path) == run / "global_step2", path
    assert "latest is damaged" in caplog.text


@pytest.mark.parametrize("tag", ["../other/global_step3", "/abs", "a\x00b", "..", ".tmp-x", "latest", "manifest.json"])
def test_bad_tags_are_refused_by_name_at_load_and_export(two_runs, tag, capsys):
    from angelptm.checkpoints import export

    run, _ = two_runs
    with pytest.raises(angelptm.CheckpointError, match=r"checkpoint tag .* use a plain directory name"):
        engine().load_checkpoint(run, tag=tag)
    assert export.main([str(run), str(run.parent / "out.safetensors"), "--tag", tag]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: checkpoint tag") and len(err.splitlines()) == 1


def resign(directory: Path, files: dict) -> None:
    """Write a manifest listing ``files`` (name -> entry), as an attacker or a damaged copy would."""
    manifest = json.loads((directory / checkpoint_manifest.MANIFEST_FILE).read_text())
    manifest["files"] = files
    (directory / checkpoint_manifest.MANIFEST_FILE).write_text(json.dumps(manifest))


@pytest.mark.parametrize("case", ["dotdot", "dev_zero", "directory", "symlink_out", "size_string", "size_null"])
def test_a_manifest_naming_what_is_not_its_own_regular_file_is_damaged(two_runs, case):
    run, other = two_runs
    newest = run / "global_step2"
    files = json.loads((newest / checkpoint_manifest.MANIFEST_FILE).read_text())["files"]
    entry = files[checkpoint.MODEL_FILE]
    if case == "dotdot":
        files["../global_step1/model_states.pt"] = entry
    elif case == "dev_zero":
        files["/dev/zero"] = entry
    elif case == "directory":
        (newest / "sub").mkdir()
        files["sub"] = entry
    elif case == "symlink_out":
        (newest / checkpoint.MODEL_FILE).unlink()
        (newest / checkpoint.MODEL_FILE).symlink_to(other / "global_step3" / checkpoint.MODEL_FILE)
    else:
        files[checkpoint.MODEL_FILE] = {**entry, "size_bytes": "12" if case == "size_string" else None}
    resign(newest, files)
    path, _ = engine(seed=1).load_checkpoint(run)  # returns at all: /dev/zero is never read
    assert Path(path) == run / "global_step1"
    with pytest.raises(angelptm.CheckpointError, match="does not verify"):
        engine().load_checkpoint(run, tag="global_step2")


def test_dev_zero_as_latest_or_manifest_is_never_read(two_runs):
    run, _ = two_runs
    (run / "global_step2" / checkpoint_manifest.MANIFEST_FILE).unlink()
    (run / "global_step2" / checkpoint_manifest.MANIFEST_FILE).symlink_to("/dev/zero")
    path, _ = engine(seed=1).load_checkpoint(run)
    assert Path(path) == run / "global_step1"
    (run / "latest").unlink()
    (run / "latest").symlink_to("/dev/zero")
    path, _ = engine(seed=1).load_checkpoint(run)
    assert Path(path) == run / "global_step1"


# ------------------------------------------------------------------ reserved tags, export, one writer
@pytest.mark.parametrize("tag", ["latest", "manifest.json", "model_states.pt", "rank_00000_states.pt", ".hidden",
                                 ".tmp-1", "a/b", "x\x00"])
def test_reserved_and_hidden_tags_are_refused_at_save_and_nothing_moves(two_runs, tag):
    run, _ = two_runs
    before = sorted(p.name for p in run.iterdir())
    with pytest.raises(angelptm.CheckpointError, match="checkpoint tag"):
        engine().save_checkpoint(run, tag=tag)
    assert sorted(p.name for p in run.iterdir()) == before
    assert (run / "latest").read_text() == "global_step2"


@pytest.mark.parametrize("where", ["global_step2/model_states.pt", "global_step2", "latest", "."])
def test_the_export_never_writes_inside_the_checkpoint_directory(two_runs, where, capsys):
    from angelptm.checkpoints import export

    run, _ = two_runs
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    assert export.main([str(run), str(run / where)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: cannot write") and "checkpoint director" in err and len(err.splitlines()) == 1
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before
    assert export.main([str(run), "--hf", str(run / "global_step2" / "hf")]) == 1
    assert export.main([str(run), str(run / "weights.safetensors")]) == 0  # a new file beside the checkpoints


HOLD_LOCK = """
import fcntl, json, os, socket, sys, time
fd = os.open(os.path.join(sys.argv[1], ".writer.lock"), os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started_at_unix": time.time()}).encode())
print("held", flush=True)
time.sleep(60)
"""
"""Holds a save_dir's writer lock as SaveDirLocks.hold does (without importing torch: a fast start)."""


def test_a_second_writer_is_refused_by_name_and_a_dead_ones_lock_is_taken_over(tmp_path):
    save_dir = tmp_path / "run"
    save_dir.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(save_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(angelptm.CheckpointError, match=rf"being written by another process \(pid {holder.pid} "
                                                           rf"on {socket.gethostname()}"):
            engine().save_checkpoint(save_dir)
        assert not (save_dir / "latest").exists()
    finally:
        holder.kill()
        holder.wait()
    engine().save_checkpoint(save_dir)  # the holder is gone: its lock is taken over
    assert json.loads((save_dir / ".writer.lock").read_text())["pid"] == os.getpid()
    writer_lock.LOCKS.release(save_dir)


def test_cleanup_removes_only_leftovers_of_dead_processes(tmp_path):
    save_dir = tmp_path / "run"
    save_dir.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = writer_lock._HOST_ID
    live_name = f".tmp-{os.getppid()}-{host}-0000abcd-global_step9"  # pytest's parent: alive
    dead_name = f".tmp-{int(dead.stdout)}-{host}-0000abcd-global_step8"
    for name in (live_name, dead_name):
        (save_dir / name).mkdir()
    engine().save_checkpoint(save_dir)
    names = {p.name for p in save_dir.iterdir()}
    assert live_name in names and dead_name not in names and "global_step0" in names
    writer_lock.LOCKS.release(save_dir)


@pytest.mark.parametrize("kind", ["file", "read_only"])
def test_a_save_dir_that_cannot_hold_checkpoints_is_refused_at_claim(tmp_path, kind):
    target = tmp_path / "save"
    if kind == "file":
        target.write_text("x")
    else:
        target.mkdir()
        target.chmod(0o500)
    if kind == "read_only" and os.access(target, os.W_OK):
        pytest.skip("running as a user who can write anywhere")
    with pytest.raises(angelptm.CheckpointError, match=r"save_dir.*(is a file|not writable)"):
        checkpoint.claim_directory(target)
