"""Reference decoder-only GPT models (GPT-2 and Llama flavours) used for pretraining."""

from .config import ModelConfig
from .gpt import GPT, apply_rotary, build_model, rotary_tables

__all__ = ["GPT", "ModelConfig", "apply_rotary", "build_model", "rotary_tables"]
