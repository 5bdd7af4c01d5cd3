"""Tokenize text or JSONL files into a binary token dataset (``P.bin`` + ``P.idx``).

Command line (also installed as ``angelptm-preprocess``)::

    python -m angelptm.pretraining.data.preprocess --input a.txt b.jsonl.gz --output-prefix data/corpus

The result is read by :class:`angelptm.pretraining.data.dataset.TokenDataset`. This module also
provides :func:`prepare_default_dataset`, which tokenizes the shipped public-domain
corpus once into a cache directory.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import logging
import os
import sys
import time
import zlib
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np
from tqdm import tqdm

from angelptm.pretraining.data.dataset import FORMAT_VERSION, TokenWriter, read_index
from angelptm.pretraining.data.tokenizer import Tokenizer, default_tokenizer_path

logger = logging.getLogger(__name__)

DEFAULT_MAX_LINES = 32
"""Text files: a paragraph longer than this many lines is cut into several documents."""

_BATCH_CHARS = 1 << 19  # characters per encode_batch call: large enough to use all threads


@dataclass(frozen=True)
class PreprocessStats:
    """What :func:`preprocess` wrote."""

    documents: int
    tokens: int  # end-of-text tokens included
    skipped_empty: int
    seconds: float
    bin_path: Path
    idx_path: Path


def detect_format(path: Path, fmt: str) -> str:
    """Resolve ``auto`` to ``jsonl`` (``.jsonl``/``.ndjson``, optionally ``.gz``) or ``text``.

    Args:
        path: the input file.
        fmt: ``auto``, ``text`` or ``jsonl``.

    Returns:
        ``text`` or ``jsonl``.
    """
    if fmt != "auto":
        return fmt
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes.pop()
    return "jsonl" if suffixes and suffixes[-1] in (".jsonl", ".ndjson") else "text"


@contextmanager
def _open_binary(path: Path) -> Iterator[tuple[IO[bytes], IO[bytes]]]:
    """Yield ``(raw, stream)``: the file on disk (its position drives the progress bar)
    and its decompressed contents. Gzip is recognised by its magic bytes, not the name."""
    with open(path, "rb") as raw:
        if raw.read(2) == b"\x1f\x8b":
            raw.seek(0)
            with gzip.GzipFile(fileobj=raw, mode="rb") as stream:
                yield raw, stream  # type: ignore[misc]
        else:
            raw.seek(0)
            yield raw, raw


def iter_lines(stream: Iterable[bytes], name: str) -> Iterator[tuple[int, str]]:
    """Decode a byte stream line by line.

    Args:
        stream: binary lines, as from iterating over a file opened in binary mode.
        name: file name for error messages.

    Returns:
        An iterator of ``(line_number, line)``, numbered from 1, without ``\\n`` / ``\\r\\n``.

    Raises:
        ValueError: a line is not valid UTF-8 (the message names the file and line).
    """
    for lineno, raw_line in enumerate(_whole(stream, name), start=1):
        try:
            line = raw_line.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{name}:{lineno}: not valid UTF-8 ({exc.reason} at column "
                             f"{exc.start + 1}); convert the file to UTF-8") from None
        yield lineno, line.rstrip("\n").removesuffix("\r")


def _whole(stream: Iterable[bytes], name: str) -> Iterator[bytes]:
    """The stream's lines; a gzip file that ends early, is damaged or is no gzip stream at all is a ValueError naming
    it (not EOFError, or gzip's BadGzipFile, which names no file)."""
    lines, count = iter(stream), 0
    while True:
        try:
            line = next(lines)
        except StopIteration:
            return
        except gzip.BadGzipFile as exc:  # gzip's magic bytes, then no gzip stream ("Unknown compression method")
            raise ValueError(f"{name}: not a valid gzip file ({exc}), though it starts with gzip's magic bytes; check "
                             "it with gzip -t, or give the file uncompressed") from None
        except (EOFError, zlib.error) as exc:
            raise ValueError(f"{name}: the compressed file is truncated or damaged after line {count} ({exc}); "
                             "copy it again or recompress it (gzip -t checks a file)") from None
        count += 1
        yield line


def iter_text_documents(lines: Iterable[tuple[int, str]], max_lines: int) -> Iterator[str]:
    """Split text into documents at blank lines, and long paragraphs every ``max_lines``.

    Args:
        lines: ``(line_number, line)`` pairs, as from :func:`iter_lines`.
        max_lines: most lines per document; 0 never cuts a paragraph. This matters for
            files without blank lines (such as the shipped corpus, one verse per line),
            which would otherwise be a single huge document.

    Returns:
        An iterator of documents: their lines joined with ``\\n``.
    """
    block: list[str] = []
    for _, line in lines:
        if line.strip():
            block.append(line)
            if len(block) == max_lines:
                yield "\n".join(block)
                block = []
        elif block:
            yield "\n".join(block)
            block = []
    if block:
        yield "\n".join(block)


def iter_jsonl_documents(lines: Iterable[tuple[int, str]], key: str, name: str) -> Iterator[str]:
    """Read one document per JSON line from field ``key``; blank lines are skipped.

    Args:
        lines: ``(line_number, line)`` pairs, as from :func:`iter_lines`.
        key: the field holding the document text.
        name: file name for error messages.

    Returns:
        An iterator of document texts.

    Raises:
        ValueError: a line is not a JSON object, lacks ``key``, or ``key`` is not a string;
            the message names the file and line number.
    """
    for lineno, line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name}:{lineno}: invalid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{name}:{lineno}: expected a JSON object, got {type(record).__name__}")
        if key not in record:
            keys = ", ".join(sorted(record)[:10]) or "none"
            raise ValueError(f"{name}:{lineno}: no key {key!r} (keys: {keys}); choose one with --jsonl-key")
        text = record[key]
        if not isinstance(text, str):
            raise ValueError(f"{name}:{lineno}: {key!r} is {type(text).__name__}, expected a string")
        yield text


