"""What a first run shows (issue 40): no bar flooding a log file, ZeRO-Cache's INFO lines (the compile notice)
in a plain script, a first run's cache build that does not read as an error, a plain ZeRO-1/2 note on one
process, and no message naming the machines this project was measured on."""

from __future__ import annotations

import ast
import io
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from angelptm.engine.builders import zero_stage_note
from angelptm.pretraining.data import preprocess
from angelptm.telemetry.progress import progress_bar

ROOT = Path(__file__).resolve().parents[2]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_draws_on_a_terminal_only(monkeypatch) -> None:
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a log file or a pipe
    assert progress_bar(10, 0, shown=True).disable
    monkeypatch.setattr(sys, "stderr", _Terminal())
    bar = progress_bar(10, 3, shown=True)
    assert not bar.disable and bar.n == 3
    assert progress_bar(10, 0, shown=False).disable  # other ranks never draw


def test_zero_one_or_two_on_one_process_says_it_holds_everything() -> None:
    note = zero_stage_note(2, world_size=1)
    assert "stage=2 on one process: nothing to shard" in note and "in full" in note
    assert "not sharded over the 4 ranks" in zero_stage_note(1, world_size=4)


def test_a_plain_script_shows_zero_caches_info_lines() -> None:
    script = ("import logging; from angelptm.launch.log_output import show_logs_in_plain_script\n"
              "show_logs_in_plain_script()\n"
              "logging.getLogger('zero_cache.base.native').info('compiling fused_host_adam.cpp for this machine')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "compiling fused_host_adam.cpp for this machine" in done.stdout


def test_first_run_cache_build_is_not_worded_as_an_error(tmp_path, monkeypatch, caplog) -> None:
    class Stop(Exception):
        pass

    def stop(*args, **kwargs):  # the tokenizing itself is not what this test is about
        raise Stop

    monkeypatch.setattr(preprocess, "preprocess", stop)
    with caplog.at_level(logging.INFO, logger=preprocess.logger.name), pytest.raises(Stop):
        preprocess.prepare_default_dataset(tmp_path / "cache")
    messages = [record.getMessage() for record in caplog.records]
    assert any("first run; later runs reuse it" in message for message in messages), messages
    assert not any("Errno" in message or "No such file" in message for message in messages)


def _message_strings(path: Path) -> list[str]:
    """String constants in ``path`` that are not docstrings (what can reach a user as a message): a string standing
    alone as a statement (a module, class, function or attribute docstring) is never shown."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def test_no_message_names_the_machines_this_project_was_measured_on() -> None:
    files = [ROOT / "pretrain.py", *[path for package in ("angelptm", "zero_cache", "moe", "autopipe")
                                     for path in (ROOT / package).rglob("*.py")]]
    assert len(files) > 100
    offending = [(path.relative_to(ROOT), text) for path in files for text in _message_strings(path)
                 if "lent H" in text or "the lent" in text]
    assert not offending
