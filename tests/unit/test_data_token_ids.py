"""Token ids beyond the vocabulary (issue 29, point 2): refused when written and when opened, naming file and offset.

They used to end training with a bare ``IndexError: index out of range in self`` at the step that read them,
and auto-resume replayed the same batch into the same crash.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest

from angelptm.errors import DataError
from angelptm.pretraining.data import TokenDataset, TokenWriter
from angelptm.pretraining.data import dataset as dataset_module

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 64


def write(prefix: Path, documents: list[np.ndarray], vocab: int = VOCAB) -> None:
    with TokenWriter(prefix, vocab_size=vocab, eot_id=0) as writer:
        for ids in documents:
            writer.add_document(ids)


def documents(rng: np.random.Generator, count: int = 5, length: int = 300) -> list[np.ndarray]:
    return [rng.integers(1, VOCAB, length) for _ in range(count)]


def test_the_writer_refuses_an_id_beyond_its_vocabulary_and_writes_nothing(tmp_path):
    rng = np.random.default_rng(0)
    docs = documents(rng)
    docs[2][17] = VOCAB + 5
    with pytest.raises(DataError, match=rf"data\.bin: document 2, token 17: id {VOCAB + 5} is outside "
                                        rf"\[0, vocab_size={VOCAB}\).*re-tokenize"):
        write(tmp_path / "data", docs)
    assert list(tmp_path.iterdir()) == []  # no dataset that looks complete, no temporary file left


@pytest.mark.parametrize("piece_tokens", [1 << 24, 97])  # one piece, and offsets across piece boundaries
def test_opening_a_file_with_an_id_beyond_the_header_names_the_first_one(tmp_path, monkeypatch, piece_tokens):
    monkeypatch.setattr(dataset_module, "SCAN_PIECE_TOKENS", piece_tokens)
    rng = np.random.default_rng(random.randrange(1 << 30))
    docs = documents(rng)
    prefix = tmp_path / "data"
    write(prefix, docs)
    tokens = np.memmap(f"{prefix}.bin", dtype="<u2", mode="r+")
    planted = sorted(rng.choice(len(tokens), 2, replace=False))  # the first one is named
    for offset, value in zip(planted, (VOCAB, 1000)):
        tokens[offset] = value
    tokens.flush()
    del tokens
    starts = np.cumsum([0] + [len(d) + 1 for d in docs])
    document = int(np.searchsorted(starts, planted[0], side="right")) - 1
    with pytest.raises(DataError) as refused:
        TokenDataset(prefix, seq_len=16)
    message = str(refused.value)
    assert message.startswith(f"{prefix}.bin: token {planted[0]} (byte {2 * planted[0]}, document {document}) is id "
                              f"{VOCAB}, but the dataset's header gives a vocabulary of {VOCAB} (ids 0-{VOCAB - 1})")


def test_a_clean_file_opens_and_a_larger_header_vocabulary_than_the_model_is_refused(tmp_path):
    prefix = tmp_path / "data"
    write(prefix, documents(np.random.default_rng(1)))
    dataset = TokenDataset(prefix, seq_len=16)
    dataset.check_vocabulary(VOCAB)
    with pytest.raises(DataError, match=rf"vocabulary has {VOCAB} tokens but model\.vocab_size is 32; raise"):
        dataset.check_vocabulary(32)


def test_pretrain_stops_before_training_naming_the_file_and_offset(tmp_path, capsys, monkeypatch):
    sys.path.insert(0, str(ROOT))
    import pretrain as job

    def must_not_run(*args, **kwargs):
        raise AssertionError("the run should stop before building the model")

    monkeypatch.setattr(job, "build_model", must_not_run)
    prefix = tmp_path / "data"
    write(prefix, documents(np.random.default_rng(2)))
    tokens = np.memmap(f"{prefix}.bin", dtype="<u2", mode="r+")
    tokens[1234] = 4000
    tokens.flush()
    del tokens
    save_dir = tmp_path / f"run{random.randrange(1 << 30)}"
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": False},
              "model": {"vocab_size": VOCAB, "max_seq_len": 16, "num_layers": 1, "hidden_size": 32, "num_heads": 4},
              "data": {"path": str(prefix)}, "train": {"steps": 3, "save_dir": str(save_dir)}}
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(config))
    assert job.main(["--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    assert f"{prefix}.bin: token 1234 (byte 2468" in err and "is id 4000" in err
    assert not save_dir.exists()


def test_pretrain_names_a_missing_dataset_in_one_line(tmp_path, capsys):
    sys.path.insert(0, str(ROOT))
    import pretrain as job

    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "data": {"path": str(tmp_path / "nothing")},
                                "train": {"save_dir": str(tmp_path / "run")}}))
    assert job.main(["--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: data.path '{tmp_path / 'nothing'}': ") and "\n" not in err
