"""The floor every other layer may stand on: the step's ``timeline`` (what ran when, on which track), ``sharding``
(ranks, which chunks a rank owns, and the collectives over them), and the ``native`` extensions' loader.

Its modules import nothing of ``zero_cache`` (``tests/unit/test_layering.py``), so that ``storage/`` can record on the
timeline, ask which chunks a rank owns and load the AIO extension without reaching up into ``runtime/``. This
``__init__`` imports nothing.
"""
