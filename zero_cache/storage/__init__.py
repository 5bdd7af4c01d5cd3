"""Where the bytes live: tiers (device, pinned host, NVMe swap file and its IO), the homes of param shards
(``param_homes/``) and of optimizer states (``state_homes/``), the chunk store, and the budgets of a machine
described rather than measured.

It builds on :mod:`zero_cache.plan` (a home answers with its costs) and :mod:`zero_cache.base` (the timeline, the
ranks, the native loader), and never imports ``zero_cache.runtime`` or ``zero_cache.optim``. This ``__init__``
imports nothing.
"""
