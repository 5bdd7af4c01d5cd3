"""Tests of angelptm.pretraining.data: tokenizer, binary token format, dataset, preprocessing.

Random inputs change every run; the seed is printed (shown on failure) and can be
fixed with ANGELPTM_TEST_SEED=<n> to replay a failing run.
"""

from __future__ import annotations

import gzip
import importlib
import importlib.util
import json
import os
import pickle
import secrets
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from launch import load_script
from torch.utils.data import DataLoader

from angelptm.pretraining.data.dataset import TokenDataset, TokenWriter, dataset_paths, read_index
from angelptm.pretraining.data.tokenizer import EOT_TOKEN, Tokenizer

# import_module, not "import ... as": angelptm.pretraining.data may re-export a function named preprocess,
# which shadows the submodule as an attribute of the package.
pp = importlib.import_module("angelptm.pretraining.data.preprocess")
REPO = Path(__file__).resolve().parents[2]
SEED = int(os.environ.get("ANGELPTM_TEST_SEED", secrets.randbits(32)))


@pytest.fixture
def rng() -> np.random.Generator:
    print(f"ANGELPTM_TEST_SEED={SEED}")
    return np.random.default_rng(SEED)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file()


def kjv_lines() -> list[str]:
    with gzip.open(pp.default_corpus_path(), "rt", encoding="utf-8") as f:
        return f.read().splitlines()


def write_dataset(prefix: Path, docs: list[np.ndarray], vocab_size: int, eot_id: int) -> list[int]:
    """Write docs with TokenWriter; return the reference stream built independently."""
    with TokenWriter(prefix, vocab_size=vocab_size, eot_id=eot_id) as w:
        for doc in docs:
            w.add_document(doc)
    ref: list[int] = []
    for doc in docs:
        ref.extend(int(t) for t in doc)
        ref.append(eot_id)
    return ref


def random_docs(rng: np.random.Generator, vocab_size: int, n: int, max_len: int) -> list[np.ndarray]:
    # Length 0 is included on purpose: an empty document is just its end-of-text token.
    return [rng.integers(0, vocab_size, size=int(rng.integers(0, max_len + 1))) for _ in range(n)]


# --- tokenizer ---------------------------------------------------------------------------

ROUND_TRIP_TEXTS = [
    "In the beginning God created the heaven and the earth.",
    "  leading and trailing spaces  \n\nand\ttabs\r\n",
    "naïve café, Größe, 日本語, Ελληνικά, emoji 🙂👍🏽, zero\u200bwidth",
    "literal <|endoftext|> inside text",
    "",
]


def test_tokenizer_round_trip_and_metadata(tok: Tokenizer) -> None:
    assert tok.vocab_size == 4096
    assert tok.decode([tok.eot_id]) == EOT_TOKEN
    for text in ROUND_TRIP_TEXTS + kjv_lines()[:50]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        # The end-of-text id must only ever come from the dataset writer, never from text.
        assert tok.eot_id not in ids
    assert tok.encode_batch(ROUND_TRIP_TEXTS) == [tok.encode(t) for t in ROUND_TRIP_TEXTS]
    ids = tok.encode("Amen.") + [tok.eot_id]
    assert tok.decode(ids, skip_special_tokens=True) == "Amen."
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([tok.vocab_size])


def test_tokenizer_pickle_keeps_behaviour(tok: Tokenizer) -> None:
    clone = pickle.loads(pickle.dumps(tok))
    text = ROUND_TRIP_TEXTS[3]
    assert clone.encode(text) == tok.encode(text)
    assert (clone.vocab_size, clone.eot_id) == (tok.vocab_size, tok.eot_id)


def test_tokenizer_is_trained_on_corpus(tok: Tokenizer) -> None:
    text = "\n".join(kjv_lines()[1000:1200])
    # A byte-level BPE with 4096 merges-plus-bytes should need far fewer tokens than bytes.
    assert len(tok.encode(text)) < 0.35 * len(text.encode("utf-8"))


def test_shipped_tokenizer_is_reproducible(tok: Tokenizer) -> None:
    retrained = load_script("tools/train_tokenizer.py").train(pp.default_corpus_path(), 4096)
    shipped = json.loads((REPO / "angelptm" / "pretraining" / "data" / "assets" / "tokenizer.json").read_text())
    again = json.loads(retrained.to_str())
    # Compare vocabulary and merges rather than bytes, which may vary between versions.
    assert again["model"]["vocab"] == shipped["model"]["vocab"]
    assert again["model"]["merges"] == shipped["model"]["merges"]


