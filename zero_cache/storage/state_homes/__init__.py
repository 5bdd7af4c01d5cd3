"""Where a chunk's optimizer group lives: the base class and the homes in memory or on another rank (``home``), the
NVMe home (``nvme``), and the registry by tier name that the store builds state homes from (``registry``). This
``__init__`` imports nothing.
"""
