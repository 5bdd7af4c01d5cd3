"""Where a chunk's params live between uses: the base class and the in-memory homes (``home``: the device, pinned
host memory), the NVMe home (``nvme``), and the registry by tier name that the store builds homes from
(``registry``). This ``__init__`` imports nothing.
"""
