"""A native op's first build is announced (issue 28: the test run sat silent for minutes while it compiled), and a
build lock that a killed build left does not hang the next run."""

from __future__ import annotations

import fcntl
import logging
import signal
import subprocess
import sys
import threading
import time

import torch.utils.cpp_extension

from zero_cache.base import native


def test_a_build_is_announced_and_a_cached_one_is_not(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # torch's extension cache, empty
    monkeypatch.setattr(logging.getLogger("zero_cache.base.native"), "handlers", [])  # conftest's would print it too
    built = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda name, **_: built.append(name) or name)
    with caplog.at_level(logging.INFO, logger="zero_cache.base.native"):
        assert native.load_csrc.__wrapped__("fused_host_adam") == "angelptm_fused_host_adam"
    assert any("compiling fused_host_adam.cpp" in record.message for record in caplog.records)

    cache = tmp_path / "angelptm_fused_host_adam"
    cache.mkdir(exist_ok=True)  # torch made it when asked where the build goes
    (cache / "angelptm_fused_host_adam.so").write_bytes(b"")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="zero_cache.base.native"):
        native.load_csrc.__wrapped__("fused_host_adam")
    assert not caplog.records and built == ["angelptm_fused_host_adam"] * 2


def _extension_cache(tmp_path, monkeypatch, *, fake_load: list):
    """An empty extension cache, torch's build directory for fused_host_adam in it, and a ``load`` that records
    whether torch's lock was there when it was called."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(logging.getLogger("zero_cache.base.native"), "handlers", [])  # conftest's would print it
    directory = tmp_path / "angelptm_fused_host_adam"
    directory.mkdir()
    monkeypatch.setattr(torch.utils.cpp_extension, "load",
                        lambda name, **_: fake_load.append((directory / "lock").exists()) or name)
    return directory


def test_a_lock_a_killed_build_left_is_removed_and_the_build_goes_on(monkeypatch, caplog, tmp_path):
    """torch waits for its build lock with no limit: a build killed by a time limit (SIGKILL here, while it held the
    owner's lock and torch's) left one, and the next runs hung."""
    loads = []
    directory = _extension_cache(tmp_path, monkeypatch, fake_load=loads)
    builder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time\n"
        f"owner = open({str(directory / native.OWNER_FILE)!r}, 'a+')\n"
        "fcntl.flock(owner, fcntl.LOCK_EX)\n"
        f"open({str(directory / 'lock')!r}, 'w').close()\n"
        "print('building', flush=True)\n"
        "time.sleep(120)\n")], stdout=subprocess.PIPE, text=True)
    assert builder.stdout.readline().strip() == "building"
    builder.send_signal(signal.SIGKILL)
    builder.wait()
    assert (directory / "lock").exists()
    with caplog.at_level(logging.INFO, logger="zero_cache.base.native"):
        assert native.load_csrc.__wrapped__("fused_host_adam") == "angelptm_fused_host_adam"
    assert loads == [False]
    assert any(record.levelno == logging.WARNING and str(directory / "lock") in record.message
               for record in caplog.records)


def test_a_live_builds_lock_is_waited_for_and_left_to_it(monkeypatch, caplog, tmp_path):
    loads = []
    directory = _extension_cache(tmp_path, monkeypatch, fake_load=loads)
    owner = open(directory / native.OWNER_FILE, "a+")  # (another open file: flock sets it against this process too)
    fcntl.flock(owner, fcntl.LOCK_EX)
    (directory / "lock").write_bytes(b"")
    caplog.set_level(logging.INFO, logger="zero_cache.base.native")
    waiting = threading.Thread(target=native.load_csrc.__wrapped__, args=("fused_host_adam",))
    waiting.start()
    time.sleep(0.5)
    assert waiting.is_alive() and loads == [] and (directory / "lock").exists()
    assert "waiting for another process's build or load of angelptm_fused_host_adam" in caplog.text
    (directory / "lock").unlink()  # the build ends: torch removes its lock, then the owner's goes
    fcntl.flock(owner, fcntl.LOCK_UN)
    owner.close()
    waiting.join(timeout=10)
    assert not waiting.is_alive() and loads == [False]
    assert not any(record.levelno == logging.WARNING for record in caplog.records)


def test_without_torchs_build_directory_the_load_runs_as_before(monkeypatch, tmp_path):
    loads = []
    _extension_cache(tmp_path, monkeypatch, fake_load=loads)

    def gone(*args, **kwargs):
        raise AttributeError("_get_build_directory")

    monkeypatch.setattr(torch.utils.cpp_extension, "_get_build_directory", gone)
    assert native.load_csrc.__wrapped__("fused_host_adam") == "angelptm_fused_host_adam" and loads == [False]
