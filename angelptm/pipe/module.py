"""``deepspeed.pipe.PipelineModule``, ``LayerSpec`` and ``TiedLayerSpec``: a model given as a list of layers.

The constructor takes DeepSpeed's arguments and partitions the layers the same way ("parameters",
"uniform", "type:<regex>"; :mod:`angelptm.pipe.partition`), plus ``partition_method="autopipe"``, which
leaves the split to AutoPipe's op-level search over a profiled micro-batch at ``initialize()``.

Unlike DeepSpeed, every rank builds every layer: the engine traces the whole model once and runs
this rank's slice of the traced graph on the AutoPipe runtime (:mod:`angelptm.pipe.engine`). Each stage's
layers are built from the random state DeepSpeed's stage would build them from (the state after
partitioning, or ``base_seed + layer`` with ``seed_layers``), so the initial weights are DeepSpeed's.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Callable, Iterable

import torch
from torch import nn

from angelptm import comm
from angelptm.pipe.partition import partition_balanced, partition_uniform
from angelptm.runtime.activation_checkpointing import checkpointing
from angelptm.runtime.utils import set_random_seed

AUTOPIPE = "autopipe"


class PipelineError(Exception):
    """Misuse of :class:`PipelineModule` or the pipeline engine (DeepSpeed's name)."""


class LayerSpec:
    """A layer to build later: ``typename(*module_args, **module_kwargs)`` (DeepSpeed's class).

    Args:
        typename: an ``nn.Module`` subclass.
        *module_args, **module_kwargs: its constructor's arguments.
    """

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise RuntimeError("LayerSpec only supports torch.nn.Module types.")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self, log: bool = False) -> nn.Module:
        """Construct the layer."""
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer whose module is shared by every spec with the same ``key`` (e.g. tied embeddings).

    Args:
        key: specs with the same key use one module; its gradients are summed over the stages that use it.
        typename, *module_args, **module_kwargs: as :class:`LayerSpec`.
        forward_fn: ``forward_fn(module, x)`` instead of ``module(x)`` (e.g. the output projection).
        tied_weight_attr: accepted for compatibility: every parameter of a tied module is shared here.
    """

    def __init__(self, key: str, typename: type, *module_args: Any, forward_fn: Callable | None = None,
                 tied_weight_attr: str | list[str] = "weight", **module_kwargs: Any) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


def _set_rng_state(state: tuple) -> None:
    """Set torch's RNG (CPU and CUDA) to ``state`` (from :func:`_rng_state`)."""
    torch.random.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def _rng_state() -> tuple:
    return torch.random.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None


