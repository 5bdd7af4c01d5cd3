"""``angelptm.zero``: the construction helpers a DeepSpeed ZeRO-3 script uses, under the same names.

``with deepspeed.zero.Init(...): model = Model()`` keeps working after ``import angelptm as
deepspeed``. Here the context builds the model directly on the compute device in the compute
dtype (bf16/fp16 from the config, or ``dtype=``), so a large model never needs a full fp32 copy in
host memory; ``initialize()`` then moves each parameter into its ZeRO-Cache chunk and releases the
original storage. (Materialising each parameter straight into its chunk, for models whose bf16
weights alone exceed the GPU, is not built yet.)
"""

from __future__ import annotations

from typing import Any

import torch

from angelptm.config import load_config


class Init:
    """Context manager compatible with ``deepspeed.zero.Init``.

    Args:
        config_dict_or_path: the DeepSpeed config (path or dict); its bf16/fp16 section picks the dtype.
        config: alias of ``config_dict_or_path`` (DeepSpeed accepts both).
        enabled: False makes the context a no-op.
        dtype: explicit parameter dtype (overrides the config).
        **kwargs: DeepSpeed's other arguments (module, data_parallel_group, remote_device, pin_memory,
            mpu, ...) are accepted; they concern partitioning, which ZeRO-Cache does at initialize().
    """

    def __init__(self, module: torch.nn.Module | None = None, *, config_dict_or_path: Any = None, config: Any = None,
                 enabled: bool = True, dtype: torch.dtype | None = None, **kwargs: Any) -> None:
        if module is not None:
            raise NotImplementedError("zero.Init(module=...) (converting an existing module) is not supported; "
                                      "build the model inside `with zero.Init(...):` instead")
        self.enabled = enabled
        source = config_dict_or_path if config_dict_or_path is not None else config
        if dtype is None and source is not None:
            dtype = load_config(source).precision.dtype
        self.dtype = dtype or torch.float32
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        self._saved_dtype: torch.dtype | None = None
        self._device_context: Any = None

    def __enter__(self) -> "Init":
        if self.enabled:
            self._saved_dtype = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
            self._device_context = torch.device(self.device)
            self._device_context.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            self._device_context.__exit__(*exc)
            torch.set_default_dtype(self._saved_dtype)
