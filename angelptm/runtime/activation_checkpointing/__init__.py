"""``deepspeed.runtime.activation_checkpointing``: its ``checkpointing`` module, also ``angelptm.checkpointing``."""

from angelptm.runtime.activation_checkpointing import checkpointing

__all__ = ["checkpointing"]