def test_tokenizer_from_file_errors(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(FileNotFoundError, match="nope.json"):
        Tokenizer.from_file(missing)
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    with pytest.raises(ValueError, match="garbage.json"):
        Tokenizer.from_file(garbage)
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    no_eot = tmp_path / "no_eot.json"
    HFTokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[])).save(str(no_eot))
    with pytest.raises(ValueError, match="no_eot.json.*endoftext"):
        Tokenizer.from_file(no_eot)


# --- binary format and dataset -----------------------------------------------------------

def check_windows(ds: TokenDataset, ref: list[int]) -> None:
    seq = ds.seq_len
    assert len(ds) == (len(ref) - 1) // seq
    for i in range(len(ds)):
        sample = ds[i]
        assert sample["input_ids"].dtype == torch.long and sample["labels"].dtype == torch.long
        assert sample["input_ids"].tolist() == ref[i * seq:(i + 1) * seq], f"window {i}, seed {SEED}"
        assert sample["labels"].tolist() == ref[i * seq + 1:(i + 1) * seq + 1], f"window {i}, seed {SEED}"
    with pytest.raises(IndexError):
        ds[len(ds)]
    assert ds[-1]["labels"].tolist() == ds[len(ds) - 1]["labels"].tolist()


def test_writer_reader_round_trip(tmp_path: Path, rng: np.random.Generator) -> None:
    vocab = 4096
    eot = int(rng.integers(0, vocab))
    docs = random_docs(rng, vocab, n=int(rng.integers(1, 60)), max_len=300)
    ref = write_dataset(tmp_path / "ds", docs, vocab, eot)
    for seq_len in {1, 2, int(rng.integers(3, 64)), len(ref) - 1}:
        ds = TokenDataset(tmp_path / "ds", seq_len)
        assert (ds.num_tokens, ds.num_documents, ds.vocab_size, ds.eot_id) == (len(ref), len(docs), vocab, eot)
        check_windows(ds, ref)
    for view in (ds, pickle.loads(pickle.dumps(ds))):  # the copy reloads the offsets lazily
        for i, doc in enumerate(docs):
            assert view.document(i).tolist() == doc.tolist()
    assert dataset_paths(tmp_path / "ds")[0].stat().st_size == 2 * len(ref)


@pytest.mark.parametrize("vocab_size, itemsize", [(65536, 2), (65537, 4), (200_000, 4)])
def test_token_width(tmp_path: Path, rng: np.random.Generator, vocab_size: int, itemsize: int) -> None:
    docs = random_docs(rng, vocab_size, n=20, max_len=100)
    docs.append(np.array([vocab_size - 1, 0, vocab_size - 1]))  # the extreme ids must survive
    ref = write_dataset(tmp_path / "w", docs, vocab_size, eot_id=vocab_size - 1)
    assert dataset_paths(tmp_path / "w")[0].stat().st_size == itemsize * len(ref)
    check_windows(TokenDataset(tmp_path / "w", 7), ref)


def test_writer_rejects_bad_ids(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="outside"):
        with TokenWriter(tmp_path / "bad", vocab_size=100, eot_id=0) as w:
            w.add_document([5, 100])
    assert list(tmp_path.iterdir()) == []  # the failed writer left nothing behind


def test_failed_write_keeps_existing_dataset(tmp_path: Path, rng: np.random.Generator) -> None:
    docs = random_docs(rng, 500, n=10, max_len=50)
    ref = write_dataset(tmp_path / "ds", docs, 500, eot_id=1)
    with pytest.raises(RuntimeError, match="crash"):
        with TokenWriter(tmp_path / "ds", vocab_size=500, eot_id=1) as w:
            w.add_document([1, 2, 3] * 1000)
            raise RuntimeError("simulated crash")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds.bin", "ds.idx"]
    check_windows(TokenDataset(tmp_path / "ds", 5), ref)


def _mutate_magic(bin_path: Path, idx_path: Path) -> None:
    idx_path.write_bytes(b"NOTMAGIC" + idx_path.read_bytes()[8:])


def _mutate_version(bin_path: Path, idx_path: Path) -> None:
    raw = bytearray(idx_path.read_bytes())
    struct.pack_into("<I", raw, 8, 99)
    idx_path.write_bytes(bytes(raw))


def _truncate_idx(bin_path: Path, idx_path: Path) -> None:
    idx_path.write_bytes(idx_path.read_bytes()[:-8])


