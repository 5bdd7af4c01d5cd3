"""The operator graph of a module: trace it, order its ops, find where it may be cut, slice it into stages.

``torch.export`` turns ``module(**inputs)`` into an ATen-level fx graph whose parameters are ``get_attr``
nodes pointing at the module's own ``nn.Parameter`` objects. Over that graph:

* a *free* node depends only on parameters, buffers and constants (``get_attr``, ``arange``, a slice of a
  RoPE table); it is copied into every stage that uses it and never crosses a cut;
* the *tail* is every op that reads the target input (the labels): it runs in the last stage, as the loss
  function of ``torch.distributed.pipelining`` (which hands the target only to the last stage);
* the *body* is every other op, in graph order; a cut before body op ``k`` sends the values made before
  ``k`` and read at or after it (the "crossing" values) from one stage to the next.

Stage modules are ``fx.GraphModule`` slices that reference the original parameters (same objects), so the
gradients of a pipelined run land on the same tensors as an unpartitioned one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import fx, nn

_LAYER = re.compile(r"^(?P<container>(?:[\w]+\.)*?[\w]+)\.(?P<index>\d+)(?:\.|$)")


def _is_dropped(node: fx.Node) -> bool:
    """Export's guard module and metadata asserts: checks with no data output."""
    if node.op == "call_module" and node.target == "_guards_fn":
        return True
    return node.op == "call_function" and not node.users and "_assert" in str(node.target)


def value_tensors(value: object) -> list[torch.Tensor]:
    """The tensors of a node's value: itself, or the tensors of a tuple/list output."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [item for item in value if isinstance(item, torch.Tensor)]
    return []


@dataclass
class OpGraph:
    """A traced module with its ops ordered body first, tail last."""

    module: fx.GraphModule
    """The exported graph; its parameters are the traced module's parameters."""
    ops: list[fx.Node]
    """Body ops in graph order, then tail ops."""
    num_body_ops: int
    """Ops before the tail; cuts lie in [1, num_body_ops)."""
    target_name: str
    """The placeholder that only the tail reads."""
    free: set[fx.Node] = field(default_factory=set)
    """Nodes computed from parameters, buffers and constants only."""
    position: dict[fx.Node, int] = field(default_factory=dict)
    """Placeholders -1, op i at i, the output node at len(ops)."""

    @property
    def input_names(self) -> tuple[str, ...]:
        """Placeholders that stage 0 takes, in order (everything but the target)."""
        return tuple(node.name for node in self.crossing(0))

    def last_use(self, node: fx.Node) -> int:
        """Position of the last op (or the output) that reads ``node``."""
        return max(self.position[user] for user in node.users)

    def values(self) -> list[fx.Node]:
        """Nodes whose values can cross a cut: stage inputs and body/tail ops, in order."""
        inputs = [n for n in self.module.graph.nodes if n.op == "placeholder" and n.name != self.target_name]
        return [n for n in inputs + self.ops if n.users]

    def crossing(self, cut: int) -> list[fx.Node]:
        """Values made before op ``cut`` and read at or after it (cut 0: the inputs; num_body_ops: what the
        tail reads from the body)."""
        return [v for v in self.values() if self.position[v] < cut <= self.last_use(v)]

    def op_layers(self) -> tuple[list[int], int]:
        """Layer index of each op from its module path: -1 before the first repeated block, 0..L-1 inside,
        L after the last; ``([], 0)`` when the model has no repeated blocks or they are not in order."""
        raw: list[int | None] = []
        counts: dict[str, set[int]] = {}
        paths = []
        for node in self.ops:
            stack = node.meta.get("nn_module_stack") or {}
            path = list(stack.values())[-1][0] if stack else ""
            paths.append(path)
            match = _LAYER.match(path)
            if match:
                counts.setdefault(match["container"], set()).add(int(match["index"]))
        if not counts:
            return [], 0
        container = max(counts, key=lambda name: len(counts[name]))
        num_layers = max(counts[container]) + 1
        for path in paths:
            match = _LAYER.match(path)
            raw.append(int(match["index"]) if match and match["container"] == container else None)
        last = max(i for i, layer in enumerate(raw) if layer is not None)
        layers, current = [], -1
        for i, layer in enumerate(raw):
            current = layer if layer is not None else (num_layers if i > last else current)
            layers.append(current)
        if any(b < a for a, b in zip(layers, layers[1:])):
            return [], 0
        return layers, num_layers


def trace(module: nn.Module, inputs: dict[str, torch.Tensor], target_name: str) -> OpGraph:
    """Trace ``module(**inputs)`` into an :class:`OpGraph`.

    Args:
        module: returns a scalar loss when called with ``inputs`` (which include the target).
        inputs: example keyword inputs at the micro-batch size the pipeline will run (shapes are static).
        target_name: the keyword of the target (e.g. "labels"); only the tail may read it.

    Returns:
        The op graph.

    Raises:
        ValueError: ``target_name`` not among the inputs, no op reads it, or the module returns more
            than one value.
    """
    if target_name not in inputs:
        raise ValueError(f"target_name={target_name!r}: not among the inputs {sorted(inputs)}")
    exported = torch.export.export(module, (), dict(inputs))
    gm = exported.module()
    for node in reversed(list(gm.graph.nodes)):
        if _is_dropped(node):
            gm.graph.erase_node(node)
    gm.recompile()
    output = next(n for n in gm.graph.nodes if n.op == "output")
    results = output.args[0]
    if isinstance(results, (tuple, list)) and len(results) != 1:
        raise ValueError(f"the traced module returns {len(results)} values; it must return only the loss when "
                         f"called with {target_name!r}")
    free: set[fx.Node] = set()
    body, tail, tail_set = [], [], set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "get_attr" or all(arg in free for arg in node.all_input_nodes):
            free.add(node)
        elif any(arg in tail_set or (arg.op == "placeholder" and arg.name == target_name)
                 for arg in node.all_input_nodes):
            tail.append(node)
            tail_set.add(node)
        else:
            body.append(node)
    if not tail:
        raise ValueError(f"no op of the traced module reads {target_name!r}; the module must compute its loss")
    if not body:
        raise ValueError("the traced module has no ops before its loss")
    ops = body + tail
    position = {node: i for i, node in enumerate(ops)}
    position.update({n: -1 for n in gm.graph.nodes if n.op == "placeholder"})
    position[output] = len(ops)
    return OpGraph(module=gm, ops=ops, num_body_ops=len(body), target_name=target_name, free=free,
                   position=position)


