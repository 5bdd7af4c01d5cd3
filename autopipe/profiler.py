"""Op-level profiler: time each op of a traced graph forward and backward on its device, record bytes.

Every op is run on its own, on the inputs it saw in one reference forward pass: forward with autograd
recording, backward as ``torch.autograd.grad`` of its outputs with respect to its differentiable inputs
(fresh leaves, so no ``.grad`` of the model is touched). Each is warmed up, then timed as ``repeats``
samples of ``calls`` back-to-back runs (:func:`autopipe.timing.per_call_time_s`); the fastest is kept.

Timed alone, an op also pays the harness's fixed cost per call, which a real run does not. So the profiler
also times the same path on ops that do no work (the overhead) and the whole graph's forward + backward end
to end (the ground truth, as the pipeline runs a stage), and :func:`autopipe.calibration.calibrate_op_times`
turns the raw times into ones that sum to the ground truth. The factors are kept in the profile.
"""

from __future__ import annotations

import operator
import warnings
from typing import Any, Callable

import torch
from torch import fx, nn

from autopipe.calibration import calibrate_op_times
from autopipe.graph import OpGraph, boundary_summary, build_loss_module, build_stage_modules, trace, value_tensors
from autopipe.profile import OpRecord, Profile
from autopipe.timing import per_call_time_s, sample_times_s, spin_cycles_per_s


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


def _runners(target: Callable, args: tuple, kwargs: dict, leaves: list[torch.Tensor], output_needs_grad: bool
             ) -> tuple[Callable[[], Any], Callable[[], Any] | None]:
    """Closures that run ``target(*args, **kwargs)`` forward, and its backward into ``leaves`` (None if nothing
    needs a gradient)."""

    def forward() -> Any:
        with torch.enable_grad():
            return target(*args, **kwargs)

    if not leaves or not output_needs_grad:
        return forward, None
    with torch.enable_grad():
        outputs = [t for t in value_tensors(target(*args, **kwargs)) if t.requires_grad]
    if not outputs:
        return forward, None
    grads = [torch.randn_like(t) for t in outputs]

    def backward() -> Any:
        return torch.autograd.grad(outputs, leaves, grads, retain_graph=True, allow_unused=True)

    return forward, backward


def _op_runners(node: fx.Node, values: dict[fx.Node, object], needs_grad: dict[fx.Node, bool]
                ) -> tuple[Callable[[], Any], Callable[[], Any] | None]:
    """Closures that run the op forward, and its backward (None if nothing needs a gradient)."""
    leaves: dict[fx.Node, torch.Tensor] = {}
    for arg in node.all_input_nodes:
        value = values[arg]
        if needs_grad[arg] and isinstance(value, torch.Tensor):
            leaves[arg] = value.detach().requires_grad_(True)
    args, kwargs = fx.map_arg((node.args, node.kwargs), lambda n: leaves.get(n, values[n]))
    return _runners(node.target, args, kwargs, list(leaves.values()), needs_grad[node])


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


def harness_overhead_s(device: torch.device, dtype: torch.dtype, *, warmup: int, repeats: int, calls: int,
                       cycles_per_s: float | None = None) -> tuple[float, float]:
    """The per-op timing path's own cost per call, timed on ops that do no work.

    Forward: the closure around a Python identity (no dispatch, no kernel). Backward: ``torch.autograd.grad``
    through ``aten.alias`` (a view: no kernel either way). What is left is the harness (closure, grad mode,
    ``autograd.grad``'s set-up), which an op run inside a whole graph does not pay.

    Args:
        device: where the ops are timed.
        dtype: the model's floating-point dtype.
        warmup, repeats, calls: as for :func:`autopipe.timing.per_call_time_s`.
        cycles_per_s: the spin kernel's clock (CUDA).

    Returns:
        ``(forward_s, backward_s)`` per call.
    """
    leaf = torch.ones(1, device=device, dtype=dtype, requires_grad=True)
    forward, _ = _runners(lambda tensor: tensor, (leaf,), {}, [leaf], False)
    _, backward = _runners(torch.ops.aten.alias.default, (leaf,), {}, [leaf], True)
    timing = dict(warmup=max(warmup, 1), repeats=max(repeats, 3), calls=calls, cycles_per_s=cycles_per_s)
    return per_call_time_s(forward, device, **timing), per_call_time_s(backward, device, **timing)


def whole_graph_time_s(graph: OpGraph, inputs: dict[str, torch.Tensor], *, warmup: int, repeats: int) -> float:
    """Forward + backward time of the whole graph end to end, run as one pipeline stage plus its loss.

    The backward accumulates into the parameters' ``.grad`` as a training step's micro-batches do (the
    accumulation of a large embedding's or head's gradient is part of the cost); the model's own ``.grad``
    tensors are put back afterwards. The fastest run is kept, as the per-op times keep theirs.

    Args:
        graph: the traced model.
        inputs: one micro-batch, including the target.
        warmup: untimed runs.
        repeats: timed runs.

    Returns:
        Seconds.
    """
    device = next(iter(inputs.values())).device
    stage, = build_stage_modules(graph, [0])
    loss_module = build_loss_module(graph)
    args = tuple(inputs[name] for name in graph.input_names)
    target = inputs[graph.target_name]
    params = [p for p in graph.module.parameters() if p.requires_grad]

    def forward_backward() -> None:
        with torch.enable_grad():
            torch.autograd.backward(loss_module(stage(*args), target), inputs=params)

    saved_grads = [p.grad for p in params]
    try:
        for param in params:
            param.grad = None
        return min(sample_times_s(forward_backward, device, warmup=warmup, repeats=repeats))
    finally:
        for param, grad in zip(params, saved_grads):
            param.grad = grad


