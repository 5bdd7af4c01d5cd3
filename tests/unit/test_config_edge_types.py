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
