"""The lost-rank heartbeat over an in-memory store, and its config keys (the 2-process runs are in tests/multiproc)."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch.distributed as dist

import angelptm
from angelptm.config import load_config
from angelptm.launch import liveness


def test_comms_keys_parse_and_bad_values_are_errors():
    assert load_config({"train_batch_size": 2}).comms.lost_rank_after_s == 30
    cfg = load_config({"train_batch_size": 2, "comms": {"timeout_s": 90, "lost_rank_after_s": 0}})
    assert (cfg.comms.timeout_s, cfg.comms.lost_rank_after_s) == (90, 0)
    with pytest.raises(angelptm.ConfigError, match="comms.timeout: unknown key; did you mean 'timeout_s'"):
        load_config({"train_batch_size": 2, "comms": {"timeout": 90}})
    with pytest.raises(angelptm.ConfigError, match=r"comms.timeout_s: must be > 0"):
        load_config({"train_batch_size": 2, "comms": {"timeout_s": 0}})


@pytest.fixture()
def exits(monkeypatch):
    """os._exit recorded instead of done, and the excepthook restored afterwards."""
    calls: list[int] = []
    event = threading.Event()

    def fake_exit(code: int) -> None:
        calls.append(code)
        event.set()

    monkeypatch.setattr(liveness.os, "_exit", fake_exit)
    monkeypatch.setattr(liveness, "GRACE_S", 0.2)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    return calls, event


def test_a_silent_rank_is_published_as_lost_and_this_rank_exits(exits):
    calls, event = exits
    store = dist.HashStore()
    watchdog = liveness.RankWatchdog(store, rank=0, world_size=2, lost_after_s=0.5)  # rank 1 never beats
    assert event.wait(10), "the watchdog did not give up on the silent rank"
    assert calls == [liveness.EXIT_CODE]
    assert watchdog.lost.startswith("rank 1 of 2 is lost: no heartbeat")
    assert dist.PrefixStore("angelptm/liveness/", store).get("lost").decode() == watchdog.lost
    watchdog.stop()


def test_a_rank_that_finished_is_not_lost_and_explain_names_a_silent_one(exits):
    calls, _ = exits
    store = dist.HashStore()
    prefixed = dist.PrefixStore("angelptm/liveness/", store)
    watchdogs = [liveness.RankWatchdog(store, rank=r, world_size=3, lost_after_s=0.5) for r in (0, 1)]
    watchdogs[1].stop(done=True)  # rank 1 finished its work; rank 2 never started beating
    error = watchdogs[0].explain(RuntimeError("Connection closed by peer [127.0.0.1]:1234"))
    assert isinstance(error, liveness.RankLostError)
    assert str(error).startswith("rank 2 of 3 stopped") and "Connection closed by peer" in str(error)
    time.sleep(1.0)  # past lost_after_s: rank 0 watches rank 1, which is done, so nobody is reported
    assert calls == [] and not prefixed.check(["lost"])
    watchdogs[0].stop()
