"""The step timeline: interval arithmetic against a brute-force grid, and a traced ZeRO-Cache step on CPU."""

import json
import random

import pytest
import torch

import angelptm
from angelptm.pretraining.models import ModelConfig, build_model
from angelptm.telemetry.trace_png import main as draw_png
from zero_cache.base.timeline import COMPUTE, D2H, H2D, HOST_ADAM, WAITS, Interval, covered, overlap_shares, union


def grid_measure(spans, cover, step=0.25):
    """Brute force: sample every ``step`` and count the points inside ``spans`` (and inside ``cover``)."""
    def inside(t, ss):
        return any(a <= t < b for a, b in ss)

    points = [k * step for k in range(int(100 / step))]
    return (sum(step for t in points if inside(t, spans)),
            sum(step for t in points if inside(t, spans) and inside(t, cover)))


def random_spans(rng, count):
    spans = []
    for _ in range(count):
        start = rng.randrange(0, 90 * 4) / 4
        spans.append((start, start + rng.randrange(1, 40) / 4))
    return spans


def test_union_and_covered_match_a_grid_on_random_spans():
    rng = random.Random()
    for _ in range(30):
        spans, cover = random_spans(rng, rng.randrange(1, 8)), random_spans(rng, rng.randrange(0, 8))
        busy, hidden = grid_measure(spans, cover)
        assert sum(b - a for a, b in union(spans)) == pytest.approx(busy)
        assert covered(spans, cover) == pytest.approx(hidden)
        merged = union(spans)
        assert all(merged[k][1] < merged[k + 1][0] for k in range(len(merged) - 1))  # disjoint and sorted


def test_overlap_shares_count_only_work_and_leave_out_idle_tracks():
    intervals = [Interval(COMPUTE, "forward", 0, 10), Interval(COMPUTE, "backward", 20, 30),
                 Interval(H2D, "copy", 5, 15), Interval(HOST_ADAM, "chunk 1", 25, 45),
                 Interval(WAITS, "chunk 1", 10, 20)]
    shares = overlap_shares(intervals)
    assert shares[H2D] == pytest.approx(0.5)  # 5..10 of 5..15
    assert shares[HOST_ADAM] == pytest.approx(0.25)  # 25..30 of 25..45
    assert shares["all"] == pytest.approx(10 / 30)
    assert WAITS not in shares and "disk" not in shares


def test_a_traced_zero_cache_step_shows_each_track_and_draws_a_png(tmp_path):
    """Host optimizer groups on the CPU: the step's forward, backward and optimizer step are on the compute track,
    the host worker's chunk updates and their copies on theirs, every interval within the recorded window."""
    model = build_model(ModelConfig(flavour="gpt2", vocab_size=512, max_seq_len=32, num_layers=2, hidden_size=64,
                                    num_heads=4))
    weights = sum(p.numel() for p in model.parameters())
    engine, optimizer, _, _ = angelptm.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_cache": {"enabled": True, "chunk_size": 32768, "device_memory_budget": 20 * weights,
                       "host_memory_budget": "1GiB"}})
    assert "host" in {group.tier for group in optimizer.store.groups}
    ids = torch.randint(0, 512, (2, 33))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    for step in range(3):
        if step == 1:
            engine.trace_next_step(tmp_path)
        engine.backward(engine(**batch))
        engine.step()
    engine(**batch)  # the next forward closes the trace (the host updates of step 2 may run into it)
    trace = json.loads((tmp_path / "step2.trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = {(e["cat"], e["name"]) for e in spans}
    assert {(COMPUTE, "forward"), (COMPUTE, "backward"), (COMPUTE, "optimizer step")} <= names
    host_chunks = {f"chunk {c}" for c, group in enumerate(optimizer.store.groups) if group.tier == "host"}
    assert host_chunks <= {name for track, name in names if track == HOST_ADAM}
    assert {D2H, H2D} <= {track for track, _ in names}  # gradients out, updated weights back in
    assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in spans)
    assert 0 <= trace["otherData"]["overlap_with_compute"]["all"] <= 1
    assert engine.finish_trace() == []  # nothing left in progress
    pytest.importorskip("matplotlib")
    draw_png([str(tmp_path / "step2.trace.json"), str(tmp_path / "drawn.png")])
    assert (tmp_path / "step2.png").stat().st_size > 10_000 and (tmp_path / "drawn.png").stat().st_size > 10_000


def test_on_cpu_a_fetch_made_by_the_training_thread_is_not_counted_as_hidden(tmp_path):
    """Streamed params on CPU: the training thread copies each shard in itself (a forward pre-hook), so that time
    is cut out of compute; copies it cannot overlap must not show as hidden behind it."""
    model = build_model(ModelConfig(flavour="gpt2", vocab_size=512, max_seq_len=32, num_layers=2, hidden_size=64,
                                    num_heads=4))
    engine, optimizer, _, _ = angelptm.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_cache": {"enabled": True, "chunk_size": 32768, "param_home": "host", "host_memory_budget": "1GiB"}})
    assert set(optimizer.store.param_home) == {"host"}
    ids = torch.randint(0, 512, (2, 33))
    for step in range(3):
        if step == 1:
            engine.trace_next_step(tmp_path)
        engine.backward(engine(input_ids=ids[:, :-1], labels=ids[:, 1:]))
        engine.step()
    engine(input_ids=ids[:, :-1], labels=ids[:, 1:])
    trace = json.loads((tmp_path / "step2.trace.json").read_text())
    fetches = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == H2D]
    assert len(fetches) >= len(optimizer.store.shards)  # each shard fetched at least once
    assert trace["otherData"]["overlap_with_compute"][H2D] < 0.05