def _ground_truth_s(graph: OpGraph, inputs: dict[str, torch.Tensor], *, warmup: int, repeats: int) -> float:
    """:func:`whole_graph_time_s`, or 0 (no calibration) when the whole graph does not fit on the device."""
    try:
        return whole_graph_time_s(graph, inputs, warmup=max(warmup, 1), repeats=max(repeats, 5))
    except torch.OutOfMemoryError:
        warnings.warn("autopipe profiler: the whole graph's forward and backward ran out of device memory; "
                      "op times are not calibrated to it", RuntimeWarning, stacklevel=3)
        return 0.0


def profile_graph(graph: OpGraph, inputs: dict[str, torch.Tensor], *, warmup: int = 2,
                  repeats: int = 5, calls: int = 4, calibrate: bool = True) -> Profile:
    """Measure every op of ``graph`` for one micro-batch.

    Args:
        graph: from :func:`autopipe.graph.trace`, with its parameters on the device to measure.
        inputs: the example inputs (same shapes as traced), on that device.
        warmup: untimed runs of each op.
        repeats: timed samples of each op; the fastest is kept.
        calls: back-to-back runs per sample.
        calibrate: subtract the harness overhead and scale the op times to the whole graph timed end to end
            (see :mod:`autopipe.calibration`); False keeps the raw per-op times.

    Returns:
        The profile.
    """
    if repeats < 1 or warmup < 0 or calls < 1:
        raise ValueError(f"repeats={repeats}, warmup={warmup}, calls={calls}: need repeats >= 1, warmup >= 0 "
                         "and calls >= 1")
    device = next(iter(inputs.values())).device
    cycles_per_s = spin_cycles_per_s(device) if device.type == "cuda" else None
    timing = dict(warmup=warmup, repeats=repeats, calls=calls, cycles_per_s=cycles_per_s)
    values = evaluate(graph, inputs)
    needs_grad = _needs_grad(graph, values)
    raw_forward_s, raw_backward_s = [], []
    for node in graph.ops:
        forward, backward = _op_runners(node, values, needs_grad)
        raw_forward_s.append(per_call_time_s(forward, device, **timing))
        raw_backward_s.append(per_call_time_s(backward, device, **timing) if backward else 0.0)
    overhead_s, truth_s = (0.0, 0.0), 0.0
    if calibrate:
        dtype = next((p.dtype for p in graph.module.parameters() if p.is_floating_point()), torch.float32)
        overhead_s = harness_overhead_s(device, dtype, **timing)
        truth_s = _ground_truth_s(graph, inputs, warmup=warmup, repeats=repeats)
    count = len(graph.ops)
    calibrated = calibrate_op_times(raw_forward_s + raw_backward_s,
                                    [overhead_s[0]] * count + [overhead_s[1]] * count, truth_s)
    forward_s, backward_s = calibrated.times_s[:count], calibrated.times_s[count:]
    owners = _param_owners(graph)
    layers, num_layers = graph.op_layers()
    records = []
    for index, node in enumerate(graph.ops):
        stack = node.meta.get("nn_module_stack") or {}
        params = owners[node]
        records.append(OpRecord(
            name=node.name, target=str(node.target), module=list(stack.values())[-1][0] if stack else "",
            layer=layers[index] if layers else 0, forward_s=forward_s[index], backward_s=backward_s[index],
            param_bytes=sum(p.numel() * p.element_size() for p in params),
            param_numel=sum(p.numel() for p in params), output_bytes=_new_bytes(node, values)))
    sizes, counts, cuttable = boundary_summary(graph, values)
    return Profile(ops=records, num_body_ops=graph.num_body_ops, boundary_bytes=sizes, boundary_num_tensors=counts,
                   boundary_cuttable=cuttable, num_layers=num_layers, device=str(device),
                   input_shapes={name: list(t.shape) for name, t in inputs.items()},
                   forward_overhead_s=overhead_s[0], backward_overhead_s=overhead_s[1], time_scale=calibrated.scale,
                   raw_forward_total_s=sum(raw_forward_s), raw_backward_total_s=sum(raw_backward_s),
                   measured_total_s=truth_s)


def profile_module(module: nn.Module, inputs: dict[str, torch.Tensor], target_name: str, *, warmup: int = 2,
                   repeats: int = 5, calls: int = 4, calibrate: bool = True) -> tuple[OpGraph, Profile]:
    """Trace ``module(**inputs)`` and profile it (see :func:`profile_graph`).

    Args:
        module: returns a scalar loss given ``inputs``; already on the device and in the dtype to measure.
        inputs: example inputs of one micro-batch, including the target.
        target_name: the target's keyword.
        warmup: untimed runs per op.
        repeats: timed samples per op.
        calls: back-to-back runs per sample.
        calibrate: calibrate the op times to the whole graph (see :func:`profile_graph`).

    Returns:
        The traced graph and its profile.
    """
    graph = trace(module, inputs, target_name)
    return graph, profile_graph(graph, inputs, warmup=warmup, repeats=repeats, calls=calls, calibrate=calibrate)