def _truncate_header(bin_path: Path, idx_path: Path) -> None:
    idx_path.write_bytes(idx_path.read_bytes()[:20])


def _truncate_bin(bin_path: Path, idx_path: Path) -> None:
    bin_path.write_bytes(bin_path.read_bytes()[:-2])


def _swap_offsets(bin_path: Path, idx_path: Path) -> None:
    raw = bytearray(idx_path.read_bytes())
    raw[48:56], raw[56:64] = raw[56:64], raw[48:56]
    idx_path.write_bytes(bytes(raw))


@pytest.mark.parametrize("mutate, file, what", [
    (_mutate_magic, "idx", "bad magic"),
    (_mutate_version, "idx", "version 99"),
    (_truncate_idx, "idx", "size mismatch"),
    (_truncate_header, "idx", "truncated header"),
    (_truncate_bin, "bin", "size mismatch"),
    (_swap_offsets, "idx", "offsets"),
])
def test_corrupt_dataset_is_rejected(tmp_path: Path, mutate, file: str, what: str) -> None:
    write_dataset(tmp_path / "ds", [np.arange(10), np.arange(5), np.arange(7)], 100, eot_id=99)
    bin_path, idx_path = dataset_paths(tmp_path / "ds")
    read_index(tmp_path / "ds")  # valid before the mutation
    mutate(bin_path, idx_path)
    with pytest.raises(ValueError, match=f"ds.{file}.*{what}"):
        TokenDataset(tmp_path / "ds", 4)


def test_too_small_dataset(tmp_path: Path) -> None:
    write_dataset(tmp_path / "tiny", [np.arange(4)], 10, eot_id=9)  # 5 tokens with the EOT
    assert len(TokenDataset(tmp_path / "tiny", 4)) == 1
    with pytest.raises(ValueError, match="has 5 tokens.*at least 6"):
        TokenDataset(tmp_path / "tiny", 5)


def test_dataset_pickles_without_data_and_loads_in_workers(tmp_path: Path, rng: np.random.Generator) -> None:
    ref = write_dataset(tmp_path / "ds", random_docs(rng, 4096, n=40, max_len=400), 4096, eot_id=0)
    ds = TokenDataset(tmp_path / "ds", 16)
    expected = torch.stack([ds[i]["input_ids"] for i in range(len(ds))])  # opens the memmap
    # The memmap must not be pickled (spawn/forkserver workers): it would copy the whole
    # token file into each worker. The unpickled copy reopens it on first use.
    data = pickle.dumps(ds)
    assert len(data) < 4096 < 2 * len(ref)
    assert torch.equal(pickle.loads(data)[len(ds) - 1]["input_ids"], expected[-1])
    batches = list(DataLoader(ds, batch_size=5, num_workers=2))
    assert torch.equal(torch.cat([b["input_ids"] for b in batches]), expected)
    assert torch.equal(torch.cat([b["labels"][:, :-1] for b in batches]), expected[:, 1:])


# --- preprocessing -----------------------------------------------------------------------

def decoded_documents(tok: Tokenizer, prefix: Path) -> list[str]:
    ds = TokenDataset(prefix, 1)
    assert ds.tokens[-1] == tok.eot_id
    return [tok.decode(ds.document(i)) for i in range(ds.num_documents)]


def test_preprocess_text(tmp_path: Path, tok: Tokenizer, capsys: pytest.CaptureFixture) -> None:
    long_para = [f"line {i}: ünïcödé ✓" for i in range(7)]
    paragraphs = [["First paragraph,", "two lines."], long_para, ["  indented   last  "]]
    # Several blank lines (one with spaces) separate paragraphs; --max-lines 3 cuts long_para.
    (tmp_path / "in.txt").write_text("\n\n".join("\n".join(p) for p in paragraphs) + "\n \n\n", "utf-8")
    with gzip.open(tmp_path / "in.txt.gz", "wt", encoding="utf-8") as f:
        f.write((tmp_path / "in.txt").read_text("utf-8").replace("\n", "\r\n"))
    expected = ["First paragraph,\ntwo lines.", "\n".join(long_para[:3]), "\n".join(long_para[3:6]),
                long_para[6], "  indented   last  "]
    for name in ("in.txt", "in.txt.gz"):
        prefix = tmp_path / name.replace(".", "_")
        assert pp.main(["--input", str(tmp_path / name), "--output-prefix", str(prefix), "--max-lines", "3"]) == 0
        assert decoded_documents(tok, prefix) == expected
        assert f"documents: {len(expected)}" in capsys.readouterr().out


