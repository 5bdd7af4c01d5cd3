"""Random fills of large host tensors, drawn on an accelerator: fast initialisation of a model built in host memory.

torch draws ``normal_`` and ``uniform_`` on the CPU from one generator, in sequence, on one thread, so
initialising a model built in host memory is bound by one core: an 8.5B GPT took 280 s to build on a
16-core H200 host, where DeepSpeed's ``zero.Init``, which initialises on the GPU, built 4.4B in 15 s.
While a ``RandomFillsOnDevice`` is active, each such fill of a large contiguous CPU tensor is drawn on the
device instead, one piece of at most ``piece_bytes`` at a time, in the tensor's own dtype, and each piece
is copied back into the tensor: the device never holds more than one piece, and the host never a copy
(no fp32 copy of a bf16 parameter).

It is a dispatch mode (below autograd, at the aten level), not a torch-function mode: ``nn.init.normal_``,
``kaiming_uniform_`` and friends hand themselves to a torch-function mode whole and run with it popped, so
the ``Tensor.uniform_`` inside them would never be seen; at the aten level every route (``Tensor.normal_``,
``nn.init.*``, ``trunc_normal_``'s redraws) arrives as ``aten.normal_`` or ``aten.uniform_``.

What changes: the values come from the device's generator (seeded by ``torch.manual_seed`` like the CPU's:
the same seed and piece size give the same weights, on every rank) and the CPU generator is not advanced by
the routed fills. Fills with an explicit ``generator``, of small or non-contiguous tensors, or of tensor
subclasses stay on the CPU unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

RANDOM_FILLS = (torch.ops.aten.normal_.default, torch.ops.aten.uniform_.default)
PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


class RandomFillsOnDevice(TorchDispatchMode):
    """While active, draws ``normal_``/``uniform_`` of large contiguous CPU tensors on ``device``, piece by piece.

    Args:
        device: where the values are drawn (a CUDA device; tests pass "cpu" to stand for it).
        piece_bytes: the largest device buffer used at once.
        min_numel: tensors with fewer elements are filled on the CPU as before.

    Attributes:
        pieces_filled: how many pieces were drawn on ``device`` so far.
    """

    def __init__(self, device: torch.device, *, piece_bytes: int = 256 << 20, min_numel: int = 1 << 20) -> None:
        super().__init__()
        if piece_bytes < 8 or min_numel < 1:
            raise ValueError(f"RandomFillsOnDevice(piece_bytes={piece_bytes}, min_numel={min_numel}): "
                             "expected piece_bytes >= 8 (one float64) and min_numel >= 1")
        self.device = torch.device(device)
        self.piece_bytes = piece_bytes
        self.min_numel = min_numel
        self.pieces_filled = 0

    def routes(self, tensor: torch.Tensor, kwargs: dict[str, Any]) -> bool:
        """Whether a fill of ``tensor`` is drawn on the device (else it runs on the CPU unchanged)."""
        return (type(tensor) in PLAIN_TENSOR_TYPES and tensor.device.type == "cpu" and tensor.is_floating_point()
                and tensor.layout == torch.strided and tensor.numel() >= self.min_numel
                and tensor.is_contiguous() and kwargs.get("generator") is None)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in RANDOM_FILLS or not self.routes(args[0], kwargs):
            return func(*args, **kwargs)
        tensor = args[0]
        with torch.no_grad():  # the fill itself was checked by autograd above this mode
            flat = tensor.view(-1)
            piece_numel = self.piece_bytes // tensor.element_size()  # >= 1: piece_bytes >= 8
            buffer = torch.empty(min(piece_numel, flat.numel()), dtype=tensor.dtype, device=self.device)
            for start in range(0, flat.numel(), piece_numel):
                piece = buffer[:min(piece_numel, flat.numel() - start)]
                func(piece, *args[1:], **kwargs)  # this mode is popped here: the device op runs as usual
                flat[start:start + piece.numel()].copy_(piece)
                self.pieces_filled += 1
        return tensor
