"""The process group this engine created is destroyed at a clean exit and left alone after a crash
(angelptm.launch.distributed): gloo's threads left to interpreter teardown aborted a finished rank now and then."""

from __future__ import annotations

import atexit
import importlib
import sys

import pytest
import torch.distributed as dist
from launch import free_port  # tests/helpers

distributed = importlib.import_module("angelptm.launch.distributed")
liveness = importlib.import_module("angelptm.launch.liveness")


@pytest.fixture
def exit_handler(monkeypatch):
    """Creates a one-rank gloo group through init_distributed; returns what it registered to run at exit."""
    registered = []
    monkeypatch.setattr(atexit, "register", registered.append)
    monkeypatch.setattr(sys, "excepthook", lambda *exc_info: None)
    monkeypatch.setattr(liveness, "_UNCAUGHT", [])  # (this test's exceptions only)
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", str(free_port()))):
        monkeypatch.setenv(name, value)
    assert not dist.is_initialized()
    distributed.init_distributed(dist_init_required=True)
    yield registered
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_clean_exit_destroys_the_group(exit_handler):
    assert dist.is_initialized() and len(exit_handler) == 1
    exit_handler[0]()
    assert not dist.is_initialized()


def test_after_an_uncaught_exception_the_group_is_left_alone(exit_handler):
    try:
        raise RuntimeError("a rank failed")
    except RuntimeError:
        sys.excepthook(*sys.exc_info())
    exit_handler[0]()
    assert dist.is_initialized()
