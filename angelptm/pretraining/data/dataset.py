"""Binary token files and the memory-mapped dataset that reads them.

A dataset with prefix ``P`` is two files:

``P.bin``
    Every document's token ids, concatenated, each document followed by the
    end-of-text id. Little-endian ``uint16``, or ``uint32`` when an id can exceed 65535.

``P.idx``
    A 48-byte little-endian header, then ``num_documents`` uint64 start offsets
    (in tokens) of the documents in ``P.bin``. Document ``i`` spans
    ``[start[i], start[i+1])`` (``num_tokens`` for the last), its end-of-text included.

    ======  ====  ===========================================
    offset  type  field
    ======  ====  ===========================================
    0       8s    magic ``b"APTMTOK\\0"``
    8       u32   format version (1)
    12      u32   dtype code: 1 = uint16, 2 = uint32
    16      u64   vocab_size
    24      u64   eot_id
    32      u64   num_documents
    40      u64   num_tokens
    ======  ====  ===========================================

:class:`TokenWriter` writes both files under temporary names and renames them into
place only when complete; :func:`read_index` checks every field against the files.
"""

from __future__ import annotations

import dataclasses
import operator
import os
import struct
import uuid
from array import array
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from angelptm.errors import DataError

MAGIC = b"APTMTOK\0"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sIIQQQQ")
_DTYPES: dict[int, np.dtype] = {1: np.dtype("<u2"), 2: np.dtype("<u4")}
SCAN_PIECE_TOKENS = 1 << 24
"""Tokens read at a time when a dataset is opened and its ids are checked (32-64 MiB of the file)."""
RETOKENIZE = ("re-tokenize the text with the tokenizer the model is trained with "
              "(angelptm-preprocess --output-prefix NEW_PREFIX, or TokenWriter with that tokenizer's vocab_size)")


def _temp_path(target: Path) -> Path:
    # Same directory as the target so os.replace is an atomic rename; a unique name so
    # concurrent writers never collide; created with open(..., "xb") (not mkstemp) so the
    # final files get the usual umask-based permissions rather than 0600.
    return target.with_name(f"{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}")


def _dtype_code(vocab_size: int) -> int:
    # uint16 holds ids up to 65535, i.e. vocabularies of up to 65536 tokens.
    return 1 if vocab_size <= 1 << 16 else 2


def dataset_paths(prefix: str | os.PathLike[str]) -> tuple[Path, Path]:
    """Return the ``(P.bin, P.idx)`` paths of the dataset with prefix ``P``.

    Args:
        prefix: the dataset prefix, e.g. ``data/kjv`` for ``data/kjv.bin`` + ``data/kjv.idx``.

    Returns:
        The paths of the token file and of the index file.
    """
    p = os.fspath(prefix)
    return Path(p + ".bin"), Path(p + ".idx")


@dataclasses.dataclass(frozen=True)
class TokenIndex:
    """The validated contents of a ``.idx`` file."""

    bin_path: Path
    idx_path: Path
    dtype: np.dtype
    vocab_size: int
    eot_id: int
    num_documents: int
    num_tokens: int
    offsets: np.ndarray  # uint64 start of each document, in tokens


