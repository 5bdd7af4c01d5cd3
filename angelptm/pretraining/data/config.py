"""Typed configuration of the training data (the ``"data"`` section of the JSON config)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Where pretraining tokens come from and how they are batched."""

    path: str | None = None
    """Prefix of a preprocessed dataset (``PREFIX.bin`` + ``PREFIX.idx``, made by
    ``python -m angelptm.pretraining.data.preprocess``); None tokenizes the shipped public-domain corpus once."""

    seq_len: int | None = None
    """Tokens per sample; None uses ``model.max_seq_len``."""

    cache_dir: str = ".cache/angelptm"
    """Where the shipped corpus is tokenized to when ``path`` is None."""

    tokenizer: str | None = None
    """A ``tokenizer.json`` (Hugging Face tokenizers format); None is the shipped 4096-token BPE. ``pretrain.py``
    loads it at start (a missing or unreadable file, or one with more tokens than ``model.vocab_size``, is refused),
    tokenizes the shipped corpus with it, and refuses a ``path`` written with a tokenizer of another size."""

    shuffle: bool = True
    """Visit samples in a seeded random order (reproducible, and resumable mid-epoch)."""

    reshuffle_each_epoch: bool = False
    """Draw a new order for each epoch (from seed + epoch). False visits the first epoch's order in every epoch, as
    DeepSpeed's ``training_data`` loader does (a ``DistributedSampler`` never given ``set_epoch``)."""

    num_workers: int = 0
    """DataLoader worker processes."""

    def __post_init__(self) -> None:
        if self.seq_len is not None and self.seq_len < 1:
            raise ValueError(f"data.seq_len: must be >= 1, got {self.seq_len}")
        if self.num_workers < 0:
            raise ValueError(f"data.num_workers: must be >= 0, got {self.num_workers}")
