"""Offline byte-level BPE tokenizer (a thin wrapper around HF ``tokenizers``).

The shipped vocabulary (``assets/tokenizer.json``, 4096 tokens) was trained on the
shipped King James Bible corpus by ``tools/train_tokenizer.py``; see
``assets/README.md``. It needs no network access: everything is read from the file.

Two choices differ from a plain ``tokenizers.Tokenizer``:

* ``encode`` treats a literal ``"<|endoftext|>"`` in the input as ordinary text, so the
  end-of-text id only ever appears where the dataset writer puts it between documents
  (a stray string in a scraped document must not split it into two).
* ``decode`` keeps special tokens by default, so decoding a token stream shows exactly
  where the document boundaries are.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer as _HFTokenizer

from angelptm.errors import ConfigError

EOT_TOKEN = "<|endoftext|>"
"""The end-of-text token placed after every document."""


def default_tokenizer_path() -> Path:
    """Return the path of the tokenizer shipped with the package.

    Returns:
        ``angelptm/pretraining/data/assets/tokenizer.json`` inside the installed package.
    """
    return Path(__file__).resolve().parent / "assets" / "tokenizer.json"


class Tokenizer:
    """Byte-level BPE tokenizer with an end-of-text token.

    Build one with :meth:`from_file`. Instances are picklable, so they can be handed
    to DataLoader workers or multiprocessing pools.
    """

    def __init__(self, hf_tokenizer: _HFTokenizer, path: str | None = None) -> None:
        """Wrap an already loaded HF tokenizer.

        Args:
            hf_tokenizer: a ``tokenizers.Tokenizer`` whose vocabulary has ``<|endoftext|>``.
            path: where it was loaded from, used only in messages.

        Raises:
            ValueError: the vocabulary has no ``<|endoftext|>`` token.
        """
        eot = hf_tokenizer.token_to_id(EOT_TOKEN)
        if eot is None:
            raise ValueError(
                f"tokenizer {path or '<in memory>'} has no {EOT_TOKEN!r} token; "
                "train one with tools/train_tokenizer.py"
            )
        self._tok = hf_tokenizer
        # Literal "<|endoftext|>" in input text is encoded as plain bytes (see module doc).
        self._tok.encode_special_tokens = True
        self._eot_id = int(eot)
        self._path = path

    @classmethod
    def from_file(cls, path: str | os.PathLike[str] | None = None) -> "Tokenizer":
        """Load a tokenizer from a ``tokenizer.json`` file.

        Args:
            path: the file to load; ``None`` loads the tokenizer shipped with the package.

        Returns:
            The loaded tokenizer.

        Raises:
            FileNotFoundError: ``path`` does not exist.
            IsADirectoryError: ``path`` is a directory (the message names its ``tokenizer.json`` when it has one).
            ValueError: the file is not a valid tokenizer or lacks ``<|endoftext|>``.
        """
        file = Path(path) if path is not None else default_tokenizer_path()
        if file.is_dir():
            raise IsADirectoryError(f"tokenizer path {file} is a directory, not a file; {_file_inside(file)}")
        if not file.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {file}")
        try:
            hf = _HFTokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises a bare Exception for malformed JSON
            raise ValueError(
                f"cannot load tokenizer from {file}: {exc}. Expected a HF tokenizers "
                "tokenizer.json such as the one written by tools/train_tokenizer.py"
            ) from exc
        return cls(hf, str(file))

    @property
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included (ids are ``0 .. vocab_size-1``)."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def eot_id(self) -> int:
        """Id of ``<|endoftext|>``, the token that ends every document."""
        return self._eot_id

    @property
    def path(self) -> str | None:
        """The file the tokenizer was loaded from, if any."""
        return self._path

    def encode(self, text: str) -> list[int]:
        """Encode one string.

        Args:
            text: any Unicode text.

        Returns:
            Its token ids; no end-of-text token is added.
        """
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encode many strings at once, in parallel inside the ``tokenizers`` library.

        Args:
            texts: the strings to encode.

        Returns:
            One list of token ids per input string, in input order.
        """
        # encode_batch_fast skips the character offsets we never use; it is noticeably faster.
        encodings = self._tok.encode_batch_fast(list(texts), add_special_tokens=False)
        return [enc.ids for enc in encodings]

    def decode(self, ids: Iterable[int] | np.ndarray, skip_special_tokens: bool = False) -> str:
        """Turn token ids back into text.

        Args:
            ids: token ids (a list, or a NumPy/torch integer array).
            skip_special_tokens: drop ``<|endoftext|>`` instead of writing it out.

        Returns:
            The decoded text; ``decode(encode(s)) == s`` for any string ``s``.
        """
        # tolist() turns NumPy/torch integers into Python ints in C, much faster than a loop.
        id_list = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        if id_list and (min(id_list) < 0 or max(id_list) >= self.vocab_size):
            bad = [i for i in id_list if not 0 <= i < self.vocab_size]
            raise ValueError(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        return self._tok.decode(id_list, skip_special_tokens=skip_special_tokens)

    def __getstate__(self) -> dict[str, Any]:
        return {"json": self._tok.to_str(), "path": self._path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Re-run __init__ because the HF object's pickle loses encode_special_tokens.
        self.__init__(_HFTokenizer.from_str(state["json"]), state["path"])  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"Tokenizer(path={self._path!r}, vocab_size={self.vocab_size}, eot_id={self.eot_id})"


def _file_inside(directory: Path) -> str:
    """What to give instead of a directory: its ``tokenizer.json`` when it has one."""
    inside = directory / "tokenizer.json"
    return f"give the file inside it, {inside}" if inside.is_file() else "give the path of a tokenizer.json file"


def configured_tokenizer(path: str | None, *, model_vocab_size: int) -> Tokenizer:
    """The tokenizer of ``data.tokenizer`` (None: the shipped one), loaded and checked at the start of a run.

    Raises:
        ConfigError: the file is missing (or a directory), is not a tokenizers ``tokenizer.json`` with
            ``<|endoftext|>``, or has more tokens than ``model.vocab_size`` (its ids would index past the
            embedding table).
    """
    where = f"data.tokenizer {path!r}"
    try:
        tokenizer = Tokenizer.from_file(path)
    except IsADirectoryError:
        raise ConfigError(f"{where} is a directory, not a file; {_file_inside(Path(path))}, or null for the shipped "
                          "4096-token BPE") from None
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file; give a tokenizer.json (Hugging Face tokenizers format), or "
                          "null for the shipped 4096-token BPE") from None
    except ValueError as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"{where}: not a usable tokenizer ({reason}); give a Hugging Face tokenizers "
                          "tokenizer.json with an <|endoftext|> token, or null for the shipped one") from None
    if tokenizer.vocab_size > model_vocab_size:
        raise ConfigError(f"{where} has {tokenizer.vocab_size} tokens, more than model.vocab_size "
                          f"{model_vocab_size}; raise model.vocab_size to at least {tokenizer.vocab_size}")
    return tokenizer
