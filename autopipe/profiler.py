"""Op-level profiler: time each op of a traced graph forward and backward on its device, record bytes.

Every op is run on its own, on the inputs it saw in one reference forward pass: forward with autograd
recording, backward as ``torch.autograd.grad`` of its outputs with respect to its differentiable inputs
(fresh leaves, so no ``.grad`` of the model is touched). Each is warmed up, then timed ``repeats`` times;
the median is kept. Times come from CUDA events on a GPU (the kernels' time on the stream, launch gaps
included) and from ``time.perf_counter`` on the CPU.
"""

from __future__ import annotations

import operator
import statistics
import time
from typing import Any, Callable

import torch
from torch import fx, nn

from autopipe.graph import OpGraph, boundary_summary, trace, value_tensors
from autopipe.profile import OpRecord, Profile


def median_time_s(run: Callable[[], Any], device: torch.device, *, warmup: int, repeats: int) -> float:
    """Median wall time of ``run()`` over ``repeats`` timed calls after ``warmup`` untimed ones.

    Args:
        run: the work to time.
        device: CUDA events are used for a CUDA device, a monotonic clock otherwise.
        warmup: untimed calls first.
        repeats: timed calls (>= 1).

    Returns:
        Seconds.
    """
    for _ in range(warmup):
        run()
    samples = []
    if device.type == "cuda":
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
        for start, end in pairs:
            start.record()
            run()
            end.record()
        torch.cuda.synchronize(device)
        samples = [start.elapsed_time(end) / 1e3 for start, end in pairs]
    else:
        for _ in range(repeats):
            begin = time.perf_counter()
            run()
            samples.append(time.perf_counter() - begin)
    return statistics.median(samples)


def evaluate(graph: OpGraph, inputs: dict[str, torch.Tensor]) -> dict[fx.Node, object]:
    """Run the graph once without autograd and keep every node's value."""
    values: dict[fx.Node, object] = {}
    with torch.no_grad():
        for node in graph.module.graph.nodes:
            if node.op == "placeholder":
                values[node] = inputs[node.name]
            elif node.op == "get_attr":
                values[node] = operator.attrgetter(node.target)(graph.module)
            elif node.op == "call_function":
                args, kwargs = fx.map_arg((node.args, node.kwargs), lambda n: values[n])
                values[node] = node.target(*args, **kwargs)
    return values


def _needs_grad(graph: OpGraph, values: dict[fx.Node, object]) -> dict[fx.Node, bool]:
    """Whether each node's value carries a gradient in training (it depends on a trainable parameter)."""
    flags: dict[fx.Node, bool] = {}
    for node in graph.module.graph.nodes:
        value = values.get(node)
        if node.op == "get_attr":
            flags[node] = isinstance(value, nn.Parameter) and value.requires_grad
        elif node.op == "call_function":
            floating = any(t.is_floating_point() for t in value_tensors(value))
            flags[node] = floating and any(flags.get(arg, False) for arg in node.all_input_nodes)
        else:
            flags[node] = False
    return flags


def _op_runners(node: fx.Node, values: dict[fx.Node, object], needs_grad: dict[fx.Node, bool]
                ) -> tuple[Callable[[], Any], Callable[[], Any] | None]:
    """Closures that run the op forward, and its backward (None if nothing needs a gradient)."""
    leaves: dict[fx.Node, torch.Tensor] = {}
    for arg in node.all_input_nodes:
        value = values[arg]
        if needs_grad[arg] and isinstance(value, torch.Tensor):
            leaves[arg] = value.detach().requires_grad_(True)
    args, kwargs = fx.map_arg((node.args, node.kwargs), lambda n: leaves.get(n, values[n]))

    def forward() -> Any:
        with torch.enable_grad():
            return node.target(*args, **kwargs)

    if not leaves or not needs_grad[node]:
        return forward, None
    with torch.enable_grad():
        outputs = [t for t in value_tensors(node.target(*args, **kwargs)) if t.requires_grad]
    if not outputs:
        return forward, None
    grads = [torch.randn_like(t) for t in outputs]
    inputs = list(leaves.values())

    def backward() -> Any:
        return torch.autograd.grad(outputs, inputs, grads, retain_graph=True, allow_unused=True)

    return forward, backward


