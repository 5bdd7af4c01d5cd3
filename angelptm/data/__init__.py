"""Pretraining data: the shipped corpus and tokenizer, preprocessing, memory-mapped tokens, resumable loading."""

from angelptm.data.config import DataConfig
from angelptm.data.dataset import TokenDataset, TokenWriter
from angelptm.data.loader import ResumableDataLoader, ResumableSampler, repeat_batches
from angelptm.data.preprocess import default_corpus_path, prepare_default_dataset
from angelptm.data.preprocess import preprocess as preprocess_files
from angelptm.data.tokenizer import Tokenizer

__all__ = [
    "DataConfig", "ResumableDataLoader", "ResumableSampler", "TokenDataset", "TokenWriter", "Tokenizer",
    "default_corpus_path", "prepare_default_dataset", "preprocess_files", "repeat_batches",
]
