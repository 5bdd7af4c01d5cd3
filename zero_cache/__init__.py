"""ZeRO-Cache: model states in chunks across one GPU + pinned-CPU + NVMe address space.

This package never imports ``angelptm``; it owns its typed config and takes runtime objects
(device, process group, streams) as arguments.
"""

from zero_cache.config import ZeroCacheConfig
from zero_cache.units import format_bytes, parse_bytes, parse_budget

__all__ = ["ZeroCacheConfig", "format_bytes", "parse_bytes", "parse_budget"]