def _param_owners(graph: OpGraph) -> dict[fx.Node, list[nn.Parameter]]:
    """Parameters each op reads (directly or through free nodes), each attributed to its first reader."""
    seen: set[int] = set()
    owners: dict[fx.Node, list[nn.Parameter]] = {}
    for node in graph.ops:
        stack, params = list(node.all_input_nodes), []
        while stack:
            arg = stack.pop()
            if arg.op == "get_attr":
                value = operator.attrgetter(arg.target)(graph.module)
                if isinstance(value, nn.Parameter) and id(value) not in seen:
                    seen.add(id(value))
                    params.append(value)
            elif arg in graph.free:
                stack.extend(arg.all_input_nodes)
        owners[node] = params
    return owners


def _new_bytes(node: fx.Node, values: dict[fx.Node, object]) -> int:
    """Bytes of the op's outputs that do not share storage with one of its inputs."""
    input_storages = {t.untyped_storage().data_ptr()
                      for arg in node.all_input_nodes for t in value_tensors(values[arg])}
    return sum(t.numel() * t.element_size() for t in value_tensors(values[node])
               if t.untyped_storage().data_ptr() not in input_storages)


def profile_graph(graph: OpGraph, inputs: dict[str, torch.Tensor], *, warmup: int = 2,
                  repeats: int = 5) -> Profile:
    """Measure every op of ``graph`` for one micro-batch.

    Args:
        graph: from :func:`autopipe.graph.trace`, with its parameters on the device to measure.
        inputs: the example inputs (same shapes as traced), on that device.
        warmup: untimed runs of each op.
        repeats: timed runs of each op; the median is kept.

    Returns:
        The profile.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats={repeats}, warmup={warmup}: need repeats >= 1 and warmup >= 0")
    device = next(iter(inputs.values())).device
    values = evaluate(graph, inputs)
    needs_grad = _needs_grad(graph, values)
    owners = _param_owners(graph)
    layers, num_layers = graph.op_layers()
    records = []
    for index, node in enumerate(graph.ops):
        forward, backward = _op_runners(node, values, needs_grad)
        forward_s = median_time_s(forward, device, warmup=warmup, repeats=repeats)
        backward_s = median_time_s(backward, device, warmup=warmup, repeats=repeats) if backward else 0.0
        stack = node.meta.get("nn_module_stack") or {}
        params = owners[node]
        records.append(OpRecord(
            name=node.name, target=str(node.target), module=list(stack.values())[-1][0] if stack else "",
            layer=layers[index] if layers else 0, forward_s=forward_s, backward_s=backward_s,
            param_bytes=sum(p.numel() * p.element_size() for p in params),
            param_numel=sum(p.numel() for p in params), output_bytes=_new_bytes(node, values)))
    sizes, counts, cuttable = boundary_summary(graph, values)
    return Profile(ops=records, num_body_ops=graph.num_body_ops, boundary_bytes=sizes, boundary_num_tensors=counts,
                   boundary_cuttable=cuttable, num_layers=num_layers, device=str(device),
                   input_shapes={name: list(t.shape) for name, t in inputs.items()})


def profile_module(module: nn.Module, inputs: dict[str, torch.Tensor], target_name: str, *, warmup: int = 2,
                   repeats: int = 5) -> tuple[OpGraph, Profile]:
    """Trace ``module(**inputs)`` and profile it (see :func:`profile_graph`).

    Args:
        module: returns a scalar loss given ``inputs``; already on the device and in the dtype to measure.
        inputs: example inputs of one micro-batch, including the target.
        target_name: the target's keyword.
        warmup: untimed runs per op.
        repeats: timed runs per op.

    Returns:
        The traced graph and its profile.
    """
    graph = trace(module, inputs, target_name)
    return graph, profile_graph(graph, inputs, warmup=warmup, repeats=repeats)
