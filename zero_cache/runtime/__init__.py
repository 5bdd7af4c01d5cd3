"""Doing: the copy streams, the host worker's job queue, gathered params sharded over ranks (prefetch along the
trace, Belady's eviction), the exchange that drives them from the module's hooks, the measured rates, and the
warm-up's measure of non-model memory.

It builds on ``zero_cache.base``, ``zero_cache.plan`` and ``zero_cache.storage``, and never imports
``zero_cache.optim``. This ``__init__`` imports nothing.
"""
