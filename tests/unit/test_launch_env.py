"""The launcher's environment, checked before a rank waits on it (angelptm.launch.distributed).

``RANK=3 WORLD_SIZE=2`` used to wait silently until comms.timeout_s (600 s) ran out; a rank waiting for rank 0
said nothing for as long. Now the first is refused at once naming both variables, and the wait is logged after
a few seconds with what it waits for and where.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import sys
import time

import pytest
import torch
import torch.distributed as dist
from launch import free_port  # tests/helpers

import angelptm
from angelptm.errors import ConfigError
from angelptm.launch import distributed
from angelptm.pretraining import job_errors

liveness = importlib.import_module("angelptm.launch.liveness")


@pytest.fixture
def launcher_env(monkeypatch):
    """Sets the launcher's variables (no process group exists before or after)."""
    assert not dist.is_initialized()
    monkeypatch.setattr(atexit, "register", lambda *args: None)  # (a group made here is destroyed below)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(liveness, "_UNCAUGHT", [])
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))

    def set_env(**values: str) -> None:
        for name, value in values.items():
            monkeypatch.setenv(name, value)

    yield set_env
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("env, named", [
    ({"RANK": "3", "WORLD_SIZE": "2"}, ("RANK=3", "WORLD_SIZE=2", "0 .. 1")),
    ({"RANK": "2", "WORLD_SIZE": "2"}, ("RANK=2", "WORLD_SIZE=2")),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, ("RANK=-1", "WORLD_SIZE=2")),
    ({"RANK": "0", "WORLD_SIZE": "0"}, ("WORLD_SIZE=0", ">= 1")),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, ("LOCAL_RANK=2",
                                                                                     "LOCAL_WORLD_SIZE=2")),
])
def test_a_rank_outside_the_world_is_refused_at_once_naming_the_variables(launcher_env, env, named):
    launcher_env(**env)
    start = time.monotonic()
    with pytest.raises(ConfigError) as info:
        distributed.init_distributed(timeout_s=2)
    assert time.monotonic() - start < 1.5, "refused before any wait"
    assert all(text in str(info.value) for text in named), str(info.value)
    with pytest.raises(ConfigError):  # what initialize() reads first, to load the config for the right world
        distributed.launcher_world_size()


def test_initialize_refuses_rank_three_of_two_before_waiting(launcher_env):
    launcher_env(RANK="3", WORLD_SIZE="2")
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"RANK=3 .*WORLD_SIZE=2"):
        angelptm.initialize(model=torch.nn.Linear(2, 2), config={"train_batch_size": 2, "comms": {"timeout_s": 2}})
    assert time.monotonic() - start < 1.5


@pytest.mark.parametrize("rank, waits_for", [("1", "rank 0"), ("0", "the other 1 rank")])
def test_a_rank_waiting_at_the_rendezvous_says_what_for_and_where(launcher_env, caplog, rank, waits_for):
    launcher_env(RANK=rank, WORLD_SIZE="2")
    where = f"127.0.0.1:{distributed.os.environ['MASTER_PORT']}"
    with caplog.at_level(logging.INFO, logger="angelptm"), pytest.raises(distributed.RendezvousError) as info:
        distributed.init_distributed(timeout_s=1.5, wait_note_after_s=0.2)
    notes = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "waiting" in r.getMessage()]
    assert notes, caplog.text
    assert f"rank {rank} of 2" in notes[0] and waits_for in notes[0] and where in notes[0], notes[0]
    assert "MASTER_ADDR:MASTER_PORT" in notes[0] and "comms.timeout_s" in notes[0], notes[0]
    message = str(info.value)
    assert f"rank {rank} of 2" in message and where in message and "comms.timeout_s = 1.5 s" in message, message
    assert not dist.is_initialized()
    line, _ = job_errors.one_line(info.value)  # pretrain.py: one error line, no traceback
    assert line == f"error: {message}"


def test_only_a_nodes_local_rank_0_warns_of_the_wait(launcher_env, caplog):
    """Every rank of a node waits alike: one warning a node, the other ranks' notes at debug level."""
    launcher_env(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1")
    with caplog.at_level(logging.DEBUG, logger="angelptm"), pytest.raises(distributed.RendezvousError):
        distributed.init_distributed(timeout_s=1.0, wait_note_after_s=0.2)
    notes = [r for r in caplog.records if "waiting" in r.getMessage() and "so far" in r.getMessage()]
    assert notes and all(r.levelno == logging.DEBUG for r in notes), caplog.text
    assert distributed.WAIT_NOTE_AFTER_S >= 30  # (a scheduler's node-by-node start is not a stuck rank)


def test_a_quick_rendezvous_logs_no_wait(launcher_env, caplog):
    launcher_env(RANK="0", WORLD_SIZE="1")
    with caplog.at_level(logging.INFO, logger="angelptm"):
        distributed.init_distributed(dist_init_required=True, timeout_s=10, wait_note_after_s=0.5)
        time.sleep(0.7)
    assert dist.is_initialized() and "waiting" not in caplog.text


def test_a_master_port_in_use_is_named_at_once_not_called_a_timeout(launcher_env, monkeypatch):
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    monkeypatch.setenv("MASTER_PORT", str(port))
    launcher_env(RANK="0", WORLD_SIZE="2")
    start = time.monotonic()
    try:
        with pytest.raises(distributed.RendezvousAddressError) as info:
            distributed.init_distributed(timeout_s=30)
    finally:
        taken.close()
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert "port in use" in message and f"MASTER_PORT={port}" in message, message
    assert "did not all meet" not in message and "not a timeout" in message, message
    assert not dist.is_initialized()
    assert job_errors.one_line(info.value) == (f"error: {message}", job_errors.BAD_INPUT_EXIT)  # not the lost-rank one


def test_a_master_addr_that_does_not_resolve_is_named(launcher_env):
    launcher_env(RANK="1", WORLD_SIZE="2", MASTER_ADDR="no-such-host.invalid")
    with pytest.raises(distributed.RendezvousAddressError, match=r"address not resolvable: MASTER_ADDR=no-such-host"):
        distributed.init_distributed(timeout_s=1.5)
