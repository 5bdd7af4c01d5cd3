"""``deepspeed.runtime.activation_checkpointing``: the package of ``checkpointing`` (``deepspeed.checkpointing``)."""
