"""Issue 38: ``data.tokenizer`` was documented but never read; a missing or garbage file trained silently with the
shipped tokenizer. It is now loaded at the start of the run, and used."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from angelptm.errors import ConfigError
from angelptm.pretraining.data.dataset import read_index
from angelptm.pretraining.data.preprocess import prepare_default_dataset
from angelptm.pretraining.data.tokenizer import EOT_TOKEN, configured_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def small_tokenizer(path: Path, vocab_size: int = 300) -> Path:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["In the beginning God created the heaven and the earth."] * 20, trainer)
    tok.save(str(path))
    return path


def test_a_missing_tokenizer_file_is_refused_by_key(tmp_path):
    with pytest.raises(ConfigError) as info:
        configured_tokenizer(str(tmp_path / "nope.json"), model_vocab_size=4096)
    message = str(info.value)
    assert "data.tokenizer" in message and "nope.json" in message and "null" in message


def test_a_garbage_tokenizer_file_is_refused_by_key_in_one_line(tmp_path):
    garbage = tmp_path / "garbage.json"
    garbage.write_bytes(b"\x00\x01 not a tokenizer {")
    with pytest.raises(ConfigError) as info:
        configured_tokenizer(str(garbage), model_vocab_size=4096)
    message = str(info.value)
    assert "data.tokenizer" in message and "garbage.json" in message and "\n" not in message


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(tmp_path):
    path = small_tokenizer(tmp_path / "t.json")
    with pytest.raises(ConfigError) as info:
        configured_tokenizer(str(path), model_vocab_size=100)
    message = str(info.value)
    size = str(HFTokenizer.from_file(str(path)).get_vocab_size())  # ~290: the training text runs out of merges
    assert "data.tokenizer" in message and "model.vocab_size 100" in message and f"has {size} tokens" in message


def test_the_shipped_corpus_is_tokenized_with_the_configured_tokenizer(tmp_path):
    path = small_tokenizer(tmp_path / "t.json")
    tok = configured_tokenizer(str(path), model_vocab_size=4096)
    prefix = prepare_default_dataset(tmp_path / "cache", tokenizer=tok)
    assert read_index(prefix).vocab_size == tok.vocab_size < 4096
    assert read_index(prepare_default_dataset(tmp_path / "cache")).vocab_size == 4096  # the shipped one, beside it


def test_pretrain_refuses_a_missing_tokenizer_at_start(tmp_path, capsys, monkeypatch):
    sys.path.insert(0, str(ROOT))
    import pretrain as job

    def must_not_run(*args, **kwargs):
        raise AssertionError("refused before the model is built")

    monkeypatch.setattr(job, "build_model", must_not_run)
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"train_batch_size": 2, "model": {"num_layers": 1, "hidden_size": 32, "num_heads": 2},
                                  "data": {"tokenizer": str(tmp_path / "missing.json"),
                                           "cache_dir": str(tmp_path / "cache")}}))
    code = job.main(["--config", str(config), "--save-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and "data.tokenizer" in err and "missing.json" in err
