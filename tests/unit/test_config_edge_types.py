"""Types at the JSON edge (issue 29, point 7): numeric strings read as DeepSpeed's pydantic sections read them; a
JSON boolean for a number, or NaN/Infinity, is an error naming the key (``true`` used to become micro-batch 1)."""

from __future__ import annotations

import pytest

from angelptm.config import load_config
from angelptm.errors import ConfigError


def test_numeric_strings_are_read_as_deepspeed_reads_them():
    from deepspeed.runtime.config import DeepSpeedConfig

    zero = {"stage": "2", "reduce_bucket_size": "1000", "allgather_bucket_size": "2000.0"}
    ours = load_config({"train_batch_size": 4, "zero_optimization": dict(zero)}, device_type="cpu")
    reference = DeepSpeedConfig({"train_batch_size": 4, "zero_optimization": dict(zero)})
    assert (ours.zero.stage, ours.zero.reduce_bucket_size) == (reference.zero_config.stage,
                                                               reference.zero_config.reduce_bucket_size) == (2, 1000)
    for unreadable in ({"allgather_bucket_size": "2e3"},):  # an int field refuses a float's text in both
        with pytest.raises(ConfigError, match="allgather_bucket_size"):
            load_config({"train_batch_size": 4, "zero_optimization": unreadable}, device_type="cpu")
        with pytest.raises(Exception, match="allgather_bucket_size"):
            DeepSpeedConfig({"train_batch_size": 4, "zero_optimization": unreadable})
    cfg = load_config({"train_micro_batch_size_per_gpu": "4", "gradient_accumulation_steps": "2",
                       "gradient_clipping": "1.0", "optimizer": {"type": "AdamW", "params": {"lr": "3e-4"}},
                       "model": {"num_heads": "2", "hidden_size": "64"}}, device_type="cpu")
    assert (cfg.batch.micro_batch_size, cfg.batch.gradient_accumulation_steps, cfg.gradient_clipping) == (4, 2, 1.0)
    assert cfg.optimizer.lr == 3e-4 and (cfg.model.num_heads, cfg.model.hidden_size) == (2, 64)


@pytest.mark.parametrize("section, path", [
    ({"train_micro_batch_size_per_gpu": True}, "train_micro_batch_size_per_gpu"),
    ({"train_batch_size": 4, "gradient_clipping": True}, "gradient_clipping"),
    ({"train_batch_size": 4, "zero_optimization": {"stage": True}}, "zero_optimization.stage"),
    ({"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"betas": [0.9, False]}}},
     "optimizer.params.betas[1]"),
    ({"train_batch_size": 4, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": True}}},
     "scheduler.params.warmup_num_steps"),
    ({"train_batch_size": 4, "model": {"num_layers": True}}, "model.num_layers"),
    ({"train_batch_size": 4, "zero_cache": {"enabled": True, "device_memory_budget": False}},
     "zero_cache.device_memory_budget"),
    ({"train_batch_size": 4, "train": {"steps": True}}, "train.steps"),
])
def test_a_boolean_for_a_number_is_an_error_naming_the_key(section, path):
    with pytest.raises(ConfigError) as refused:
        load_config(section, device_type="cpu")
    assert f"{path}: expected a number" in str(refused.value) and "JSON boolean" in str(refused.value)


def test_booleans_stay_fine_where_a_boolean_is_due():
    cfg = load_config({"train_batch_size": 4, "bf16": {"enabled": False}, "zero_cache": {"enabled": True},
                       "model": {"bias": True, "tie_embeddings": False}}, device_type="cpu")
    assert cfg.zero_cache.enabled and cfg.model.bias is True and cfg.model.tie_embeddings is False


@pytest.mark.parametrize("literal, shown", [("NaN", "NaN"), ("Infinity", "Infinity"), ("-Infinity", "-Infinity")])
def test_non_finite_numbers_in_a_json_file_name_the_key(tmp_path, literal, shown):
    path = tmp_path / "cfg.json"  # Python's json module reads these literals; JSON itself has none
    path.write_text('{"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": %s}}}' % literal)
    with pytest.raises(ConfigError, match=rf"optimizer\.params\.lr: {shown} is not a usable value"):
        load_config(str(path), device_type="cpu")


def _numeric_keys(model, prefix: str) -> list[str]:
    """Every key of ``model`` (nested sections too) whose type is a number and not a boolean, as ``a.b.c``."""
    import typing

    import pydantic

    keys = []
    for name, info in model.model_fields.items():
        members = typing.get_args(info.annotation) or (info.annotation,)
        nested = [m for m in members if isinstance(m, type) and issubclass(m, pydantic.BaseModel)]
        literals = [a for m in members if typing.get_origin(m) is typing.Literal for a in typing.get_args(m)]
        if nested:
            keys += _numeric_keys(nested[0], f"{prefix}{info.alias or name}.")
        elif bool not in members and (int in members or float in members or any(type(a) is int for a in literals)):
            keys.append(f"{prefix}{info.alias or name}")
    return keys


def _nested(path: str, value) -> dict:
    section: dict = {"train_batch_size": 4}
    where = section
    *parents, key = path.split(".")
    for parent in parents:
        where = where.setdefault(parent, {})
    where[key] = value
    return section


def test_true_is_refused_for_every_numeric_key_of_the_precision_and_zero_sections():
    from angelptm.config import edge

    paths = [path for name, model in (("fp16", edge.FP16Section), ("bf16", edge.BF16Section),
                                      ("zero_optimization", edge.ZeroSection))
             for path in _numeric_keys(model, f"{name}.")]
    assert {"fp16.min_loss_scale", "fp16.loss_scale", "zero_optimization.reduce_bucket_size",
            "zero_optimization.offload_param.buffer_count", "zero_optimization.zenflow.topk_ratio"} <= set(paths)
    for path in paths:
        for flag in (True, False):
            with pytest.raises(ConfigError) as refused:
                load_config(_nested(path, flag), device_type="cpu")
            message = str(refused.value)
            assert f"{path}: expected a number" in message and f"got {str(flag).lower()}" in message, (path, message)


def test_the_deprecated_zero_optimization_true_refuses_a_boolean_allgather_size():
    """``"zero_optimization": true`` takes the top-level ``allgather_size`` as its bucket: a number, as there."""
    from angelptm.config import edge

    raw = {"zero_optimization": True, "allgather_size": 2000}
    edge.upgrade_deprecated_keys(raw)
    assert raw == {"zero_optimization": {"stage": 1, "allgather_bucket_size": 2000}}
    assert load_config({"train_batch_size": 4, "zero_optimization": True, "allgather_size": 2000},
                       device_type="cpu").zero.stage == 1
    with pytest.raises(ConfigError, match=r"allgather_size: expected a number, got true"):
        load_config({"train_batch_size": 4, "zero_optimization": True, "allgather_size": True}, device_type="cpu")
