"""``deepspeed.checkpoint.utils``: ``clone_tensors_for_torch_save``."""

from __future__ import annotations

from typing import Any

import torch


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = torch.device("cpu")) -> Any:
    """A copy of ``item`` whose tensors are detached clones on ``device``, as DeepSpeed's helper returns.

    Why clone: ``torch.save`` of a view writes its whole storage (a flat buffer holding every parameter);
    a clone owns only its own elements. Lists, tuples and dicts are walked (a dict keeps its type, so an
    ``OrderedDict`` state dict stays one); anything else is returned as it is.
    """
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(value, device) for value in item)
    if isinstance(item, dict):
        return type(item)((key, clone_tensors_for_torch_save(value, device)) for key, value in item.items())
    return item