def boundary_summary(graph: OpGraph, values: dict[fx.Node, object]) -> tuple[list[int], list[int], list[bool]]:
    """Bytes, tensor count and cuttability of each boundary 0..num_body_ops.

    A boundary is cuttable when every crossing value is a floating-point tensor (it can carry a gradient
    back); built with difference arrays over each value's live range, O(ops + values).

    Args:
        graph: the op graph.
        values: a concrete (or fake) value for every node in ``graph.values()``.

    Returns:
        ``(bytes, num_tensors, cuttable)``, each of length num_body_ops + 1.
    """
    size = graph.num_body_ops + 2
    bytes_diff, count_diff, bad_diff = [0] * size, [0] * size, [0] * size
    for node in graph.values():
        first, last = graph.position[node] + 1, min(graph.last_use(node), graph.num_body_ops)
        if first > last:
            continue
        value = values[node]
        tensors = value_tensors(value)
        ok = isinstance(value, torch.Tensor) and value.is_floating_point()
        for diff, amount in ((bytes_diff, sum(t.numel() * t.element_size() for t in tensors)),
                             (count_diff, 1), (bad_diff, 0 if ok else 1)):
            diff[max(first, 0)] += amount
            diff[last + 1] -= amount
    sizes, counts, cuttable, running = [], [], [], [0, 0, 0]
    for k in range(graph.num_body_ops + 1):
        running = [running[0] + bytes_diff[k], running[1] + count_diff[k], running[2] + bad_diff[k]]
        sizes.append(running[0])
        counts.append(running[1])
        cuttable.append(running[2] == 0)
    return sizes, counts, cuttable


class _DenseGradient(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: stage inputs send their gradients to the
    previous rank, and p2p sends and receive buffers need dense tensors (a transpose-first consumer would
    otherwise hand back a strided gradient)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def dense_gradient(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` unchanged, with a contiguous gradient (see :class:`_DenseGradient`)."""
    return _DenseGradient.apply(tensor) if tensor.requires_grad else tensor


def _free_closure(graph: OpGraph, nodes: list[fx.Node]) -> list[fx.Node]:
    """The free nodes that ``nodes`` read, directly or through other free nodes, in graph order."""
    needed: set[fx.Node] = set()
    stack = [arg for node in nodes for arg in node.all_input_nodes if arg in graph.free]
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            stack.extend(arg for arg in node.all_input_nodes if arg in graph.free)
    return [n for n in graph.module.graph.nodes if n in needed]


def _slice(graph: OpGraph, inputs: list[fx.Node], ops: list[fx.Node], outputs: list[fx.Node], *,
           contiguous: bool) -> fx.GraphModule:
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in inputs:
        placeholder = new.placeholder(node.name)
        placeholder.meta = dict(node.meta)
        env[node] = new.call_function(dense_gradient, (placeholder,)) if contiguous else placeholder
    for node in _free_closure(graph, ops) + ops:
        env[node] = new.node_copy(node, lambda arg: env[arg])
    results = [env[node] for node in outputs]
    if contiguous:  # p2p sends and receive buffers need dense tensors; a no-op for those already dense
        results = [new.call_method("contiguous", (node,)) for node in results]
    new.output(results[0] if len(results) == 1 else tuple(results))
    return fx.GraphModule(graph.module, new)  # copies references to the parameters it reads, not the data


def build_stage_modules(graph: OpGraph, op_starts: list[int]) -> list[fx.GraphModule]:
    """One module per stage: stage i runs body ops [op_starts[i], op_starts[i+1]).

    Stage i takes the values crossing its first cut (stage 0: the inputs in ``graph.input_names`` order)
    and returns those crossing its last (the last stage: what the loss module reads), one tensor or a tuple,
    made contiguous (they are sent to another rank).

    Args:
        graph: the op graph.
        op_starts: first body op of each stage, ascending, starting at 0.

    Returns:
        The stage modules.
    """
    if not op_starts or op_starts[0] != 0 or any(b <= a for a, b in zip(op_starts, op_starts[1:])) \
            or op_starts[-1] >= graph.num_body_ops:
        raise ValueError(f"op_starts={op_starts}: need ascending body-op indices from 0 below {graph.num_body_ops}")
    bounds = [*op_starts, graph.num_body_ops]
    return [_slice(graph, graph.crossing(first), graph.ops[first:end], graph.crossing(end), contiguous=True)
            for first, end in zip(bounds, bounds[1:])]


def build_loss_module(graph: OpGraph) -> fx.GraphModule:
    """The tail as a module: ``loss = module(*last_stage_outputs, target)``."""
    target = next(n for n in graph.module.graph.nodes if n.op == "placeholder" and n.name == graph.target_name)
    output = next(n for n in graph.module.graph.nodes if n.op == "output")
    result = output.args[0]
    result = result[0] if isinstance(result, (tuple, list)) else result
    return _slice(graph, graph.crossing(graph.num_body_ops) + [target], graph.ops[graph.num_body_ops:], [result],
                  contiguous=False)
