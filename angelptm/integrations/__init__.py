"""Bridges from other training libraries onto this engine, each imported on its own.

``from angelptm.integrations.transformers import Trainer`` needs ``transformers`` and ``accelerate``;
``import angelptm`` needs neither, so nothing here is imported by the package itself.
"""
