"""A native op's first build is announced (issue 28: the test run sat silent for minutes while it compiled), and a
build lock that a killed build left does not hang the next run."""

from __future__ import annotations

import logging
import os
import time

import torch.utils.cpp_extension

from zero_cache.runtime import native


def test_a_build_is_announced_and_a_cached_one_is_not(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # torch's extension cache, empty
    monkeypatch.setattr(logging.getLogger("zero_cache.runtime.native"), "handlers", [])  # conftest's would print it too
    built = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda name, **_: built.append(name) or name)
    with caplog.at_level(logging.INFO, logger="zero_cache.runtime.native"):
        assert native.load_csrc.__wrapped__("fused_host_adam") == "angelptm_fused_host_adam"
    assert any("compiling fused_host_adam.cpp" in record.message for record in caplog.records)

    cache = tmp_path / "angelptm_fused_host_adam"
    cache.mkdir(exist_ok=True)  # torch made it when asked where the build goes
    (cache / "angelptm_fused_host_adam.so").write_bytes(b"")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="zero_cache.runtime.native"):
        native.load_csrc.__wrapped__("fused_host_adam")
    assert not caplog.records and built == ["angelptm_fused_host_adam"] * 2


def _lock_aged(tmp_path, monkeypatch, seconds: float):
    """torch's build lock for fused_host_adam in an empty extension cache, ``seconds`` old."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(logging.getLogger("zero_cache.runtime.native"), "handlers", [])  # conftest's would print it
    lock = tmp_path / "angelptm_fused_host_adam" / "lock"
    lock.parent.mkdir()
    lock.write_bytes(b"")
    then = time.time() - seconds
    os.utime(lock, (then, then))
    return lock


def test_a_lock_a_killed_build_left_is_removed_and_the_build_goes_on(monkeypatch, caplog, tmp_path):
    """torch waits for its build lock with no limit: a build killed by a time limit left one, and the next runs hung."""
    lock = _lock_aged(tmp_path, monkeypatch, native.STALE_LOCK_SECONDS + 30)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda name, **_: (name, lock.exists()))
    with caplog.at_level(logging.INFO, logger="zero_cache.runtime.native"):
        assert native.load_csrc.__wrapped__("fused_host_adam") == ("angelptm_fused_host_adam", False)
    assert any(record.levelno == logging.WARNING and str(lock) in record.message for record in caplog.records)


def test_a_young_lock_is_waited_for_until_its_build_ends(monkeypatch, caplog, tmp_path):
    lock = _lock_aged(tmp_path, monkeypatch, 20)
    slept = []

    def sleep(seconds):  # the other process's build ends while this one waits
        slept.append(seconds)
        if len(slept) == 3:
            lock.unlink()

    with caplog.at_level(logging.INFO, logger="zero_cache.runtime.native"):
        native.clear_stale_lock("angelptm_fused_host_adam", sleep=sleep)
    assert slept == [5.0] * 3
    assert [record.levelno for record in caplog.records] == [logging.INFO]
    assert "waiting for another process's build" in caplog.records[0].message


def test_a_lock_that_ages_while_waited_for_is_removed(monkeypatch, tmp_path):
    lock = _lock_aged(tmp_path, monkeypatch, native.STALE_LOCK_SECONDS - 7)
    now = [time.time()]
    slept = []

    def sleep(seconds):
        slept.append(seconds)
        now[0] += seconds

    native.clear_stale_lock("angelptm_fused_host_adam", clock=lambda: now[0], sleep=sleep)
    assert not lock.exists()
    assert slept[0] == 5.0 and 0 < slept[1] <= 2.0 + 1e-3 and len(slept) == 2


def test_a_lock_taken_anew_since_it_was_judged_stale_is_kept(monkeypatch, tmp_path):
    """Another process removed the stale lock and took its own between this one's look and its removal."""
    lock = _lock_aged(tmp_path, monkeypatch, native.STALE_LOCK_SECONDS + 30)
    seen = lock.stat()
    lock.unlink()
    (tmp_path / "other").write_bytes(b"")  # (the new lock must not reuse the old inode)
    lock.write_bytes(b"")
    native._remove_if_unchanged(lock, seen, native.STALE_LOCK_SECONDS + 30)
    assert lock.exists()
