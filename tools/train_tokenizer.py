"""Train the byte-level BPE tokenizer shipped as ``angelptm/pretraining/data/assets/tokenizer.json``.

The shipped file was produced by running, from the repository root::

    python tools/train_tokenizer.py

which reads the shipped corpus (``angelptm/pretraining/data/assets/kjv.txt.gz``) and writes
``angelptm/pretraining/data/assets/tokenizer.json``. Training is deterministic: the corpus is
fed in file order and the HF ``tokenizers`` BPE trainer breaks ties between equally
frequent pairs by a fixed ordering, so re-running with the same ``tokenizers``
version reproduces the file byte for byte (``--check`` verifies exactly that).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import sys
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

REPO_ROOT = Path(__file__).resolve().parent.parent
ASSETS = REPO_ROOT / "angelptm" / "pretraining" / "data" / "assets"
EOT_TOKEN = "<|endoftext|>"
DEFAULT_VOCAB_SIZE = 4096


def iter_lines(corpus: Path) -> Iterator[str]:
    """Yield the corpus' lines without their line terminators.

    Args:
        corpus: a UTF-8 text file, optionally gzip-compressed (``.gz``).

    Returns:
        An iterator over the non-empty lines, in file order.
    """
    opener = gzip.open if corpus.suffix == ".gz" else open
    with opener(corpus, "rt", encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            if line:
                yield line


def train(corpus: Path, vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer with one special token, ``<|endoftext|>``.

    Args:
        corpus: path of the training text (one document or verse per line).
        vocab_size: total vocabulary size, special token included.

    Returns:
        The trained ``tokenizers.Tokenizer``.
    """
    tok = Tokenizer(models.BPE())
    # add_prefix_space=False keeps decode(encode(s)) == s exact; no normalizer for the same reason.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT_TOKEN],
        # All 256 byte symbols, not only those seen in the (pure ASCII) corpus, so that any
        # UTF-8 text can be encoded without unknown tokens.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(iter_lines(corpus), trainer=trainer)
    got = tok.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:
        raise RuntimeError(f"trainer produced {got} tokens, wanted {vocab_size}: corpus too small?")
    return tok


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the process exit status."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=ASSETS / "kjv.txt.gz")
    parser.add_argument("--output", type=Path, default=ASSETS / "tokenizer.json")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument(
        "--check", action="store_true",
        help="do not write; exit 1 unless retraining reproduces --output byte for byte",
    )
    args = parser.parse_args(argv)

    tok = train(args.corpus, args.vocab_size)
    # Compact JSON (pretty=False) keeps the shipped file small.
    data = tok.to_str(pretty=False).encode("utf-8")
    sample = "In the beginning God created the heaven and the earth.\nnaïve café, 日本語 🙂"
    if tok.decode(tok.encode(sample).ids, skip_special_tokens=False) != sample:
        raise RuntimeError("trained tokenizer does not round-trip text")
    digest = hashlib.sha256(data).hexdigest()
    if args.check:
        same = args.output.is_file() and args.output.read_bytes() == data
        print(f"{args.output}: {'reproduced' if same else 'DIFFERS'} (retrained sha256 {digest})")
        return 0 if same else 1
    args.output.write_bytes(data)
    print(f"wrote {args.output} ({len(data)} bytes, vocab {tok.get_vocab_size()}, "
          f"eot id {tok.token_to_id(EOT_TOKEN)}, sha256 {digest})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
