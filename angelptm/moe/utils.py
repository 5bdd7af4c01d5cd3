"""``deepspeed.moe.utils``: the param-group helper MoE scripts call before ``initialize``.

DeepSpeed's ZeRO needs expert parameters in groups of their own (they are reduced over another
group). angelptm finds the experts from the model's MoE layers at ``initialize()`` and reduces them
over their expert-data-parallel group whatever the param groups are, so the groups are returned as
given: the optimizer arithmetic is the same as with DeepSpeed's split (same hyperparameters per group).
"""

from __future__ import annotations

from typing import Any


def split_params_into_different_moe_groups_for_optimizer(param_groups: dict | list | tuple,
                                                          max_group_size: int | float = 178956971
                                                          ) -> list[dict[str, Any]]:
    """The param groups as a list of dicts (see the module docstring for why nothing is split).

    Args:
        param_groups: one group dict, or a list/tuple of them.
        max_group_size: accepted for compatibility.

    Returns:
        The groups, as a list.
    """
    groups = [param_groups] if isinstance(param_groups, dict) else list(param_groups)
    return [{**group, "params": list(group["params"])} for group in groups]