def read_index(prefix: str | os.PathLike[str]) -> TokenIndex:
    """Read and validate the index of the dataset with prefix ``prefix``.

    Args:
        prefix: the dataset prefix (without ``.bin`` / ``.idx``).

    Returns:
        The index, checked against the size of the ``.bin`` file.

    Raises:
        FileNotFoundError: ``P.idx`` or ``P.bin`` is missing.
        ValueError: either file is corrupt, truncated or of another format version.
    """
    bin_path, idx_path = dataset_paths(prefix)
    for path in (idx_path, bin_path):
        if not path.is_file():
            raise FileNotFoundError(
                f"dataset file not found: {path}; create the dataset with angelptm-preprocess"
            )
    raw = idx_path.read_bytes()
    if len(raw) < _HEADER.size:
        raise ValueError(f"{idx_path}: truncated header ({len(raw)} of {_HEADER.size} bytes)")
    magic, version, code, vocab, eot, ndocs, ntoks = _HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise ValueError(f"{idx_path}: bad magic {magic!r} (expected {MAGIC!r}); not an angelptm token index")
    if version != FORMAT_VERSION:
        raise ValueError(
            f"{idx_path}: format version {version}, this angelptm reads version {FORMAT_VERSION}; "
            "re-run angelptm-preprocess"
        )
    if code not in _DTYPES:
        raise ValueError(f"{idx_path}: unknown dtype code {code} (expected one of {sorted(_DTYPES)})")
    if vocab == 0 or eot >= vocab or code != _dtype_code(vocab):
        raise ValueError(f"{idx_path}: inconsistent header: vocab_size {vocab}, eot_id {eot}, "
                         f"dtype code {code}; the file is corrupt")
    expected_idx = _HEADER.size + 8 * ndocs
    if len(raw) != expected_idx:
        raise ValueError(
            f"{idx_path}: size mismatch: {len(raw)} bytes, but a header for {ndocs} documents "
            f"needs {expected_idx}; the file is truncated or corrupt"
        )
    dtype = _DTYPES[code]
    bin_size = bin_path.stat().st_size
    if bin_size != ntoks * dtype.itemsize:
        raise ValueError(
            f"{bin_path}: size mismatch: {bin_size} bytes, but {idx_path.name} records {ntoks} "
            f"tokens of {dtype.itemsize} bytes ({ntoks * dtype.itemsize} bytes); the dataset is "
            "truncated or its two files come from different runs"
        )
    offsets = np.frombuffer(raw, dtype="<u8", offset=_HEADER.size)
    # Starts must begin at 0, strictly increase (every document has at least its EOT) and
    # stay inside the token file.
    if ndocs and (offsets[0] != 0 or offsets[-1] >= ntoks or np.any(offsets[1:] <= offsets[:-1])):
        raise ValueError(f"{idx_path}: document offsets are not increasing within {ntoks} tokens")
    if ndocs == 0 and ntoks != 0:
        raise ValueError(f"{idx_path}: {ntoks} tokens but no documents")
    return TokenIndex(bin_path, idx_path, dtype, int(vocab), int(eot), int(ndocs), int(ntoks), offsets)


