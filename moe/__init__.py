"""Mixture-of-experts layers with expert parallelism and topology-aware all-to-all.

Never imports ``angelptm``; owns its typed config.
"""

from moe.config import MoEConfig

__all__ = ["MoEConfig"]
