"""AutoPipe's tracer, profiler and graph slicing on a tiny GPT (CPU)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from angelptm.pretraining.models import ModelConfig, build_model
from autopipe.graph import build_loss_module, build_stage_modules, trace
from autopipe.profile import Profile
from autopipe.profiler import profile_graph
from autopipe.timing import median_time_s, per_call_time_s

MICRO, SEQ, VOCAB, HIDDEN = 2, 16, 96, 32


@pytest.fixture(scope="module")
def traced():
    torch.manual_seed(0)
    model = build_model(ModelConfig(flavour="gpt2", vocab_size=VOCAB, max_seq_len=SEQ, num_layers=2,
                                    hidden_size=HIDDEN, num_heads=4, tie_embeddings=False))
    ids = torch.randint(0, VOCAB, (MICRO, SEQ))
    inputs = {"input_ids": ids, "labels": torch.roll(ids, -1, dims=1)}
    graph = trace(model, inputs, "labels")
    return model, inputs, graph, profile_graph(graph, inputs, warmup=0, repeats=2)


def test_raw_times_are_positive_and_calibrated_times_sum_to_the_whole_graph(traced):
    _, inputs, graph, profile = traced
    raw = profile_graph(graph, inputs, warmup=0, repeats=1, calls=2, calibrate=False)
    assert all(op.forward_s > 0 for op in raw.ops)
    assert next(op for op in raw.ops if op.module == "lm_head" and "linear" in op.target).backward_s > 0
    assert raw.time_scale == 1.0 and raw.measured_total_s == 0.0 and "not calibrated" in raw.calibration_line()
    assert raw.raw_forward_total_s == pytest.approx(sum(op.forward_s for op in raw.ops))
    # calibrated: the harness overhead was measured and the op times share the measured whole-graph time
    assert profile.measured_total_s > 0 and profile.time_scale > 0
    assert profile.forward_overhead_s >= 0 and profile.backward_overhead_s > 0
    assert all(op.forward_s >= 0 and op.backward_s >= 0 for op in profile.ops)
    assert sum(op.forward_s + op.backward_s for op in profile.ops) == pytest.approx(profile.measured_total_s)
    assert "scale" in profile.top_ops_table(3).splitlines()[-1]


def test_profile_bytes_match_the_tensors(traced):
    model, _, graph, profile = traced
    assert len(profile.ops) == len(graph.ops) and profile.num_body_ops == graph.num_body_ops
    by_module = {}
    for op in profile.ops:
        by_module.setdefault(op.module, []).append(op)
    head = next(op for op in by_module["lm_head"] if "linear" in op.target)
    assert head.param_bytes == VOCAB * HIDDEN * 4 and head.param_numel == VOCAB * HIDDEN
    assert head.output_bytes == MICRO * SEQ * VOCAB * 4  # logits [B, S, V] fp32
    fc = next(op for op in by_module["blocks.0.mlp.fc"] if "linear" in op.target)
    assert fc.param_numel == 4 * HIDDEN * HIDDEN + 4 * HIDDEN  # weight + bias
    assert fc.output_bytes == MICRO * SEQ * 4 * HIDDEN * 4
    # every parameter is counted once, at its first use
    assert sum(op.param_numel for op in profile.ops) == sum(p.numel() for p in model.parameters())
    # views allocate nothing: a transpose's output shares its input's storage
    transposes = [op for op in profile.ops if "transpose" in op.target]
    assert transposes and all(op.output_bytes == 0 for op in transposes)
    # the boundary between the two blocks carries exactly the residual stream [B, S, H] fp32
    layer1 = next(i for i, op in enumerate(profile.ops) if op.layer == 1)
    assert profile.boundary_bytes[layer1] == MICRO * SEQ * HIDDEN * 4
    assert profile.boundary_num_tensors[layer1] == 1 and profile.boundary_cuttable[layer1]
    assert profile.boundary_bytes[0] == MICRO * SEQ * 8  # the int64 token ids
    assert profile.num_layers == 2
    assert [op.layer for op in profile.ops][0] == -1 and profile.ops[-1].layer == 2


def test_profile_json_round_trip_and_table(traced, tmp_path):
    profile = traced[3]
    path = tmp_path / "sub" / "profile.json"
    profile.save(path)
    assert Profile.load(path) == profile
    table = profile.top_ops_table(5)
    assert len(table.splitlines()) == 8 and "fwd ms" in table
    with pytest.raises(ValueError, match="autopipe.profile_path"):
        Profile.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"version": 99}')
    with pytest.raises(ValueError, match="version"):
        Profile.load(tmp_path / "bad.json")
    old = json.loads(path.read_text())  # a version 1 file: no calibration fields; loads as uncalibrated
    for name in ("forward_overhead_s", "backward_overhead_s", "time_scale", "raw_forward_total_s",
                 "raw_backward_total_s", "measured_total_s"):
        del old[name]
    old["version"] = 1
    (tmp_path / "v1.json").write_text(json.dumps(old))
    loaded = Profile.load(tmp_path / "v1.json")
    assert loaded.ops == profile.ops and loaded.time_scale == 1.0 and loaded.measured_total_s == 0.0
    assert loaded.version == 2
    truncated = json.loads(path.read_text())
    del truncated["ops"]
    (tmp_path / "truncated.json").write_text(json.dumps(truncated))
    with pytest.raises(ValueError, match="missing or unexpected fields.*python -m autopipe profile"):
        Profile.load(tmp_path / "truncated.json")


def test_chain_units_follow_the_cut_positions(traced):
    profile = traced[3]
    cuts = profile.cut_positions(max_cut_tensors=1)
    chain = profile.to_chain(max_cut_tensors=1)
    assert chain.num_units == len(cuts) + 1
    assert sum(chain.forward_s) == pytest.approx(sum(op.forward_s for op in profile.ops))
    assert chain.num_layers == 2 and chain.unit_layer[0] == -1 and chain.unit_layer[-1] == 2
    wider = profile.to_chain(max_cut_tensors=3)
    assert wider.num_units > chain.num_units


def test_stage_modules_compose_to_the_model(traced):
    model, inputs, graph, profile = traced
    cuts = profile.cut_positions(max_cut_tensors=2)
    stages = build_stage_modules(graph, [0, cuts[len(cuts) // 3], cuts[2 * len(cuts) // 3]])
    loss_module = build_loss_module(graph)
    values = tuple(inputs[name] for name in graph.input_names)
    for stage in stages:
        out = stage(*values)
        values = out if isinstance(out, tuple) else (out,)
    loss = loss_module(*values, inputs["labels"])
    torch.testing.assert_close(loss, model(**inputs))
    loss.backward()
    owned = {name for stage in stages for name, _ in stage.named_parameters()} | {
        name for name, _ in loss_module.named_parameters()}
    assert owned == {name for name, _ in model.named_parameters()}
    assert all(p.grad is not None for p in model.parameters())  # the stages hold the model's own tensors
    with pytest.raises(ValueError, match="op_starts"):
        build_stage_modules(graph, [0, graph.num_body_ops])


def test_trace_rejects_bad_targets():
    class NoLoss(nn.Module):
        def forward(self, x, labels):
            return x * 2

    with pytest.raises(ValueError, match="target_name"):
        trace(NoLoss(), {"x": torch.ones(2)}, "labels")
    with pytest.raises(ValueError, match="reads 'labels'"):
        trace(NoLoss(), {"x": torch.ones(2), "labels": torch.ones(2)}, "labels")


def test_timers_on_cpu_are_positive():
    def matmul():
        return torch.ones(64, 64) @ torch.ones(64, 64)

    assert median_time_s(matmul, torch.device("cpu"), warmup=1, repeats=3) > 0
    assert per_call_time_s(matmul, torch.device("cpu"), warmup=1, repeats=2, calls=3) > 0
    with pytest.raises(ValueError, match="repeats"):
        profile_graph(None, {"x": torch.ones(1)}, repeats=0)
    with pytest.raises(ValueError, match="calls"):
        profile_graph(None, {"x": torch.ones(1)}, calls=0)
