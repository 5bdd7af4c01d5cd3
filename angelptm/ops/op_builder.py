"""``deepspeed.ops.op_builder``: DeepSpeed's JIT op builders, by name only, so scripts that check
``deepspeed.ops.__compatible_ops__[Builder.NAME]`` run. None is buildable here (``is_compatible()`` is False,
``load()`` raises): angelptm's own native code is ``csrc/``, built on first use, and ``angelptm.ops.adam`` is
torch's Adam under DeepSpeed's names.
"""

from __future__ import annotations

from typing import Any


class OpBuilder:
    """A DeepSpeed op builder that this package does not build."""

    NAME = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.name = self.NAME

    def is_compatible(self, verbose: bool = False) -> bool:
        return False

    def load(self, verbose: bool = True) -> Any:
        raise NotImplementedError(f"DeepSpeed's native op {self.NAME!r} is not built by angelptm; use "
                                  "angelptm.ops.adam (torch's Adam under DeepSpeed's names) or the engine's own "
                                  "optimizer")


def _builder(class_name: str, op_name: str) -> type[OpBuilder]:
    return type(class_name, (OpBuilder,), {"NAME": op_name, "__doc__": f"DeepSpeed's {op_name} builder (not built)."})


BUILDER_NAMES = {"FusedAdamBuilder": "fused_adam", "CPUAdamBuilder": "cpu_adam", "FusedLambBuilder": "fused_lamb",
                 "CPUAdagradBuilder": "cpu_adagrad", "CPULionBuilder": "cpu_lion", "FusedLionBuilder": "fused_lion",
                 "AsyncIOBuilder": "async_io", "GDSBuilder": "gds", "TransformerBuilder": "transformer",
                 "QuantizerBuilder": "quantizer", "SparseAttnBuilder": "sparse_attn"}

globals().update({name: _builder(name, op) for name, op in BUILDER_NAMES.items()})
ALL_OPS = {op: globals()[name] for name, op in BUILDER_NAMES.items()}
