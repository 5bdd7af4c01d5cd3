"""The hybrid Adam: :class:`~zero_cache.optim.optimizer.ZeroCacheOptimizer` and its parts (gradients, sharded
states, checkpoints), the host's Adam and the host side of the update, the device's fused Adam over chunks, device
steps of host-held groups, the speculative update's revision, and ending an optimizer.

This ``__init__`` imports nothing.
"""
