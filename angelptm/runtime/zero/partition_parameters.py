"""``deepspeed.runtime.zero.partition_parameters``: the names transformers reaches for around ``zero.Init``.

DeepSpeed's ``zero.Init`` patches torch's tensor constructors (``zero_wrapper_for_fp_tensor_constructor``) so that
tensors built inside it take the compute dtype and the device; transformers swaps that wrapper for one that spares
``torch.arange`` (``prevent_arange_dtype_change``). :class:`angelptm.zero.Init` patches no constructor (it sets
torch's default dtype and device, which ``arange`` with integer arguments does not follow), so the wrapper here
is only called by code that calls it itself.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from angelptm.accelerator import get_accelerator
from angelptm.zero import GatheredParameters, Init

_orig_torch_arange = torch.arange
"""torch's own ``arange`` (transformers compares against it)."""

__all__ = ["GatheredParameters", "Init", "get_accelerator", "zero_wrapper_for_fp_tensor_constructor"]


def zero_wrapper_for_fp_tensor_constructor(fn: Callable, target_fp_dtype: torch.dtype,
                                           target_device: torch.device | None = None) -> Callable:
    """``fn`` (a tensor constructor) building on ``target_device`` and casting floating results to
    ``target_fp_dtype``, as DeepSpeed's wrapper does."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None:
            kwargs["device"] = target_device if target_device is not None else torch.device(
                get_accelerator().current_device_name())
        tensor = fn(*args, **kwargs)
        return tensor.to(target_fp_dtype) if tensor.is_floating_point() else tensor

    return wrapped
