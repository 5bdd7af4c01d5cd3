"""DeepSpeed 0.19.8's newer config keys, which the edge used to refuse as unknown.

``zero_optimization.zenflow`` and ``offload_optimizer.super_offload`` are accepted as permissions to overlap the
optimizer step, answered by ZeRO-Cache's own exact overlapped update and logged once; the bf16 master-weight and
optimizer-state keys and ``torch_autocast`` are implemented (their own tests: ``test_bf16_precision_modes.py``); the
keys asking for more ranks (tensor, sequence, expert parallelism) are accepted at DeepSpeed's default and refused
otherwise, naming the key and what to do instead.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import angelptm
from angelptm.config import load_config
from angelptm.engine.builders import overlap_note
from angelptm.errors import ConfigError

BATCH = {"train_batch_size": 2}
OPTIMIZER = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
ZENFLOW = {"topk_ratio": 0.05, "select_strategy": "auto", "select_interval": "auto", "update_interval": 4,
           "full_warm_up_rounds": 0, "overlap_step": True}
ZERO_CACHE = {"stage": 3, "offload_optimizer": {"device": "cpu"}}


def refused(extra: dict) -> str:
    with pytest.raises(ConfigError) as info:
        load_config({**BATCH, **extra})
    return str(info.value)


def test_zenflow_and_super_offload_load_as_deepspeed_writes_them():
    cfg = load_config({**BATCH, "zero_optimization": {
        "stage": 2, "zenflow": ZENFLOW,
        "offload_optimizer": {"device": "cpu", "super_offload": True, "cpuadam_cores_perc": 0.9}}})
    assert cfg.zero.overlap_permissions == ("zero_optimization.zenflow",
                                            "zero_optimization.offload_optimizer.super_offload")
    assert "zero_optimization.offload_optimizer.cpuadam_cores_perc" in cfg.accepted_not_acted
    assert not any(key.startswith("zero_optimization.zenflow") for key in cfg.accepted_not_acted)


@pytest.mark.parametrize("zenflow, named", [
    ({"topk_ratio": 0.0}, "zero_optimization.zenflow.topk_ratio"),
    ({"select_strategy": "sometimes"}, "zero_optimization.zenflow.select_strategy"),
    ({"topk_ration": 0.1}, "zero_optimization.zenflow.topk_ration: unknown key; did you mean 'topk_ratio'"),
])
def test_zenflow_keys_keep_deepspeeds_bounds_and_names(zenflow, named):
    assert named in refused({"zero_optimization": {"stage": 2, "zenflow": zenflow}})


def test_super_offload_false_is_no_permission():
    cfg = load_config({**BATCH, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu",
                                                                                       "super_offload": False}}})
    assert cfg.zero.overlap_permissions == () and overlap_note(cfg) is None


def test_the_permission_note_says_what_the_engine_does():
    on = load_config({**BATCH, "zero_optimization": {**ZERO_CACHE, "zenflow": ZENFLOW}})
    note = overlap_note(on)
    assert "exact overlapped update" in note and "update_in_backward" in note and "top-k" in note, note
    off = load_config({**BATCH, "zero_optimization": {"stage": 2, "zenflow": ZENFLOW}})
    assert "ZeRO-Cache is off" in overlap_note(off) and "nothing to overlap" in overlap_note(off)
    forced = load_config({**BATCH, "zero_optimization": {**ZERO_CACHE, "zenflow": ZENFLOW},
                          "zero_cache": {"update_in_backward": False}})
    assert "update_in_backward is false" in overlap_note(forced)


def test_initialize_logs_the_permission_once(caplog):
    model = nn.Linear(8, 8)
    config = {**BATCH, **OPTIMIZER, "zero_optimization": {
        **ZERO_CACHE, "zenflow": ZENFLOW, "offload_optimizer": {"device": "cpu", "super_offload": True}},
              "zero_cache": {"chunk_size": 4096}}
    with caplog.at_level(logging.INFO, logger="angelptm"):
        engine, *_ = angelptm.initialize(model=model, config=config)
    notes = [r.getMessage() for r in caplog.records if "accepted as permission" in r.getMessage()]
    assert len(notes) == 1, notes
    assert "zero_optimization.zenflow and zero_optimization.offload_optimizer.super_offload" in notes[0]
    loss = engine(torch.ones(2, 8)).square().mean()
    engine.backward(loss)
    engine.step()  # it trains, with ZeRO-Cache's own update


@pytest.mark.parametrize("key", ["bf16_master_weights_and_grads", "bf16_optimizer_states"])
def test_bf16_master_and_state_keys_follow_deepspeeds_asserts_when_true_and_load_when_false(key):
    """Implemented (test_bf16_precision_modes.py); without ZeRO DeepSpeed refuses them, as the loader does."""
    message = refused({"bf16": {"enabled": True, key: True}})
    assert f"bf16.{key}: true is only supported with zero_optimization.stage 1, 2 or 3" in message, message
    cfg = load_config({**BATCH, "bf16": {"enabled": True, key: False}})
    assert cfg.precision.dtype == torch.bfloat16
    assert (cfg.precision.master_dtype, cfg.precision.optimizer_state_dtype) == (torch.float32, torch.float32)
    assert f"bf16.{key}" not in cfg.accepted_not_acted  # false is what the engine does


def test_the_old_bfloat16_spelling_takes_the_new_keys_too():
    assert "bf16.bf16_optimizer_states: true requires" in refused({"bfloat16": {"enabled": True,
                                                                              "bf16_optimizer_states": True}})
    cfg = load_config({**BATCH, "zero_optimization": {"stage": 1}, "bfloat16": {
        "enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}})
    assert (cfg.precision.master_dtype, cfg.precision.optimizer_state_dtype) == (torch.bfloat16, torch.bfloat16)


def test_torch_autocast_enabled_keeps_fp32_parameters_and_false_changes_nothing():
    cfg = load_config({**BATCH, "torch_autocast": {"enabled": True, "dtype": "bfloat16"}})
    assert (cfg.precision.dtype, cfg.precision.autocast_dtype) == (torch.float32, torch.bfloat16)
    cfg = load_config({**BATCH, "torch_autocast": {"enabled": False}})
    assert (cfg.precision.dtype, cfg.precision.autocast_dtype) == (torch.float32, None)
    assert "torch_autocast.enable: unknown key" in refused({"torch_autocast": {"enable": True}})


@pytest.mark.parametrize("extra, named", [
    ({"managed_gradient_accumulation": False}, "managed_gradient_accumulation: false"),
    ({"gradient_allreduce_op": "sum"}, "gradient_allreduce_op: 'sum'"),
    ({"sequence_parallel_size": 2}, "sequence_parallel_size: 2"),
    ({"tensor_parallel": {"autotp_size": 2}}, "tensor_parallel.autotp_size: 2"),
    ({"tensor_parallel": {"tp": {"tp_size": 4}}}, "tensor_parallel.tp.tp_size: 4"),
    ({"expert_parallel": {"enabled": True, "autoep_size": 2}}, "expert_parallel.enabled: true"),
    ({**OPTIMIZER, "optimizer": {"type": "Adam", "params": {"fp32_optimizer_states": False}}},
     "optimizer.params.fp32_optimizer_states: false"),
    ({"optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}}, "gradient_clipping"),
])
def test_keys_asking_for_what_the_engine_does_not_do_are_refused_by_name(extra, named):
    message = refused(extra)
    assert named in message and "unknown key" not in message, message


@pytest.mark.parametrize("extra", [
    {"managed_gradient_accumulation": True}, {"gradient_allreduce_op": "mean"}, {"sequence_parallel_size": 1},
    {"tensor_parallel": {"autotp_size": 1}}, {"expert_parallel": {"enabled": False}},
    {"compile": {"deepcompile": False}}, {"disable_python_gc": True}, {"datastates_ckpt": {"enabled": False}},
    {"seq_parallel_communication_data_type": "fp32"}, {"vocabulary_size": 50257},
    {"zero_optimization": {"stage": 3, "leaf_module": {"classes": ["MixtralSparseMoeBlock"]},
                           "stage3_allgather_sequential": False, "compute_grad_norm": True}},
])
def test_the_same_keys_at_what_the_engine_does_load(extra):
    load_config({**BATCH, **extra})


def test_deepspeeds_field_names_are_read_as_their_stage3_aliases():
    cfg = load_config({**BATCH, "zero_optimization": {**ZERO_CACHE, "prefetch_bucket_size": 600_000_000}})
    assert cfg.zero_cache.gather_ahead_elements == 600_000_000  # the stage3_ key carries over
    message = refused({"zero_optimization": {"prefetch_bucket_size": 1, "stage3_prefetch_bucket_size": 2}})
    assert "given twice" in message and "zero_optimization.stage3_prefetch_bucket_size" in message
