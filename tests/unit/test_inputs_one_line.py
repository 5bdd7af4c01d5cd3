"""Issue 38: inputs that ended in a traceback or were taken silently now end in one line naming them."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest
import torch

from angelptm.errors import DataError
from angelptm.pretraining.data import preprocess
from angelptm.pretraining.data.loader import ResumableDataLoader

ROOT = Path(__file__).resolve().parents[2]
SMALL_MODEL = {"num_layers": 1, "hidden_size": 32, "num_heads": 2, "vocab_size": 4096, "max_seq_len": 64}


def test_a_truncated_gz_input_is_one_line_naming_the_file(tmp_path, capsys):
    whole = gzip.compress(b"".join(b"line %d of a document that goes on\n" % i for i in range(2000)))
    source = tmp_path / "corpus.txt.gz"
    source.write_bytes(whole[:len(whole) // 2])
    code = preprocess.main(["--input", str(source), "--output-prefix", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and "Traceback" not in err and len(err.splitlines()) == 1
    assert str(source) in err and "truncated" in err


class Samples(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def test_a_micro_batch_above_the_samples_per_epoch_names_the_key():
    with pytest.raises(DataError) as info:
        ResumableDataLoader(Samples(37), 100)
    message = str(info.value)
    assert "train_micro_batch_size_per_gpu" in message and "100" in message and "37" in message
    assert "at most 37" in message


def run_pretrain(tmp_path: Path, capsys, config: dict, *args: str) -> tuple[int, str]:
    sys.path.insert(0, str(ROOT))
    import pretrain as job

    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    code = job.main(["--config", str(path), "--save-dir", str(tmp_path / "run"), *args])
    return code, capsys.readouterr().err.strip()


def test_pretrain_with_a_micro_batch_above_the_epoch_is_one_line(tmp_path, capsys):
    config = {"train_micro_batch_size_per_gpu": 100_000, "bf16": {"enabled": False}, "model": SMALL_MODEL,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "data": {"cache_dir": str(tmp_path / "cache")}, "train": {"steps": 1}}
    code, err = run_pretrain(tmp_path, capsys, config)
    line = err.splitlines()[-1]
    assert code == 2 and line.startswith("error: ") and "Traceback" not in err
    assert "train_micro_batch_size_per_gpu 100000" in line


@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf"])
def test_plan_tflops_must_be_a_positive_number(tmp_path, capsys, value):
    with pytest.raises(SystemExit) as info:
        run_pretrain(tmp_path, capsys, {"train_batch_size": 2}, "--plan", "--tflops", value)
    err = capsys.readouterr().err
    assert info.value.code == 2 and "--tflops" in err and value in err and "> 0" in err


def test_a_gz_of_junk_is_one_line_naming_the_file(tmp_path, capsys):
    source = tmp_path / "junk.txt.gz"
    source.write_bytes(b"\x1f\x8b" + b"this is not deflate data" * 10)  # gzip's magic, then junk
    code = preprocess.main(["--input", str(source), "--output-prefix", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and "Traceback" not in err and len(err.splitlines()) == 1
    assert str(source) in err and "not a valid gzip file" in err and "Unknown compression method" in err, err


def test_a_tokenizer_path_that_is_a_directory_says_so(tmp_path, capsys):
    from angelptm.errors import ConfigError
    from angelptm.pretraining.data.tokenizer import configured_tokenizer, default_tokenizer_path

    folder = tmp_path / "tok"
    folder.mkdir()
    with pytest.raises(ConfigError) as info:
        configured_tokenizer(str(folder), model_vocab_size=4096)
    message = str(info.value)
    assert "is a directory" in message and "no such file" not in message and str(folder) in message, message
    (folder / "tokenizer.json").write_bytes(default_tokenizer_path().read_bytes())
    with pytest.raises(ConfigError, match=r"is a directory.*tok/tokenizer\.json"):  # the file inside it, named
        configured_tokenizer(str(folder), model_vocab_size=4096)
    code = preprocess.main(["--input", str(tmp_path / "in.txt"), "--tokenizer", str(folder),
                            "--output-prefix", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1 and "is a directory" in err and "not found" not in err, err


def test_an_input_path_that_is_a_directory_says_so(tmp_path, capsys):
    code = preprocess.main(["--input", str(tmp_path), "--output-prefix", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1 and "is a directory" in err and str(tmp_path) in err and "not found" not in err, err
