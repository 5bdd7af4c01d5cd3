"""AutoPipe: op-level profiling and balanced pipeline-stage partitioning.

Never imports ``angelptm``; owns its typed config.
"""

from autopipe.config import AutoPipeConfig

__all__ = ["AutoPipeConfig"]