def test_preprocess_jsonl(tmp_path: Path, tok: Tokenizer, rng: np.random.Generator) -> None:
    alphabet = list("abc XYZ\n\t\"\\{}é日🙂") + ["<|endoftext|>"]
    texts = ["".join(rng.choice(alphabet, size=int(rng.integers(1, 40)))) for _ in range(30)]
    lines = [json.dumps({"id": i, "body": t}, ensure_ascii=bool(i % 2)) for i, t in enumerate(texts)]
    (tmp_path / "a.jsonl").write_text("\n".join(lines[:15]) + "\n\n", "utf-8")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("\n".join(lines[15:]))
    argv = ["--input", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl.gz"), "--jsonl-key", "body"]
    assert pp.main(argv + ["--output-prefix", str(tmp_path / "j")]) == 0
    assert decoded_documents(tok, tmp_path / "j") == texts
    # A process pool must produce the very same bytes.
    assert pp.main(argv + ["--output-prefix", str(tmp_path / "j2"), "--workers", "2"]) == 0
    for a, b in zip(dataset_paths(tmp_path / "j"), dataset_paths(tmp_path / "j2")):
        assert a.read_bytes() == b.read_bytes()


@pytest.mark.parametrize("content, message", [
    ('{"text": "ok"}\n{"text": "ok"}\n{"text": oops}\n', r"bad\.jsonl:3: invalid JSON"),
    ('{"text": "ok"}\n\n{"txt": "x"}\n', r"bad\.jsonl:3: no key 'text' \(keys: txt\)"),
    ('{"text": 5}\n', r"bad\.jsonl:1: 'text' is int"),
    ('["text"]\n', r"bad\.jsonl:1: expected a JSON object"),
])
def test_preprocess_jsonl_errors(tmp_path: Path, capsys: pytest.CaptureFixture, content: str, message: str) -> None:
    (tmp_path / "bad.jsonl").write_text(content)
    with pytest.raises(ValueError, match=message):
        pp.preprocess([tmp_path / "bad.jsonl"], tmp_path / "out", Tokenizer.from_file(), progress=False)
    assert pp.main(["--input", str(tmp_path / "bad.jsonl"), "--output-prefix", str(tmp_path / "out")]) == 1
    assert "bad.jsonl:" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]  # no partial output


def test_preprocess_rejects_non_utf8(tmp_path: Path) -> None:
    (tmp_path / "latin1.txt").write_bytes("fine\nna\xefve\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.txt:2: not valid UTF-8"):
        pp.preprocess([tmp_path / "latin1.txt"], tmp_path / "out", Tokenizer.from_file(), progress=False)


@pytest.fixture(scope="module")
def default_dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    return pp.prepare_default_dataset(tmp_path_factory.mktemp("cache"))


def test_prepare_default_dataset(default_dataset: str, tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    lines = kjv_lines()
    n = pp.DEFAULT_MAX_LINES
    chunks = ["\n".join(lines[i:i + n]) for i in range(0, len(lines), n)]
    ds = TokenDataset(default_dataset, 256)
    assert ds.num_documents == len(chunks) and ds.vocab_size == tok.vocab_size
    # The whole corpus comes back: documents of DEFAULT_MAX_LINES verses, EOT after each.
    assert tok.decode(ds.tokens) == "".join(c + EOT_TOKEN for c in chunks)

    def no_rebuild(*args, **kwargs):
        raise AssertionError("a valid cached dataset was rebuilt")

    monkeypatch.setattr(pp, "preprocess", no_rebuild)
    assert pp.prepare_default_dataset(Path(default_dataset).parent) == default_dataset


def test_prepare_default_dataset_rebuilds_corrupt_cache(default_dataset: str, tmp_path: Path) -> None:
    good_bin, good_idx = dataset_paths(default_dataset)
    bin_path, idx_path = dataset_paths(tmp_path / "kjv")
    bin_path.write_bytes(good_bin.read_bytes()[:1000])  # an interrupted copy, say
    idx_path.write_bytes(good_idx.read_bytes())
    (tmp_path / "kjv.meta.json").write_bytes((Path(default_dataset).parent / "kjv.meta.json").read_bytes())
    assert pp.prepare_default_dataset(tmp_path) == str(tmp_path / "kjv")
    assert bin_path.read_bytes() == good_bin.read_bytes()
