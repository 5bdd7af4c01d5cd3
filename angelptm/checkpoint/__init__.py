"""``deepspeed.checkpoint``: the one helper libraries import from it (``utils.clone_tensors_for_torch_save``, which
accelerate's ``get_state_dict`` calls). This engine's own checkpoint code is :mod:`angelptm.checkpoints`."""

from angelptm.checkpoint import utils

__all__ = ["utils"]
