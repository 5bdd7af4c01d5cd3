"""Pretraining data: the shipped corpus and tokenizer, preprocessing, memory-mapped tokens, resumable loading."""

from angelptm.pretraining.data.config import DataConfig
from angelptm.pretraining.data.dataset import TokenDataset, TokenWriter
from angelptm.pretraining.data.loader import ResumableDataLoader, ResumableSampler, repeat_batches
from angelptm.pretraining.data.preprocess import default_corpus_path, prepare_default_dataset
from angelptm.pretraining.data.preprocess import preprocess as preprocess_files
from angelptm.pretraining.data.tokenizer import Tokenizer

__all__ = [
    "DataConfig", "ResumableDataLoader", "ResumableSampler", "TokenDataset", "TokenWriter", "Tokenizer",
    "default_corpus_path", "prepare_default_dataset", "preprocess_files", "repeat_batches",
]
