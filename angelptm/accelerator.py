"""``angelptm.accelerator.get_accelerator()``: DeepSpeed's accelerator object, over ``torch.cuda`` or ``torch.cpu``.

Scripts call it for the device name, seeding, synchronisation, memory figures and the communication
backend. Every method forwards to torch's device module (``torch.get_device_module``) or to torch itself;
nothing is re-implemented. DeepSpeed's op-builder methods (``create_op_builder``, ``get_op_builder``) raise:
angelptm builds its own native code on demand.
"""

from __future__ import annotations

import os
from typing import Any

import psutil
import torch


class Accelerator:
    """The accelerator this process computes on: CUDA when available, else the CPU.

    Args:
        device_type: "cuda" or "cpu" (default: "cuda" if ``torch.cuda.is_available()``).
    """

    def __init__(self, device_type: str | None = None) -> None:
        self._name = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        self._module = torch.get_device_module(self._name)

    # ------------------------------------------------------------------ devices
    def device_name(self, device_index: int | None = None) -> str:
        """``"cuda"`` / ``"cpu"``, or ``"cuda:<index>"`` when an index is given (CPU: always ``"cpu"``)."""
        return self._name if device_index is None or self._name == "cpu" else f"{self._name}:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        """A ``torch.device`` of this accelerator."""
        return torch.device(self.device_name(device_index))

    def current_device(self) -> int:
        """Index of the current device (0 on CPU)."""
        return self._module.current_device() if self._name == "cuda" else 0

    def current_device_name(self) -> str:
        """``"cuda:<current>"`` or ``"cpu"``."""
        return self.device_name(self.current_device()) if self._name == "cuda" else "cpu"

    def set_device(self, device_index: int) -> None:
        """Select the device (no-op on CPU)."""
        if self._name == "cuda":
            self._module.set_device(device_index)

    def device_count(self) -> int:
        """Devices visible to this process (CPU: 1)."""
        return self._module.device_count() if self._name == "cuda" else 1

    def is_available(self) -> bool:
        return self._module.is_available()

    def is_synchronized_device(self) -> bool:
        """True on CPU, whose work completes in order with the host."""
        return self._name == "cpu"

    def synchronize(self, device_index: int | None = None) -> None:
        """Wait for the device's queued work."""
        self._module.synchronize(device_index) if self._name == "cuda" else self._module.synchronize()

    def communication_backend_name(self) -> str:
        """``"nccl"`` on CUDA, ``"gloo"`` on CPU."""
        return "nccl" if self._name == "cuda" else "gloo"

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on this accelerator."""
        return tensor.device.type == self._name

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        """A page-locked copy of ``tensor`` with CUDA; the tensor itself on CPU."""
        return tensor.pin_memory() if self._name == "cuda" else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if self._name == "cuda" else False

    def is_bf16_supported(self) -> bool:
        """CUDA: torch's answer. CPU: True, DeepSpeed's CPU accelerator's answer (torch computes bf16 on any CPU,
        emulated where it has no bf16 units: ``angelptm.engine.cpu_bf16`` tells which)."""
        return self._module.is_bf16_supported() if self._name == "cuda" else True

    def is_fp16_supported(self) -> bool:
        """Asks the device, as DeepSpeed's accelerators do: a GPU of compute capability 7 or more; a CPU whose
        oneDNN has fp16 kernels (AVX512-FP16 / AMX-FP16; False on an AVX2 AMD EPYC, say)."""
        if self._name == "cuda":
            return torch.cuda.get_device_capability()[0] >= 7
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except (AttributeError, RuntimeError):  # a torch built without oneDNN
            return False

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float32]
        dtypes += [torch.bfloat16] if self.is_bf16_supported() else []
        return dtypes + ([torch.float16] if self.is_fp16_supported() else [])

    # ------------------------------------------------------------------ random
    def manual_seed(self, seed: int) -> Any:
        """Seed the device's generator (CPU: torch's global generator)."""
        return self._module.manual_seed(seed) if self._name == "cuda" else torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> Any:
        return self._module.manual_seed_all(seed) if self._name == "cuda" else torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return self._module.initial_seed() if self._name == "cuda" else torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        if self._name == "cuda":
            return self._module.get_rng_state() if device_index is None else self._module.get_rng_state(device_index)
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if self._name == "cuda":
            self._module.set_rng_state(new_state) if device_index is None else \
                self._module.set_rng_state(new_state, device_index)
        else:
            torch.set_rng_state(new_state)

    def random(self) -> Any:
        """torch's random module (DeepSpeed returns the device's)."""
        return torch.random

    @property
    def default_generator(self) -> Any:
        return torch.default_generator

    # ------------------------------------------------------------------ streams and events
    @property
    def Stream(self) -> type:  # noqa: N802 (DeepSpeed's name)
        return self._module.Stream

    @property
    def Event(self) -> type:  # noqa: N802
        return self._module.Event

    def stream(self, stream: Any) -> Any:
        return self._module.stream(stream)

    def current_stream(self, device_index: int | None = None) -> Any:
        return self._module.current_stream(device_index) if self._name == "cuda" else self._module.current_stream()

    def default_stream(self, device_index: int | None = None) -> Any:
        return self._module.default_stream(device_index) if self._name == "cuda" else self._module.current_stream()

    # ------------------------------------------------------------------ memory (CPU: host RSS, as DeepSpeed's)
    def empty_cache(self) -> None:
        if self._name == "cuda":
            self._module.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        if self._name == "cuda":
            return self._module.memory_allocated(device_index)
        return psutil.Process().memory_info().rss

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return self._module.max_memory_allocated(device_index) if self._name == "cuda" else self.memory_allocated()

    def memory_reserved(self, device_index: int | None = None) -> int:
        return self._module.memory_reserved(device_index) if self._name == "cuda" else self.memory_allocated()

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return self._module.max_memory_reserved(device_index) if self._name == "cuda" else self.memory_allocated()

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._name == "cuda":
            self._module.reset_peak_memory_stats(device_index)

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        self.reset_peak_memory_stats(device_index)

    def memory_stats(self, device_index: int | None = None) -> dict:
        return self._module.memory_stats(device_index) if self._name == "cuda" else {}

    def total_memory(self, device_index: int | None = None) -> int:
        if self._name == "cuda":
            return self._module.get_device_properties(device_index or 0).total_memory
        return psutil.virtual_memory().total

    def available_memory(self, device_index: int | None = None) -> int:
        if self._name == "cuda":
            return self._module.mem_get_info(device_index)[0]
        return psutil.virtual_memory().available

    # ------------------------------------------------------------------ markers, environment
    def range_push(self, msg: str) -> None:
        if self._name == "cuda":
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        if self._name == "cuda":
            torch.cuda.nvtx.range_pop()

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"] if self._name == "cuda" else []

    def set_visible_devices_envs(self, current_env: dict, local_accelerator_ids: list[int]) -> None:
        for name in self.visible_devices_envs():
            current_env[name] = ",".join(map(str, local_accelerator_ids))

    def export_envs(self) -> list[str]:
        return ["NCCL"] if self._name == "cuda" else []

    def get_compile_backend(self) -> str:
        return "inductor"

    def create_op_builder(self, class_name: str) -> Any:
        raise NotImplementedError(f"create_op_builder({class_name!r}): DeepSpeed's op builders are not part of "
                                  "angelptm; use the torch optimizer or module you need directly (angelptm builds its "
                                  "own native code on demand)")

    get_op_builder = create_op_builder

    def __repr__(self) -> str:
        return f"Accelerator({self._name!r})"


def get_accelerator() -> Accelerator:
    """The accelerator of this process (a new light object each call, like a lookup; it holds no state).

    ``DS_ACCELERATOR=cpu`` forces the CPU, as in DeepSpeed.
    """
    forced = os.environ.get("DS_ACCELERATOR")
    if forced not in (None, "cuda", "cpu"):
        raise ValueError(f"DS_ACCELERATOR={forced!r}: angelptm runs on 'cuda' or 'cpu'")
    return Accelerator(forced)


def is_current_accelerator_supported() -> bool:
    """DeepSpeed's check that its accelerator is one it supports: always true here (CUDA or the CPU)."""
    return True
