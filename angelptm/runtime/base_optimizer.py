"""``deepspeed.runtime.base_optimizer``: ``DeepSpeedOptimizer``, the base DeepSpeed's own optimizer wrappers share.

Libraries test ``isinstance(x, (torch.optim.Optimizer, DeepSpeedOptimizer))`` to find optimizers among a
checkpoint's objects (Lightning does). This engine's optimizers are ``torch.optim.Optimizer``s, so they pass the
first test; the class exists so that the import and the check work.
"""


class DeepSpeedOptimizer:
    """Base of DeepSpeed's optimizer wrappers; none of this package's optimizers derive from it."""


class ZeROOptimizer(DeepSpeedOptimizer):
    """Base of DeepSpeed's ZeRO optimizers (the name only)."""