class PipelineModule(nn.Module):
    """Layers to run as a pipeline, with DeepSpeed's constructor.

    Args:
        layers: modules, :class:`LayerSpec` / :class:`TiedLayerSpec`, or callables; the output of each is the
            input of the next (an ``nn.Sequential`` works).
        num_stages: pipeline stages; the world size divided by it is the data-parallel degree.
        topology: not supported (raises); pass ``num_stages``.
        loss_fn: ``loss = loss_fn(outputs, labels)`` (required here: the pipeline trains on a loss).
        seed_layers, seed_fn, base_seed: seed ``base_seed + layer index`` before building each layer.
        partition_method: "parameters" (default), "uniform", "type:<regex>", or "autopipe" (op-level search
            over a profile of one micro-batch of ``training_data``, measured at ``initialize()``).
        activation_checkpoint_interval: > 0 recomputes activations in backward (per stage here, not per
            ``interval`` layers; the arithmetic is the same).
        activation_checkpoint_func: DeepSpeed's or torch's checkpoint (anything else raises).
        checkpointable_layers: accepted (stage-level recompute covers every layer).
        dynamic_shape: not supported (raises): stages are traced at the first batch's shapes.
    """

    def __init__(self, layers: Iterable[Any], num_stages: int | None = None, topology: Any = None,
                 loss_fn: Callable | None = None, seed_layers: bool = False, seed_fn: Callable | None = None,
                 base_seed: int = 1234, partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable = checkpointing.checkpoint,
                 checkpointable_layers: list[str] | None = None, dynamic_shape: bool = False) -> None:
        super().__init__()
        _check_arguments(num_stages, topology, loss_fn, activation_checkpoint_func, dynamic_shape)
        self.num_stages = num_stages
        self.world_size = comm.get_world_size()
        if self.world_size % num_stages:
            raise PipelineError(f"num_stages ({num_stages}) must divide distributed world size ({self.world_size})")
        self.global_rank = comm.get_rank()
        self.stage_id = self.global_rank % num_stages  # AutoPipe's layout: rank = replica * num_stages + stage
        self.loss_fn = loss_fn
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.checkpointable_layers = checkpointable_layers
        self.partition_method = partition_method
        self._layer_specs = list(layers)
        self._num_layers = len(self._layer_specs)
        self.parts: list[int] | None = None
        """First layer of each stage, then the number of layers (None with "autopipe": it cuts between ops)."""
        if partition_method.lower() != AUTOPIPE:
            self.parts = self._partition_layers(partition_method.lower())
        self.forward_funcs: list[Callable] = [None] * self._num_layers
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self._build()

    # ------------------------------------------------------------------ partitioning (DeepSpeed's rules)
    def _partition_layers(self, method: str) -> list[int]:
        if method == "uniform":
            return partition_uniform(self._num_layers, self.num_stages)
        if method == "parameters":
            return partition_balanced(self._count_layer_params(), self.num_stages)
        if method.startswith("type:"):
            pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)
            weights = [1 if (name := _layer_name(layer)) and pattern.search(name) else 0 for layer in self._layer_specs]
            if not any(weights):
                raise RuntimeError(f"Partitioning '{method}' found no valid layers to partition.")
            return partition_balanced(weights, self.num_stages)
        raise NotImplementedError(f"Partitioning method {method} not implemented; use 'parameters', 'uniform', "
                                  "'type:<regex>' or 'autopipe'")

    def _count_layer_params(self) -> list[int]:
        """Trainable parameters per layer; each spec is built once to count them (as DeepSpeed does: this draws
        random numbers, so the stages build from the state after it)."""
        counts = []
        for layer in self._layer_specs:
            module = layer.build() if isinstance(layer, LayerSpec) else layer
            counts.append(sum(p.numel() for p in module.parameters() if p.requires_grad)
                          if isinstance(module, nn.Module) else 0)
        return counts

    # ------------------------------------------------------------------ building
    def _build(self) -> None:
        """Build every layer; each stage's from the random state its DeepSpeed stage starts from."""
        parts = self.parts or [0, self._num_layers]
        start, own_end = _rng_state(), None
        for stage in range(len(parts) - 1):
            _set_rng_state(start)
            built_here: set[str] = set()
            for index in range(parts[stage], parts[stage + 1]):
                self._build_layer(index, built_here)
            if stage == (self.stage_id if self.parts else 0):
                own_end = _rng_state()
        _set_rng_state(own_end)  # leave the random state as this rank's DeepSpeed stage would

    def _build_layer(self, index: int, built_here: set[str]) -> None:
        layer = self._layer_specs[index]
        if self.seed_layers:
            (self.seed_fn or set_random_seed)(self.base_seed + index)
        if isinstance(layer, PipelineModule):
            raise NotImplementedError("RECURSIVE BUILD NOT YET IMPLEMENTED")
        if isinstance(layer, TiedLayerSpec):
            if layer.key not in built_here:  # DeepSpeed builds it on each stage that uses it (drawing random
                built_here.add(layer.key)    # numbers), then keeps the first stage's weights
                module = layer.build()
                if layer.key not in self.tied_modules:
                    self.tied_modules[layer.key] = module
                    self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
            module = self.tied_modules[layer.key]
            self.forward_funcs[index] = module if layer.forward_fn is None else functools.partial(layer.forward_fn,
                                                                                                module)
        elif isinstance(layer, (nn.Module, LayerSpec)):
            module = layer.build() if isinstance(layer, LayerSpec) else layer
            self.add_module(str(index), module)
            self.forward_funcs[index] = module
        else:
            self.forward_funcs[index] = layer

    # ------------------------------------------------------------------ running
    def forward(self, forward_input: Any) -> Any:
        """All layers in order, in this process (what the pipeline runs split over its stages)."""
        x = forward_input
        for function in self.forward_funcs:
            x = function(x)
        return x

    def stage_layers(self, stage_id: int) -> range:
        """Layer indices of ``stage_id`` (DeepSpeed's ``parts``)."""
        if self.parts is None:
            raise PipelineError("partition_method='autopipe' splits between ops, not layers, at the first batch")
        return range(self.parts[stage_id], self.parts[stage_id + 1])

    def stage_parameters(self, stage_id: int) -> list[nn.Parameter]:
        """The parameters of ``stage_id``'s layers (a tied module's in every stage that uses it), each once."""
        params: dict[int, nn.Parameter] = {}
        for index in self.stage_layers(stage_id):
            spec = self._layer_specs[index]
            owner = self.tied_modules[spec.key] if isinstance(spec, TiedLayerSpec) else self._modules.get(str(index))
            if owner is not None:
                params.update((id(p), p) for p in owner.parameters())
        return list(params.values())

    def topology(self) -> Any:
        raise NotImplementedError("PipelineModule.topology(): process topologies are not built; the layout is "
                                  "num_stages ranks per pipeline x (world size / num_stages) data-parallel replicas")


def _layer_name(layer: Any) -> str | None:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", None)


def _check_arguments(num_stages: int | None, topology: Any, loss_fn: Callable | None,
                     checkpoint_func: Callable, dynamic_shape: bool) -> None:
    if topology is not None:
        raise NotImplementedError("PipelineModule(topology=...) is not supported (no tensor parallelism); pass "
                                  "num_stages: world size / num_stages ranks become data-parallel replicas")
    if num_stages is None or num_stages < 1:
        raise RuntimeError("must provide num_stages >= 1")
    if loss_fn is None:
        raise NotImplementedError("PipelineModule(loss_fn=None) is not supported: the pipeline is traced with its "
                                  "loss; pass loss_fn=lambda outputs, labels: ...")
    if checkpoint_func not in (checkpointing.checkpoint, checkpointing.non_reentrant_checkpoint,
                               torch.utils.checkpoint.checkpoint):
        raise NotImplementedError("PipelineModule(activation_checkpoint_func=...): a custom checkpoint function is "
                                  "not used (stages recompute with torch.utils.checkpoint); leave the default")
    if dynamic_shape:
        raise NotImplementedError("PipelineModule(dynamic_shape=True) is not supported: stages are traced at the "
                                  "first batch's shapes; pad batches to one shape")
