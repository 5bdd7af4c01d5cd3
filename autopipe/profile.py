"""The op profile: measured per-op costs of one micro-batch, saved as JSON, turned into a cost chain.

Plain dataclasses only; :mod:`autopipe.profiler` fills them in, the search reads them through
:meth:`Profile.to_chain`.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from autopipe.cost import CostChain

FORMAT_VERSION = 2
"""2 added the calibration fields of :class:`Profile`; version 1 files load with them at "uncalibrated"."""
READABLE_VERSIONS = (1, 2)


@dataclass(kw_only=True, slots=True)
class OpRecord:
    """One op of the traced graph, measured for one micro-batch."""

    name: str
    """fx node name (unique in the graph)."""
    target: str
    """The ATen op, e.g. "aten.linear.default"."""
    module: str
    """Qualified name of the innermost module that ran it ("" = the root)."""
    layer: int
    """-1 before the first repeated block, 0..L-1 inside one, L after the last."""
    forward_s: float
    """Forward time, calibrated (see :attr:`Profile.forward_scale`)."""
    backward_s: float
    """Backward time, calibrated (0 when no output needs a gradient)."""
    param_bytes: int
    """Bytes of the parameters this op is the first to read."""
    param_numel: int
    """Elements of those parameters."""
    output_bytes: int
    """Bytes of newly allocated outputs (views of an input count 0)."""


@dataclass(kw_only=True, slots=True)
class Profile:
    """Everything the search needs about a model at one micro-batch size on one device."""

    ops: list[OpRecord]
    """Body ops then the loss tail, in execution order."""
    num_body_ops: int
    """Cuts lie before body ops 1..num_body_ops-1; the tail stays with the last stage."""
    boundary_bytes: list[int]
    """Bytes crossing the boundary before op k, k = 0..num_body_ops (0: inputs, num_body_ops: into the loss)."""
    boundary_num_tensors: list[int]
    """Number of tensors crossing each boundary."""
    boundary_cuttable: list[bool]
    """Whether every crossing value is a floating-point tensor (a gradient can flow back)."""
    num_layers: int = 0
    """Repeated blocks found in the module paths (0 = none)."""
    device: str = "cpu"
    """Device the times were measured on."""
    input_shapes: dict[str, list[int]] = field(default_factory=dict)
    """Shapes of the example inputs (one micro-batch)."""
    forward_overhead_s: float = 0.0
    """Harness cost per timed call subtracted from every op's raw forward time (timed on a no-op)."""
    backward_overhead_s: float = 0.0
    """The same for the backward."""
    time_scale: float = 1.0
    """Factor on the net op times so they sum to :attr:`measured_total_s` (1.0: uncalibrated)."""
    raw_forward_total_s: float = 0.0
    """Sum of the ops' forward times as timed one op at a time, before calibration (0: not recorded)."""
    raw_backward_total_s: float = 0.0
    """The same for the backward."""
    measured_total_s: float = 0.0
    """The whole graph's forward + backward timed end to end, the calibration's ground truth (0: not measured)."""
    version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        size = self.num_body_ops + 1
        for name in ("boundary_bytes", "boundary_num_tensors", "boundary_cuttable"):
            if len(getattr(self, name)) != size:
                raise ValueError(f"Profile.{name}: expected {size} entries, got {len(getattr(self, name))}")
        if not 0 < self.num_body_ops <= len(self.ops):
            raise ValueError(f"Profile.num_body_ops={self.num_body_ops}: must be in [1, {len(self.ops)}]")

    @property
    def op_names(self) -> list[str]:
        """Node names, to check that a saved profile belongs to a traced graph."""
        return [op.name for op in self.ops]

    def cut_positions(self, max_cut_tensors: int) -> list[int]:
        """Body ops before which the graph may be cut: cuttable and crossed by at most ``max_cut_tensors``."""
        return [k for k in range(1, self.num_body_ops)
                if self.boundary_cuttable[k] and self.boundary_num_tensors[k] <= max_cut_tensors]

    def unit_op_starts(self, max_cut_tensors: int) -> list[int]:
        """First op of each chain unit: 0 and every cut position."""
        return [0, *self.cut_positions(max_cut_tensors)]

    def to_chain(self, max_cut_tensors: int) -> CostChain:
        """Merge the ops between cut positions into the units of a :class:`CostChain`.

        Args:
            max_cut_tensors: cut only where at most this many tensors cross.

        Returns:
            The chain; the last unit carries the loss tail.
        """
        starts = self.unit_op_starts(max_cut_tensors)
        ends = [*starts[1:], len(self.ops)]  # the last unit runs to the end of the tail

        def total(attr: str, first: int, end: int) -> float:
            return sum(getattr(op, attr) for op in self.ops[first:end])

        layers = [op.layer for op in self.ops]
        has_layers = self.num_layers > 0 and all(b >= a for a, b in zip(layers, layers[1:]))
        return CostChain(
            forward_s=tuple(total("forward_s", a, b) for a, b in zip(starts, ends)),
            backward_s=tuple(total("backward_s", a, b) for a, b in zip(starts, ends)),
            param_bytes=tuple(int(total("param_bytes", a, b)) for a, b in zip(starts, ends)),
            param_numel=tuple(int(total("param_numel", a, b)) for a, b in zip(starts, ends)),
            activation_bytes=tuple(int(total("output_bytes", a, b)) for a, b in zip(starts, ends)),
            boundary_bytes=tuple(self.boundary_bytes[k] for k in starts) + (self.boundary_bytes[-1],),
            unit_layer=tuple(layers[a] for a in starts) if has_layers else (),
            num_layers=self.num_layers if has_layers else 0,
        )

    def top_ops_table(self, count: int = 15) -> str:
        """The ``count`` ops with the largest forward + backward time, as a text table."""
        total_s = sum(op.forward_s + op.backward_s for op in self.ops) or 1.0
        ranked = sorted(self.ops, key=lambda op: op.forward_s + op.backward_s, reverse=True)[:count]
        lines = [f"{'op':<28} {'target':<36} {'module':<24} {'fwd ms':>8} {'bwd ms':>8} {'share':>6} "
                 f"{'params MiB':>10} {'out MiB':>8}"]
        for op in ranked:
            lines.append(f"{op.name[:28]:<28} {op.target[:36]:<36} {op.module[:24]:<24} {op.forward_s * 1e3:>8.3f} "
                         f"{op.backward_s * 1e3:>8.3f} {(op.forward_s + op.backward_s) / total_s:>6.1%} "
                         f"{op.param_bytes / 2**20:>10.2f} {op.output_bytes / 2**20:>8.2f}")
        lines.append(f"{len(self.ops)} ops, forward {sum(op.forward_s for op in self.ops) * 1e3:.3f} ms, backward "
                     f"{sum(op.backward_s for op in self.ops) * 1e3:.3f} ms per micro-batch on {self.device}")
        lines.append(self.calibration_line())
        return "\n".join(lines)

    def calibration_line(self) -> str:
        """How the op times were calibrated, in one line."""
        if not self.measured_total_s:
            return "op times not calibrated to a whole-graph run"
        return (f"calibrated to the whole graph's forward + backward timed end to end, "
                f"{self.measured_total_s * 1e3:.3f} ms: ops timed alone sum to "
                f"{self.raw_forward_total_s * 1e3:.3f} + {self.raw_backward_total_s * 1e3:.3f} ms; harness overhead "
                f"{self.forward_overhead_s * 1e6:.1f} / {self.backward_overhead_s * 1e6:.1f} us per op subtracted; "
                f"scale {self.time_scale:.3f}")

    def to_json(self) -> str:
        """The profile as a JSON document."""
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        """Parse :meth:`to_json`'s output.

        Raises:
            ValueError: not a profile of a readable format version (1 or 2).
        """
        raw = json.loads(text)
        if not isinstance(raw, dict) or raw.get("version") not in READABLE_VERSIONS:
            found = raw.get("version") if isinstance(raw, dict) else type(raw).__name__
            raise ValueError(f"not an autopipe profile of version {READABLE_VERSIONS} (version: {found!r})")
        raw.pop("version")  # an older file's missing fields take their "uncalibrated" defaults
        try:
            ops = [OpRecord(**op) for op in raw.pop("ops")]
            return cls(ops=ops, **raw)
        except (KeyError, TypeError) as err:  # a hand-edited or truncated file
            raise ValueError(f"autopipe profile: missing or unexpected fields ({err}); profile the model again "
                             "with `python -m autopipe profile`") from err

    def save(self, path: str | os.PathLike) -> None:
        """Write the JSON to ``path`` (parent directories are created)."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Profile:
        """Read a profile written by :meth:`save`.

        Raises:
            ValueError: missing file or not a profile (the message names the path).
        """
        source = Path(path)
        if not source.is_file():
            raise ValueError(f"autopipe.profile_path={str(source)!r}: no such file; run `python -m autopipe profile` "
                             "first or leave profile_path unset to profile at start-up")
        try:
            return cls.from_json(source.read_text())
        except (ValueError, TypeError) as err:
            raise ValueError(f"autopipe.profile_path={str(source)!r}: {err}") from None
