"""Batched expert FFNs: every local expert's weights in one tensor, computed with a grouped matmul.

Shape legend: N = rows (tokens) sent to this rank's experts, grouped by expert; D = model dim;
F = expert inner width; L = local experts (on this rank).

``torch._grouped_mm`` (torch >= 2.8; CUTLASS grouped GEMM on sm90, a reference kernel on CPU)
multiplies each group of rows by its own expert's matrix in one launch, with the group boundaries
as a device tensor, so nothing waits for the host. Where it is missing or the dtype/alignment is
not supported, the rows are split per expert and each expert runs its own matmul (the loop that
``deepspeed.moe.experts.Experts`` always runs).

Any other expert module is supported through :class:`LoopExperts` (deep copies, one call each).
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu", "swiglu")
IMPLS = ("auto", "grouped", "loop")


def grouped_mm_supported(x_ND: Tensor, *weights_LIO: Tensor) -> bool:
    """Whether ``torch._grouped_mm`` can multiply ``x_ND`` and each [L, in, out] weight in turn here.

    It needs bf16 on CUDA (sm90+), and 16-byte aligned rows: every in and out width a multiple of 8
    in bf16 (with swiglu the second weight's input is half the first one's output).
    """
    if not hasattr(torch, "_grouped_mm") or any(w.dtype != x_ND.dtype for w in weights_LIO):
        return False
    if x_ND.dtype != torch.bfloat16 and x_ND.is_cuda:
        return False
    if x_ND.is_cuda and torch.cuda.get_device_capability(x_ND.device) < (9, 0):
        return False
    row_bytes = x_ND.element_size()
    return all(dim * row_bytes % 16 == 0 for w in weights_LIO for dim in w.shape[1:])


def host_to_device(values: list[int], device: torch.device) -> Tensor:
    """int64 tensor of host integers on ``device`` without blocking the host (pinned, non_blocking).

    A plain ``torch.tensor(values, device="cuda")`` copies from pageable memory and waits for the
    stream, which would stall the launch queue once per expert call.
    """
    host = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _activate(h_NF: Tensor, activation: str) -> Tensor:
    if activation == "swiglu":  # Shazeer 2020: silu(gate) * up, gate and up side by side
        gate_NF, up_NF = h_NF.chunk(2, dim=-1)
        return F.silu(gate_NF) * up_NF
    if activation == "gelu_tanh":
        return F.gelu(h_NF, approximate="tanh")
    return {"gelu": F.gelu, "relu": F.relu, "silu": F.silu}[activation](h_NF)


class GroupedExperts(nn.Module):
    """``num_local_experts`` FFN experts: x -> act(x W_in + b_in) W_out + b_out per expert.

    Args:
        num_local_experts: L, experts held by this rank.
        hidden_size: D.
        ffn_hidden_size: F.
        activation: one of ACTIVATIONS; "swiglu" doubles W_in's width to [gate | up].
        bias: whether the two projections carry biases.
        impl: "grouped" (``torch._grouped_mm``, falls back when unsupported), "loop", or "auto"
            (grouped on CUDA, loop on CPU).
    """

    def __init__(self, num_local_experts: int, hidden_size: int, ffn_hidden_size: int, *,
                 activation: str = "gelu", bias: bool = False, impl: str = "auto") -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation: must be one of {ACTIVATIONS}, got {activation!r}")
        if impl not in IMPLS:
            raise ValueError(f"impl: must be one of {IMPLS}, got {impl!r}")
        width = ffn_hidden_size * (2 if activation == "swiglu" else 1)
        self.activation, self.impl = activation, impl
        self.w_in_LDF = nn.Parameter(torch.empty(num_local_experts, hidden_size, width))
        self.w_out_LFD = nn.Parameter(torch.empty(num_local_experts, ffn_hidden_size, hidden_size))
        self.b_in_LF = nn.Parameter(torch.zeros(num_local_experts, width)) if bias else None
        self.b_out_LD = nn.Parameter(torch.zeros(num_local_experts, hidden_size)) if bias else None
        self.reset_parameters()

    @property
    def num_local_experts(self) -> int:
        return self.w_in_LDF.shape[0]

    @torch.no_grad()
    def reset_parameters(self, std: float | None = None, out_std: float | None = None) -> None:
        """Normal init; None = nn.Linear's fan-in scale. ``out_std`` for W_out (e.g. GPT-2's scaled residual)."""
        d, f = self.w_in_LDF.shape[1], self.w_out_LFD.shape[1]
        nn.init.normal_(self.w_in_LDF, 0.0, std if std is not None else 1 / math.sqrt(d))
        nn.init.normal_(self.w_out_LFD, 0.0, out_std if out_std is not None else 1 / math.sqrt(f))
        for bias in (self.b_in_LF, self.b_out_LD):
            if bias is not None:
                bias.zero_()

    def forward(self, x_ND: Tensor, rows_L: list[int]) -> Tensor:
        """Run each expert on its rows.

        Args:
            x_ND: rows grouped by local expert, in expert order.
            rows_L: rows of each local expert (host integers; sum = N).

        Returns:
            [N, D] expert outputs in the same row order.
        """
        # "auto" leaves CPU to the loop: torch's CPU grouped_mm is a slow reference kernel.
        grouped = self.impl == "grouped" or (self.impl == "auto" and x_ND.is_cuda)
        if grouped and grouped_mm_supported(x_ND, self.w_in_LDF, self.w_out_LFD):
            rows_dev_L = host_to_device(rows_L, x_ND.device)
            offsets_L = torch.cumsum(rows_dev_L, 0).to(torch.int32)
            h_NF = self._bias(torch._grouped_mm(x_ND, self.w_in_LDF, offs=offsets_L), self.b_in_LF, rows_dev_L)
            h_NF = _activate(h_NF, self.activation)
            return self._bias(torch._grouped_mm(h_NF, self.w_out_LFD, offs=offsets_L), self.b_out_LD, rows_dev_L)
        # unbind, not w[e]: each w[e]'s backward would fill a zero tensor of the whole [L, D, F] weight.
        w_in, w_out = self.w_in_LDF.unbind(0), self.w_out_LFD.unbind(0)
        b_in = self.b_in_LF.unbind(0) if self.b_in_LF is not None else [None] * len(rows_L)
        b_out = self.b_out_LD.unbind(0) if self.b_out_LD is not None else [None] * len(rows_L)
        outputs = []
        for e, x_nD in enumerate(x_ND.split(rows_L)):
            h_nF = x_nD @ w_in[e] if b_in[e] is None else torch.addmm(b_in[e], x_nD, w_in[e])
            h_nF = _activate(h_nF, self.activation)
            outputs.append(h_nF @ w_out[e] if b_out[e] is None else torch.addmm(b_out[e], h_nF, w_out[e]))
        return torch.cat(outputs) if outputs else x_ND.new_empty(0, self.w_out_LFD.shape[-1])

    @staticmethod
    def _bias(h_NF: Tensor, bias_LF: Tensor | None, rows_dev_L: Tensor) -> Tensor:
        if bias_LF is None:
            return h_NF
        expert_N = torch.repeat_interleave(torch.arange(len(rows_dev_L), device=h_NF.device), rows_dev_L,
                                           output_size=h_NF.shape[0])
        return h_NF + bias_LF.index_select(0, expert_N)


class LoopExperts(nn.Module):
    """Deep copies of an arbitrary expert module, each run on its rows (any nn.Module works).

    Args:
        expert: the module to copy; a tuple output keeps its first element (as DeepSpeed does).
        num_local_experts: L.
    """

    def __init__(self, expert: nn.Module, num_local_experts: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList(copy.deepcopy(expert) for _ in range(num_local_experts))

    @property
    def num_local_experts(self) -> int:
        return len(self.experts)

    def forward(self, x_ND: Tensor, rows_L: list[int]) -> Tensor:
        """Same contract as :meth:`GroupedExperts.forward`."""
        outputs = []
        for expert, x_nD in zip(self.experts, x_ND.split(rows_L)):
            y_nD = expert(x_nD)
            outputs.append(y_nD[0] if isinstance(y_nD, tuple) else y_nD)
        return torch.cat(outputs)


def _activation_of(module: nn.Module) -> str | None:
    if isinstance(module, nn.GELU):
        return "gelu_tanh" if module.approximate == "tanh" else "gelu"
    if isinstance(module, nn.ReLU):
        return "relu"
    if isinstance(module, nn.SiLU):
        return "silu"
    return None


def experts_from_module(expert: nn.Module, num_local_experts: int, impl: str = "auto") -> nn.Module:
    """Local experts built from a DeepSpeed-style expert module.

    ``nn.Sequential(nn.Linear(D, F), <GELU|ReLU|SiLU>, nn.Linear(F, D))`` becomes a
    :class:`GroupedExperts` whose experts all start as copies of ``expert`` (as DeepSpeed's deep
    copies do); anything else becomes :class:`LoopExperts`.

    Args:
        expert: the expert module.
        num_local_experts: experts on this rank.
        impl: passed to :class:`GroupedExperts`.

    Returns:
        The experts module (its forward takes rows grouped by expert and the row counts).
    """
    parts = list(expert.children()) if isinstance(expert, nn.Sequential) else []
    if len(parts) != 3 or not isinstance(parts[0], nn.Linear) or not isinstance(parts[2], nn.Linear):
        return LoopExperts(expert, num_local_experts)
    fc_in, act, fc_out = parts
    activation = _activation_of(act)
    has_bias = fc_in.bias is not None
    if activation is None or has_bias != (fc_out.bias is not None):
        return LoopExperts(expert, num_local_experts)
    grouped = GroupedExperts(num_local_experts, fc_in.in_features, fc_in.out_features, activation=activation,
                             bias=has_bias, impl=impl).to(device=fc_in.weight.device, dtype=fc_in.weight.dtype)
    with torch.no_grad():
        grouped.w_in_LDF.copy_(fc_in.weight.t().expand_as(grouped.w_in_LDF))
        grouped.w_out_LFD.copy_(fc_out.weight.t().expand_as(grouped.w_out_LFD))
        if has_bias:
            grouped.b_in_LF.copy_(fc_in.bias.expand_as(grouped.b_in_LF))
            grouped.b_out_LD.copy_(fc_out.bias.expand_as(grouped.b_out_LD))
    return grouped