def _batches(docs: Iterable[str], batch_chars: int) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for doc in docs:
        batch.append(doc)
        size += len(doc)
        if size >= batch_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _encode_packed(tokenizer: Tokenizer, batch: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Encode a batch into one flat array plus per-document lengths (cheap to pickle)."""
    encoded = tokenizer.encode_batch(batch)
    lengths = np.array([len(ids) for ids in encoded], dtype=np.int64)
    flat = np.concatenate([np.asarray(ids, dtype=np.uint32) for ids in encoded])
    return flat, lengths


def _init_worker() -> None:
    # One thread per worker process: N processes each using every core would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _encoded_batches(batches: Iterator[list[str]], tokenizer: Tokenizer,
                     workers: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Encode batches in order, in this process (workers <= 1) or in a process pool."""
    if workers <= 1:
        for batch in batches:
            yield _encode_packed(tokenizer, batch)
        return
    import multiprocessing

    with multiprocessing.get_context().Pool(workers, _init_worker) as pool:
        # The tokenizer travels with every batch (about 3 ms per ~100 ms batch) so that the
        # workers keep no module-level state. A bounded window of pending batches keeps
        # memory flat: Pool.imap would read the whole input ahead if the workers fall behind.
        pending: deque = deque()
        for batch in batches:
            pending.append(pool.apply_async(_encode_packed, (tokenizer, batch)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
        # Let the workers finish and join them: the with-block's exit would terminate() them, and terminate races
        # the pool's own thread re-spawning a worker, which then waits forever on the task queue's lock that
        # terminate holds (a test run hung there, its pytest joining that worker).
        pool.close()
        pool.join()


def preprocess(inputs: Sequence[str | os.PathLike[str]], output_prefix: str | os.PathLike[str],
               tokenizer: Tokenizer, fmt: str = "auto", jsonl_key: str = "text",
               max_lines: int = DEFAULT_MAX_LINES, workers: int = 1,
               progress: bool | None = None) -> PreprocessStats:
    """Tokenize ``inputs`` into the dataset ``output_prefix`` (``.bin`` + ``.idx``).

    Args:
        inputs: text or JSONL files, optionally gzip-compressed.
        output_prefix: where to write; an existing dataset is replaced only on success.
        tokenizer: the tokenizer; its end-of-text id is written after every document.
        fmt: ``auto`` (by file name), ``text`` or ``jsonl``.
        jsonl_key: JSONL field holding the text.
        max_lines: text files: most lines per document (see :func:`iter_text_documents`).
        workers: tokenizer processes; 1 tokenizes in this process (already multithreaded).
        progress: show a progress bar; None shows it only on a terminal.

    Returns:
        Counts and output paths.

    Raises:
        FileNotFoundError: an input does not exist.
        IsADirectoryError: an input is a directory.
        ValueError: an input is malformed, or holds no documents.
    """
    paths = [Path(p) for p in inputs]
    for path in paths:
        if path.is_dir():
            raise IsADirectoryError(f"input {path} is a directory, not a file; give the files inside it "
                                    f"(e.g. {path}/*.txt)")
        if not path.is_file():
            raise FileNotFoundError(f"input file not found: {path}")
    start, skipped = time.perf_counter(), 0
    bar = tqdm(total=sum(p.stat().st_size for p in paths), unit="B", unit_scale=True,
               desc="tokenizing", disable=None if progress is None else not progress)
    with bar, TokenWriter(output_prefix, tokenizer.vocab_size, tokenizer.eot_id) as writer:
        for path in paths:
            with _open_binary(path) as (raw, stream):
                lines = iter_lines(stream, str(path))
                if detect_format(path, fmt) == "jsonl":
                    docs = iter_jsonl_documents(lines, jsonl_key, str(path))
                else:
                    docs = iter_text_documents(lines, max_lines)
                done = 0
                for flat, lengths in _encoded_batches(_batches(docs, _BATCH_CHARS), tokenizer, workers):
                    for doc in np.split(flat, np.cumsum(lengths)[:-1]):
                        if doc.size:  # an empty document would be a lone end-of-text token
                            writer.add_document(doc)
                        else:
                            skipped += 1
                    bar.update(raw.tell() - done)
                    done = raw.tell()
                bar.update(path.stat().st_size - done)
        if writer.num_documents == 0:
            raise ValueError(f"no documents found in {', '.join(map(str, paths))}")
    return PreprocessStats(writer.num_documents, writer.num_tokens, skipped,
                           time.perf_counter() - start, writer.bin_path, writer.idx_path)


def default_corpus_path() -> Path:
    """Return the path of the shipped corpus (King James Bible, public domain).

    Returns:
        ``angelptm/pretraining/data/assets/kjv.txt.gz``: one verse per line, no blank lines.
    """
    return Path(__file__).resolve().parent / "assets" / "kjv.txt.gz"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def prepare_default_dataset(cache_dir: str | os.PathLike[str], tokenizer: Tokenizer | None = None) -> str:
    """Tokenize the shipped corpus into ``cache_dir/kjv`` (``kjv-HASH`` with another tokenizer), once.

    A dataset already there is reused if it is valid and was made from the same corpus,
    tokenizer and settings (recorded in ``kjv.meta.json``); otherwise it is rebuilt.
    In multi-process training, call this on one rank and wait for it on the others.

    Args:
        cache_dir: directory for the dataset; created if missing.
        tokenizer: the run's tokenizer (``data.tokenizer``); None is the shipped one.

    Returns:
        The dataset prefix, for :class:`~angelptm.pretraining.data.dataset.TokenDataset`.
    """
    corpus = default_corpus_path()
    tokenizer_file = Path(tokenizer.path) if tokenizer is not None and tokenizer.path else default_tokenizer_path()
    tokenizer_sha = _sha256(tokenizer_file)
    name = "kjv" if tokenizer_sha == _sha256(default_tokenizer_path()) else f"kjv-{tokenizer_sha[:12]}"
    prefix = Path(cache_dir) / name
    meta_path = Path(cache_dir) / f"{name}.meta.json"
    fingerprint = {"format_version": FORMAT_VERSION, "corpus_sha256": _sha256(corpus),
                   "tokenizer_sha256": tokenizer_sha, "max_lines": DEFAULT_MAX_LINES}
    try:
        meta = json.loads(meta_path.read_text())
        index = read_index(prefix)
        if meta.get("fingerprint") == fingerprint and meta.get("num_tokens") == index.num_tokens:
            return str(prefix)
        logger.info("rebuilding %s: made from another corpus, tokenizer or version", prefix)
    except FileNotFoundError:  # the first run: nothing cached yet (not an error)
        logger.info("tokenizing %s into the cache %s (first run; later runs reuse it)", corpus.name, prefix)
    except (OSError, ValueError) as exc:  # unreadable or corrupt: rebuild
        logger.info("rebuilding the token cache %s: the cached copy is unreadable (%s)", prefix, exc)
    stats = preprocess([corpus], prefix, tokenizer or Tokenizer.from_file(tokenizer_file), fmt="text",
                       max_lines=DEFAULT_MAX_LINES, progress=False)
    tmp = meta_path.with_name(f"{meta_path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"fingerprint": fingerprint, "num_documents": stats.documents,
                               "num_tokens": stats.tokens}, indent=2) + "\n")
    os.replace(tmp, meta_path)  # written last: its presence means the dataset is complete
    logger.info("tokenized %s: %d tokens in %.1f s", corpus.name, stats.tokens, stats.seconds)
    return str(prefix)


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser of ``angelptm-preprocess``."""
    parser = argparse.ArgumentParser(
        prog="angelptm-preprocess",
        description="Tokenize text or JSONL files into PREFIX.bin + PREFIX.idx for TokenDataset.",
        epilog="Text files: documents are separated by blank lines; a paragraph longer than "
               "--max-lines lines is cut into several documents, so a file with no blank lines "
               "(e.g. one sentence or verse per line) becomes documents of --max-lines lines. "
               "JSONL files: one document per line, from the field --jsonl-key. Inputs may be "
               "gzip-compressed. Every document is followed by the <|endoftext|> token.")
    parser.add_argument("--input", nargs="+", required=True, metavar="FILE", help="input files")
    parser.add_argument("--output-prefix", required=True, metavar="P", help="writes P.bin and P.idx")
    parser.add_argument("--tokenizer", metavar="JSON",
                        help="tokenizer.json to use (default: the one shipped with angelptm)")
    parser.add_argument("--format", choices=("auto", "text", "jsonl"), default="auto",
                        help="input format; auto: .jsonl/.ndjson[.gz] are JSONL, anything else text")
    parser.add_argument("--jsonl-key", default="text", metavar="KEY", help="JSONL field with the text (default: text)")
    parser.add_argument("--max-lines", type=int, default=DEFAULT_MAX_LINES, metavar="N",
                        help=f"text files: most lines per document, 0 = no limit (default {DEFAULT_MAX_LINES})")
    parser.add_argument("--workers", type=int, default=1, metavar="N",
                        help="tokenizer processes (default 1: this process, which already "
                             "tokenizes each batch on all cores with threads)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``angelptm-preprocess``.

    Args:
        argv: command-line arguments; None reads ``sys.argv``.

    Returns:
        The exit status: 0 on success, 1 on an input or output error.
    """
    args = build_parser().parse_args(argv)
    if args.max_lines < 0 or args.workers < 1:
        print("angelptm-preprocess: error: --max-lines must be >= 0 and --workers >= 1", file=sys.stderr)
        return 1
    try:
        tokenizer = Tokenizer.from_file(args.tokenizer)
        stats = preprocess(args.input, args.output_prefix, tokenizer, fmt=args.format,
                           jsonl_key=args.jsonl_key, max_lines=args.max_lines,
                           workers=args.workers, progress=False if args.no_progress else None)
    except (OSError, ValueError) as exc:
        print(f"angelptm-preprocess: error: {exc}", file=sys.stderr)
        return 1
    rate = stats.tokens / stats.seconds if stats.seconds > 0 else float("inf")
    print(f"documents: {stats.documents:,}" + (f" ({stats.skipped_empty:,} empty skipped)"
                                               if stats.skipped_empty else ""))
    print(f"tokens:    {stats.tokens:,} (end-of-text included), vocab {tokenizer.vocab_size}")
    print(f"time:      {stats.seconds:.2f} s ({rate:,.0f} tokens/s)")
    for path in (stats.bin_path, stats.idx_path):
        print(f"wrote:     {path} ({path.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
