"""Issue 38: ``export --hf`` of a GPT-2-flavour model with a 4096-token vocabulary wrote ``bos/eos_token_id: 50256``
(GPT2Config's defaults, outside the vocabulary: ``generate()`` never stops). The ids are now inside it."""

from __future__ import annotations

import logging

import pytest

from angelptm.checkpoints import architecture, hf_export
from angelptm.errors import CheckpointError
from angelptm.pretraining.models import ModelConfig, build_model

pytest.importorskip("transformers")

SMALL = dict(vocab_size=4096, max_seq_len=16, num_layers=1, hidden_size=32, num_heads=2)


def exported(flavour: str, **kwargs):
    model = build_model(ModelConfig(flavour=flavour, **SMALL))
    record = architecture.describe(model)
    return hf_export.pretrained_files(record, model.state_dict(), {}, **kwargs)[0]


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_exported_special_token_ids_are_inside_the_vocabulary(flavour, caplog):
    with caplog.at_level(logging.WARNING, logger="angelptm.checkpoints.hf_export"):
        config = exported(flavour)
    for name in ("bos_token_id", "eos_token_id"):
        value = getattr(config, name)
        assert value is None or 0 <= value < config.vocab_size, (name, value)
    if flavour == "gpt2":  # its defaults (50256) were outside: left out, with a line saying so and how to set them
        assert config.eos_token_id is None and "eos_token_id" in caplog.text and "50256" in caplog.text
        assert "4096" in caplog.text


def test_the_runs_end_of_text_id_is_written_when_known():
    config = exported("gpt2", eos_token_id=4095)
    assert (config.bos_token_id, config.eos_token_id) == (4095, 4095)


def test_an_end_of_text_id_outside_the_vocabulary_is_refused_by_name():
    with pytest.raises(CheckpointError) as info:
        exported("gpt2", eos_token_id=50256)
    assert "eos_token_id" in str(info.value) and "50256" in str(info.value) and "4096" in str(info.value)
