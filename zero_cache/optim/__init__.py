"""The hybrid Adam: :class:`~zero_cache.optim.optimizer.ZeroCacheOptimizer`, its gradient mixins (taking and
reducing gradients) and collaborators (the accumulation window, states by name for checkpoints, the step clock, the
counters of its report), the host's Adam and the host side of the update, the device's fused Adam over chunks, device
steps of host-held groups, the speculative update's revision, and ending an optimizer.

This ``__init__`` imports nothing.
"""
