"""DeepSpeed engine methods scripts call besides forward/backward/step: a mixin of
:class:`~angelptm.engine.engine.Engine`.

``save_16bit_model``, ``no_sync``, ``zero_optimization_stage`` and ``set_gradient_accumulation_boundary``,
each with DeepSpeed 0.19's signature and meaning, built on the engine's own pieces (the consolidated
state dict, the accumulation counter).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import torch


class DeepSpeedEngineMethods:
    """Mixed into the engine; reads ``config``, ``ctx``, ``module``, ``compute_dtype`` and the optimizer."""

    _boundary_override: bool | None = None
    _inside_no_sync: bool = False

    def zero_optimization_stage(self) -> int:
        """The configured ``zero_optimization.stage`` (ZeRO-Cache shards states whatever the number)."""
        return self.config.zero.stage

    def zero_optimization(self) -> bool:
        """Whether a ZeRO stage above 0 is configured."""
        return self.config.zero.stage > 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Override whether the next ``backward``/``step`` ends an accumulation window (DeepSpeed's method).

        Args:
            is_boundary: True makes the next ``step()`` apply the optimizer whatever the micro-step count;
                False defers it. It stays in force until set again (DeepSpeed's behaviour).
        """
        self._boundary_override = bool(is_boundary)

    def _boundary_from_override(self, counted: bool) -> bool:
        return counted if self._boundary_override is None else self._boundary_override

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without the data-parallel reduction (DeepSpeed's / DDP's ``no_sync``).

        Gradients are reduced once, at the next ``step()`` that applies the update, so backward never
        communicates here; as in DeepSpeed, ``step()`` inside the context is an error.

        Raises:
            RuntimeError: ZeRO-Cache with states sharded over ranks, whose backward reduce-scatters
                gradients to their owners (DeepSpeed raises for ZeRO-2/3 alike); or a nested context.
        """
        if self.zero_cache_shards > 1:
            raise RuntimeError("no_sync() is incompatible with ZeRO-Cache's sharded states (gradients are "
                               "reduce-scattered to their owners during backward), as it is with DeepSpeed's ZeRO "
                               "stage 2/3; accumulate with gradient_accumulation_steps instead")
        if self._inside_no_sync:
            raise RuntimeError("no_sync() contexts do not nest")
        self._inside_no_sync = True
        try:
            yield
        finally:
            self._inside_no_sync = False

    def _check_step_outside_no_sync(self) -> None:
        if self._inside_no_sync:
            raise RuntimeError("engine.step() inside no_sync() is an error (as in DeepSpeed): run backward() for the "
                               "micro-batches inside the context, then leave it and call step()")

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """Whether whole weights can be gathered when the model is saved: always here.

        DeepSpeed answers ``zero_optimization.stage3_gather_16bit_weights_on_model_save``, because its ZeRO-3
        gathers only when asked to; this engine consolidates its chunks and shards on demand for any save
        (``save_16bit_model`` writes them whatever the key says), so accelerate's ``get_state_dict`` gets
        the weights instead of its "set zero3_save_16bit_model" error.
        """
        return True

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False
                                             ) -> dict[str, torch.Tensor] | None:
        """The whole model's state dict in the compute dtype, on the CPU, on rank 0; None on other ranks.

        DeepSpeed's (private, but accelerate's ``get_state_dict`` and transformers call it by name). Every rank
        must call it (gathering sharded states is a collective).
        """
        state = self._state_dict_for_writer()
        if state is None:
            return None
        dtype = self.compute_dtype
        state = {key: value.to(dtype) if value.is_floating_point() else value for key, value in state.items()}
        if exclude_frozen_parameters:
            frozen = {name for name, p in self.module.named_parameters() if not p.requires_grad}
            state = {key: value for key, value in state.items() if key not in frozen}
        return state

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False
                                       ) -> dict[str, torch.Tensor] | None:
        """DeepSpeed's name for the same under ZeRO-3 or tensor parallelism (the latter is not built here)."""
        return self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Write the whole model's state dict in the compute dtype to ``save_dir/save_filename`` (rank 0).

        What DeepSpeed writes: ``torch.save`` of the module's state dict, floating tensors in the training
        dtype (fp32 in an fp32 run), consolidated from ZeRO-Cache's chunks and shards. Tensors are on the
        CPU. Every rank must call it (gathering sharded states is a collective).

        Args:
            save_dir: created if missing.
            save_filename: the file name.
            exclude_frozen_parameters: leave out parameters with ``requires_grad=False``.

        Returns:
            True (the model was saved).
        """
        state = self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
        if state is not None:
            Path(save_dir).mkdir(parents=True, exist_ok=True)
            torch.save(state, Path(save_dir) / save_filename)
        self.ctx.barrier()
        return True

    def save_fp16_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's older name of :meth:`save_16bit_model`."""
        return self.save_16bit_model(save_dir, save_filename)
