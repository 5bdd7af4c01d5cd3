"""Bridges from other training libraries onto this engine, each imported on its own.

``from angelptm.integrations.transformers import Trainer`` needs ``transformers`` and ``accelerate``;
``import angelptm.integrations.accelerate`` and ``import angelptm.integrations.lightning`` make ``deepspeed``
another name of ``angelptm`` for the process (``deepspeed_alias``), so those libraries' own DeepSpeed code runs
on this engine. ``import angelptm`` needs none of them, so the package itself imports only ``deepspeed_alias``
(standard library alone), whose :func:`~angelptm.integrations.deepspeed_alias.suspended` lets ZeRO-Cache's host Adam
load the installed DeepSpeed's C++ Adam while the alias is in force.
"""
