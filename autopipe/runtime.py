"""Pipeline runtime: this rank's stages on ``torch.distributed.pipelining``, its schedule, its groups.

Rank layout: global rank = replica * S + stage_rank (S = ranks per pipeline). Chunk c of the S * v chunks runs
on stage_rank c % S (the interleaved layout of Narayanan et al. 2021). Ranks with the same stage_rank form a
data-parallel group. A parameter read by chunks on several stage ranks (tied embeddings) exists once per
rank; its gradients are summed over those ranks (Megatron's embedding group) before the optimizer step.

Every rank must build the same :class:`PipelineRunner` (same graph and cuts): process groups are created
collectively and in the same order everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.utils.checkpoint import checkpoint

from autopipe.graph import OpGraph, build_loss_module, build_stage_modules
from autopipe.timing import median_time_s

# ``torch.distributed.pipelining`` is imported where a pipeline is built, not with this module, which the engine's
# entry point imports whether or not the model is pipelined: it brings torch._dynamo, sympy and triton, and
# ``import angelptm`` took 5.3-6.5 s with it, 3.9-4.6 s without (2 CPU cores).
if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage


@dataclass(frozen=True, slots=True)
class PipelineLayout:
    """Where every rank sits: world = num_replicas * num_stages."""

    world_size: int
    num_stages: int
    """Ranks per pipeline (S)."""
    virtual_stages_per_rank: int = 1
    """Chunks per rank (v)."""

    def __post_init__(self) -> None:
        if self.num_stages < 1 or self.world_size % self.num_stages:
            raise ValueError(f"autopipe.num_stages={self.num_stages}: must divide the number of ranks "
                             f"{self.world_size} (the rest is data parallelism); use one of "
                             f"{[d for d in range(1, self.world_size + 1) if self.world_size % d == 0]}")

    @property
    def num_replicas(self) -> int:
        """Data-parallel degree."""
        return self.world_size // self.num_stages

    @property
    def num_chunks(self) -> int:
        """Stages of the model: S * v."""
        return self.num_stages * self.virtual_stages_per_rank

    def chunks_of(self, rank: int) -> list[int]:
        """Chunk indices that ``rank`` runs, ascending."""
        stage_rank = rank % self.num_stages
        return [stage_rank + i * self.num_stages for i in range(self.virtual_stages_per_rank)]

    def global_rank(self, replica: int, stage_rank: int) -> int:
        """Global rank of ``stage_rank`` in pipeline ``replica``."""
        return replica * self.num_stages + stage_rank


def _new_group(ranks: list[int], world_size: int) -> dist.ProcessGroup | None:
    return dist.new_group(ranks) if world_size > 1 else None


def check_microbatches(schedule: str, num_microbatches: int, num_stages: int) -> None:
    """Refuse a micro-batch count the schedule cannot run (checked before any tracing or profiling).

    Raises:
        ValueError: interleaved with M not a multiple of S, or 1F1B with M < S.
    """
    if schedule == "interleaved" and num_microbatches % num_stages:
        raise ValueError(f"autopipe.num_microbatches={num_microbatches}: the interleaved schedule needs a "
                         f"multiple of num_stages={num_stages}")
    if schedule == "1f1b" and num_microbatches < num_stages:
        raise ValueError(f"autopipe.num_microbatches={num_microbatches}: 1F1B needs at least num_stages="
                         f"{num_stages} micro-batches")


def build_schedule(stages: list[PipelineStage], schedule: str, num_microbatches: int,
                   loss_fn: Callable) -> object:
    """The ``torch.distributed.pipelining`` schedule for ``schedule``.

    Gradients are not rescaled by the schedule (``scale_grads=False``): ``loss_fn`` already divides by
    the number of micro-batches per optimizer step, so a pipelined step sums to the same mean loss.
    """
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    check_microbatches(schedule, num_microbatches, stages[0].group_size)
    if schedule == "interleaved":
        return ScheduleInterleaved1F1B(stages, num_microbatches, loss_fn=loss_fn, scale_grads=False)
    if schedule == "1f1b":
        return Schedule1F1B(stages[0], num_microbatches, loss_fn=loss_fn, scale_grads=False)
    if schedule == "gpipe":
        return ScheduleGPipe(stages[0], num_microbatches, loss_fn=loss_fn, scale_grads=False)
    raise ValueError(f"autopipe.schedule: must be one of ('gpipe', '1f1b', 'interleaved'), got {schedule!r}")


def _recompute(module: fx.GraphModule) -> fx.GraphModule:
    """Stage-level activation checkpointing: keep the inputs, re-run the forward in backward."""
    inner = module.forward
    module.forward = lambda *args: checkpoint(inner, *args, use_reentrant=False)
    return module


class PipelineRunner:
    """This rank's chunks of a pipelined model, and the schedule that trains them.

    Args:
        graph: the traced model (identical on every rank).
        op_starts: first body op of each of the ``layout.num_chunks`` chunks.
        layout: world, stages, chunks per rank.
        rank: this process's global rank.
        device: where the chunks run.
        schedule: "gpipe", "1f1b" or "interleaved".
        num_microbatches: micro-batches per :meth:`step`.
        loss_scale: each micro-batch's loss is multiplied by this (1 / micro-batches per optimizer step
            gives the mean).
        recompute: checkpoint each chunk's activations.
    """

    def __init__(self, graph: OpGraph, op_starts: list[int], layout: PipelineLayout, rank: int, device: torch.device,
                 *, schedule: str, num_microbatches: int, loss_scale: float = 1.0, recompute: bool = False) -> None:
        if len(op_starts) != layout.num_chunks:
            raise ValueError(f"op_starts has {len(op_starts)} chunks; the layout needs {layout.num_chunks}")
        self.layout, self.rank, self.device = layout, rank, device
        self.op_starts = list(op_starts)
        self.input_names = graph.input_names
        self.loss_scale = loss_scale
        modules = build_stage_modules(graph, op_starts)
        self.loss_module = build_loss_module(graph)
        self.chunk_ids = layout.chunks_of(rank)
        self.modules = [_recompute(modules[c]) if recompute else modules[c] for c in self.chunk_ids]
        self.example_values = {c: [node.meta.get("val") for node in graph.crossing(op_starts[c])]
                               for c in self.chunk_ids}
        from torch.distributed.pipelining import PipelineStage

        self.pipeline_group, self.data_parallel_group, self._tie_groups = self._build_groups(modules)
        self.stages = [PipelineStage(modules[c], c, layout.num_chunks, device, group=self.pipeline_group)
                       for c in self.chunk_ids]
        self.schedule = build_schedule(self.stages, schedule, num_microbatches, self.loss)

    def _build_groups(self, modules: list[fx.GraphModule]):
        layout, stage_rank = self.layout, self.rank % self.layout.num_stages
        replica = self.rank // layout.num_stages
        owners: dict[str, set[int]] = {}
        for chunk, module in enumerate(modules):
            for name, _ in module.named_parameters():
                owners.setdefault(name, set()).add(chunk % layout.num_stages)
        self._owners = owners
        pipeline = data_parallel = None
        for r in range(layout.num_replicas):  # every rank creates every group, in the same order
            group = _new_group([layout.global_rank(r, s) for s in range(layout.num_stages)], layout.world_size)
            pipeline = group if r == replica else pipeline
        for s in range(layout.num_stages):
            group = _new_group([layout.global_rank(r, s) for r in range(layout.num_replicas)], layout.world_size)
            data_parallel = group if s == stage_rank else data_parallel
        ties: dict[str, dist.ProcessGroup] = {}
        for ranks in sorted({tuple(sorted(s)) for s in owners.values() if len(s) > 1}):
            for r in range(layout.num_replicas):
                group = _new_group([layout.global_rank(r, s) for s in ranks], layout.world_size)
                if r == replica and stage_rank in ranks:
                    ties.update({name: group for name, s in owners.items() if tuple(sorted(s)) == ranks})
        return pipeline, data_parallel, ties

    @property
    def is_first(self) -> bool:
        """Whether this rank feeds the inputs (runs chunk 0)."""
        return 0 in self.chunk_ids

    @property
    def is_last(self) -> bool:
        """Whether this rank computes the loss (runs the last chunk)."""
        return self.layout.num_chunks - 1 in self.chunk_ids

    def loss(self, output: torch.Tensor | tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
        """The loss tail on the last chunk's output, times ``loss_scale``."""
        outputs = output if isinstance(output, tuple) else (output,)
        return self.loss_module(*outputs, target) * self.loss_scale

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters by their names in the traced module (each once)."""
        seen, named = set(), []
        for module in self.modules:
            for name, param in module.named_parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    named.append((name, param))
        return named

    @property
    def tied_parameter_names(self) -> list[str]:
        """Parameters whose gradients are summed with other stage ranks."""
        return sorted(self._tie_groups)

    @property
    def duplicate_parameter_names(self) -> list[str]:
        """Tied parameters that a lower stage rank also holds: count them once in a global norm."""
        stage_rank = self.rank % self.layout.num_stages
        return sorted(name for name in self._tie_groups if min(self._owners[name]) != stage_rank)

    def step(self, inputs: dict[str, torch.Tensor], target: torch.Tensor, *,
             backward: bool = True) -> torch.Tensor | None:
        """Forward and backward of ``num_microbatches`` micro-batches (gradients accumulate).

        Args:
            inputs: the whole batch by input name; only read on the first rank.
            target: the whole batch's target; only read on the last rank.
            backward: False runs the forward only (evaluation; call it under ``torch.no_grad()``).

        Returns:
            The summed scaled loss on the last rank (detached), None elsewhere.
        """
        # Contiguous: the stages check each micro-batch's strides against the ones they were built
        # with, and a sliced batch (tokens[:, :-1]) has its parent's row stride.
        args = (tuple(inputs[name].to(self.device).contiguous() for name in self.input_names)
                if self.is_first else ())
        losses: list[torch.Tensor] = []
        run = self.schedule.step if backward else self.schedule.eval
        run(*args, target=target.to(self.device).contiguous() if self.is_last else None, losses=losses)
        return torch.stack([loss.detach() for loss in losses]).sum() if self.is_last else None

    def sync_tied_gradients(self, grad_of: Callable[[str, nn.Parameter], torch.Tensor | None]) -> None:
        """Sum the gradients of tied parameters over the stage ranks that hold them.

        Args:
            grad_of: returns the tensor holding a parameter's gradient (``param.grad``, or an
                optimizer's fp32 buffer view); None means zeros.
        """
        named = dict(self.named_parameters())
        for name in self.tied_parameter_names:
            param = named[name]
            grad = grad_of(name, param)
            if grad is None:
                grad = param.grad = torch.zeros_like(param)
            dist.all_reduce(grad, group=self._tie_groups[name])

    def measure_chunk_times_s(self, inputs: dict[str, torch.Tensor], target: torch.Tensor, *, warmup: int = 2,
                              repeats: int = 5) -> list[tuple[float, float]]:
        """Forward and backward time of one micro-batch through each local chunk, run on its own.

        Inputs of later chunks are random tensors of the traced shapes; the last chunk includes the loss.
        Gradients accumulate into the parameters: clear them afterwards.

        Args:
            inputs: one micro-batch of stage-0 inputs by name.
            target: one micro-batch's target.
            warmup: untimed runs.
            repeats: timed runs (median).

        Returns:
            ``(forward_s, backward_s)`` per local chunk, in :attr:`chunk_ids` order.
        """
        results = []
        for chunk, module in zip(self.chunk_ids, self.modules):
            if chunk == 0:
                args = tuple(inputs[name].to(self.device) for name in self.input_names)
            else:
                args = tuple(torch.randn(v.shape, dtype=v.dtype, device=self.device).requires_grad_(True)
                             for v in self.example_values[chunk])
            last = chunk == self.layout.num_chunks - 1

            def forward(module=module, args=args, last=last):
                output = module(*args)
                return self.loss(output, target.to(self.device)) if last else output

            def forward_backward(forward=forward):
                outputs = forward()
                outputs = outputs if isinstance(outputs, tuple) else (outputs,)
                torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])

            forward_s = median_time_s(forward, self.device, warmup=warmup, repeats=repeats)
            total_s = median_time_s(forward_backward, self.device, warmup=warmup, repeats=repeats)
            results.append((forward_s, max(total_s - forward_s, 0.0)))
        return results
