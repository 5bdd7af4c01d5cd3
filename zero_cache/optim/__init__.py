"""The hybrid Adam: :class:`~zero_cache.optim.optimizer.ZeroCacheOptimizer` and its collaborators (taking and
reducing gradients, queueing each chunk's update and waiting for it, each chunk's step record, the device-held groups'
Adam, the accumulation window, states by name for checkpoints, the step clock, the counters of its report, the seam
the warm-up observes it through), the host's Adam and the host side of the update, the device's fused Adam over
chunks, device steps of host-held groups, the speculative update's revision, and ending an optimizer.

This ``__init__`` imports nothing.
"""
