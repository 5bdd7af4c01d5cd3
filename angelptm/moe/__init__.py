"""``angelptm.moe``: the import path DeepSpeed-MoE scripts use (``deepspeed.moe.layer.MoE``)."""

from angelptm.moe import layer, utils

__all__ = ["layer", "utils"]