class TokenWriter:
    """Write a token dataset (``P.bin`` + ``P.idx``) one document at a time.

    Use it as a context manager. Data goes to temporary files next to the target;
    they are renamed into place only on a clean exit, so an error or a crash never
    leaves a half-written dataset that looks complete (an existing dataset with the
    same prefix is kept intact until the new one is finished)::

        with TokenWriter("out/corpus", vocab_size=tok.vocab_size, eot_id=tok.eot_id) as w:
            for text in texts:
                w.add_document(tok.encode(text))
    """

    def __init__(self, prefix: str | os.PathLike[str], vocab_size: int, eot_id: int) -> None:
        """Create the temporary files.

        Args:
            prefix: output prefix; parent directories are created.
            vocab_size: number of token ids; picks uint16 (<= 65536) or uint32.
            eot_id: id appended after every document.
        """
        if vocab_size < 1 or vocab_size > 1 << 32:
            raise ValueError(f"vocab_size must be in [1, 2**32], got {vocab_size}")
        if not 0 <= eot_id < vocab_size:
            raise ValueError(f"eot_id {eot_id} must be in [0, vocab_size={vocab_size})")
        self.bin_path, self.idx_path = dataset_paths(prefix)
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        self.vocab_size, self.eot_id = vocab_size, eot_id
        self._code = _dtype_code(vocab_size)
        self._dtype = _DTYPES[self._code]
        self._eot = np.array([eot_id], dtype=self._dtype).tobytes()
        self._starts = array("Q")
        self.num_tokens = 0
        self._tmp_bin = _temp_path(self.bin_path)
        self._bin = open(self._tmp_bin, "xb")
        self._closed = False

    @property
    def num_documents(self) -> int:
        """Documents added so far."""
        return len(self._starts)

    def add_document(self, ids: Sequence[int] | np.ndarray) -> None:
        """Append one document; its end-of-text token is added here.

        Args:
            ids: the document's token ids, without an end-of-text token.

        Raises:
            ValueError: an id is outside ``[0, vocab_size)``.
        """
        if self._closed:
            raise ValueError(f"TokenWriter for {self.bin_path} is already closed")
        arr = np.asarray(ids)
        if arr.size:
            if arr.ndim != 1 or arr.dtype.kind not in "iu":
                raise ValueError(f"document {self.num_documents}: expected a 1-D sequence of ints")
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0 or hi >= self.vocab_size:
                at = int(np.argmax((arr < 0) | (arr >= self.vocab_size)))
                raise DataError(f"{self.bin_path}: document {self.num_documents}, token {at}: id {int(arr[at])} is "
                                f"outside [0, vocab_size={self.vocab_size}); nothing of this dataset is written. Give "
                                f"TokenWriter the tokenizer's vocab_size, or {RETOKENIZE}")
            self._bin.write(arr.astype(self._dtype, copy=False).tobytes())
        self._bin.write(self._eot)
        self._starts.append(self.num_tokens)
        self.num_tokens += int(arr.size) + 1

    def close(self) -> None:
        """Finish the dataset: write the index and rename both files into place."""
        if self._closed:
            return
        self._closed = True
        tmp_idx = _temp_path(self.idx_path)
        try:
            self._bin.flush()
            os.fsync(self._bin.fileno())
            self._bin.close()
            header = _HEADER.pack(MAGIC, FORMAT_VERSION, self._code, self.vocab_size, self.eot_id,
                                  len(self._starts), self.num_tokens)
            with open(tmp_idx, "xb") as f:
                f.write(header)
                f.write(np.frombuffer(self._starts, dtype=np.uint64).astype("<u8").tobytes())
                f.flush()
                os.fsync(f.fileno())
            # Remove the old index first: between the two renames an old .idx must never sit
            # next to the new .bin. The new .idx, renamed last, marks the dataset complete.
            self.idx_path.unlink(missing_ok=True)
            os.replace(self._tmp_bin, self.bin_path)
            os.replace(tmp_idx, self.idx_path)
        except BaseException:
            self._bin.close()
            for path in (self._tmp_bin, tmp_idx):
                Path(path).unlink(missing_ok=True)
            raise

    def abort(self) -> None:
        """Discard everything written; an existing dataset with this prefix is untouched."""
        if self._closed:
            return
        self._closed = True
        self._bin.close()
        Path(self._tmp_bin).unlink(missing_ok=True)

    def __enter__(self) -> "TokenWriter":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class TokenDataset(Dataset):
    """Fixed-length training windows over a memory-mapped token dataset.

    The documents' tokens form one stream; sample ``i`` is the window of
    ``seq_len + 1`` tokens starting at ``i * seq_len``, split into inputs and
    next-token labels. Windows cross document boundaries (the EOT token marks them).
    The memory map is opened lazily in each process, so the dataset pickles cheaply
    into DataLoader workers.
    """

    def __init__(self, prefix: str | os.PathLike[str], seq_len: int) -> None:
        """Open (and validate) the dataset.

        Args:
            prefix: dataset prefix, as given to ``angelptm-preprocess --output-prefix``.
            seq_len: tokens per sample.

        Raises:
            FileNotFoundError: a dataset file is missing.
            ValueError: the files are invalid, or hold fewer than ``seq_len + 1`` tokens.
            DataError: the token file holds an id at or above the header's vocabulary (named with its offset).
        """
        if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
        self.prefix = os.fspath(prefix)
        self.seq_len = int(seq_len)
        index = read_index(self.prefix)
        # Keep the (possibly large) offsets apart so pickling to workers stays cheap; they
        # are reloaded lazily from the .idx file where document() is used.
        self._offsets: np.ndarray | None = index.offsets
        self._index = dataclasses.replace(index, offsets=np.empty(0, dtype="<u8"))
        if self._index.num_tokens < seq_len + 1:
            raise ValueError(
                f"dataset {self.prefix} has {self._index.num_tokens} tokens, but seq_len={seq_len} "
                f"needs at least {seq_len + 1}; use a shorter seq_len or more data"
            )
        self._tokens: np.memmap | None = None
        self._check_ids(index.offsets)

    def _check_ids(self, offsets: np.ndarray) -> None:
        """Refuse a file holding an id at or above the header's vocabulary, naming where: an embedding lookup
        of it would end training with a bare ``IndexError`` at the step that reads it, and again on every resume.

        Reads the whole file once: 6.5 G tokens/s (13 GB/s) on one core of the development machine from the page
        cache (100 M tokens in 15 ms); a file not yet cached reads at the disk's speed.
        """
        vocab, dtype = self._index.vocab_size, self._index.dtype
        if vocab > np.iinfo(dtype).max:  # every value the file's type can hold is a valid id
            return
        tokens = self.tokens
        for start in range(0, len(tokens), SCAN_PIECE_TOKENS):
            piece = tokens[start:start + SCAN_PIECE_TOKENS]
            if int(piece.max()) < vocab:
                continue
            at = int(np.argmax(piece >= vocab))
            offset = start + at
            document = int(np.searchsorted(offsets, offset, side="right")) - 1
            raise DataError(f"{self._index.bin_path}: token {offset} (byte {offset * dtype.itemsize}, document "
                            f"{document}) is id {int(piece[at])}, but the dataset's header gives a vocabulary of "
                            f"{vocab} (ids 0-{vocab - 1}): the file was written with another tokenizer, or damaged. "
                            f"Stopped before training; {RETOKENIZE}")

    def check_vocabulary(self, model_vocab_size: int) -> None:
        """Refuse to train a model with ``model_vocab_size`` tokens on this dataset when its vocabulary is larger.

        Raises:
            DataError: the header's vocabulary exceeds the model's (every id was checked against the header).
        """
        if self.vocab_size > model_vocab_size:
            raise DataError(f"{self._index.bin_path}: the dataset's vocabulary has {self.vocab_size} tokens but "
                            f"model.vocab_size is {model_vocab_size}; raise model.vocab_size to at least "
                            f"{self.vocab_size}, or {RETOKENIZE}")

    @property
    def num_tokens(self) -> int:
        """Tokens in the dataset, end-of-text tokens included."""
        return self._index.num_tokens

    @property
    def num_documents(self) -> int:
        """Documents in the dataset."""
        return self._index.num_documents

    @property
    def vocab_size(self) -> int:
        """Vocabulary size recorded by the writer."""
        return self._index.vocab_size

    @property
    def eot_id(self) -> int:
        """End-of-text id recorded by the writer."""
        return self._index.eot_id

    @property
    def tokens(self) -> np.memmap:
        """The whole read-only token stream (opened on first use in this process)."""
        if self._tokens is None:
            self._tokens = np.memmap(self._index.bin_path, dtype=self._index.dtype, mode="r",
                                     shape=(self._index.num_tokens,))
        return self._tokens

    def document(self, i: int) -> np.ndarray:
        """Return the tokens of document ``i``, without its end-of-text token.

        Args:
            i: document number, ``0 <= i < num_documents``.

        Returns:
            A read-only view of the document's tokens.
        """
        if not 0 <= i < self.num_documents:
            raise IndexError(f"document {i} out of range [0, {self.num_documents})")
        if self._offsets is None:
            self._offsets = np.memmap(self._index.idx_path, dtype="<u8", mode="r", offset=_HEADER.size,
                                      shape=(self.num_documents,))
        offsets = self._offsets
        end = int(offsets[i + 1]) if i + 1 < self.num_documents else self.num_tokens
        return self.tokens[int(offsets[i]):end - 1]

    def __len__(self) -> int:
        return (self._index.num_tokens - 1) // self.seq_len

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        i, n = operator.index(i), len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample {i} out of range [0, {n})")
        start = i * self.seq_len
        window = torch.from_numpy(self.tokens[start:start + self.seq_len + 1].astype(np.int64))
        # Clone the labels so the two tensors do not share (overlapping) storage.
        return {"input_ids": window[:-1], "labels": window[1:].clone()}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        # A memmap must not travel between processes (it would be pickled as a full copy);
        # both are reopened lazily on first use.
        state["_tokens"] = state["_offsets"] = None
        return state

    def __repr__(self) -> str:
        return (f"TokenDataset({self.prefix!r}, seq_len={self.seq_len}, "
                f"num_tokens={self.num_tokens}, num_documents={self.num_documents})")
