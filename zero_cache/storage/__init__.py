"""Where the bytes live: tiers (device, pinned host, NVMe swap file and its IO), the homes of param shards and of
optimizer states, the chunk store, and the budgets of a machine described rather than measured.

It builds on :mod:`zero_cache.plan` (a home answers with its costs) and never imports ``zero_cache.optim``. This
``__init__`` imports nothing.
"""
