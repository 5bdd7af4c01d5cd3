"""MoE layer on one rank: sort-based dispatch + grouped experts against a per-token reference, and
against deepspeed.moe.layer.MoE with the same weights (identical routing)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moe import GroupedExperts, LoopExperts, MoE, MoEConfig, MoELayer, Router, experts_from_module


def per_token_reference(layer: MoELayer, x_TD: torch.Tensor) -> torch.Tensor:
    """Sum over each token's kept routes of weight * expert(token), one token at a time."""
    routing = layer.router(x_TD)
    experts = layer.experts
    out = torch.zeros_like(x_TD, dtype=torch.float32)
    for t in range(x_TD.shape[0]):
        for i in range(routing.expert_TK.shape[1]):
            if routing.kept_TK[t, i]:
                e = int(routing.expert_TK[t, i])
                y = experts(x_TD[t:t + 1], [0] * e + [1] + [0] * (experts.num_local_experts - e - 1))
                out[t] += routing.weight_TK[t, i] * y[0].float()
    return out.to(x_TD.dtype)


@pytest.mark.parametrize("activation,bias,top_k", [("gelu_tanh", True, 2), ("swiglu", False, 1), ("relu", False, 3)])
def test_layer_equals_per_token_reference(activation, bias, top_k):
    cfg = MoEConfig(num_experts=4, top_k=top_k, capacity_factor=1.0, min_capacity=1, use_rts=False)
    layer = MoELayer(16, GroupedExperts(4, 16, 24, activation=activation, bias=bias, impl="loop"), cfg)
    x = torch.randn(2, 20, 16)
    out = layer(x)
    assert out.output.shape == x.shape
    torch.testing.assert_close(out.output.reshape(-1, 16), per_token_reference(layer, x.reshape(-1, 16)))


def test_grouped_mm_matches_the_per_expert_loop_in_bf16():
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm needs torch >= 2.8")
    grouped = GroupedExperts(4, 32, 64, activation="swiglu", bias=True, impl="grouped").to(torch.bfloat16)
    loop = GroupedExperts(4, 32, 64, activation="swiglu", bias=True, impl="loop").to(torch.bfloat16)
    loop.load_state_dict(grouped.state_dict())
    rows = [5, 0, 17, 9]  # one expert without rows
    x1 = torch.randn(sum(rows), 32, dtype=torch.bfloat16, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    y1, y2 = grouped(x1, rows), loop(x2, rows)
    torch.testing.assert_close(y1, y2)
    y1.float().square().sum().backward()
    y2.float().square().sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad)
    for name, p in grouped.named_parameters():
        torch.testing.assert_close(p.grad, dict(loop.named_parameters())[name].grad, rtol=2e-2, atol=2e-2)


def test_any_expert_module_runs_as_a_loop_and_a_sequential_as_grouped():
    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return torch.tanh(self.lin(x)), None

    assert isinstance(experts_from_module(Custom(), 2), LoopExperts)
    seq = nn.Sequential(nn.Linear(8, 12), nn.SiLU(), nn.Linear(12, 8))
    grouped = experts_from_module(seq, 3)
    assert isinstance(grouped, GroupedExperts) and grouped.activation == "silu"
    x = torch.randn(7, 8)
    torch.testing.assert_close(grouped(x, [2, 0, 5]), seq(x))
    layer = MoELayer(8, experts_from_module(Custom(), 4), MoEConfig(num_experts=4, top_k=2, drop_tokens=False))
    x = torch.randn(10, 8)
    torch.testing.assert_close(layer(x).output, per_token_reference(layer, x))


def _deepspeed_pair(k, capacity_factor, drop_tokens, hidden=32, ffn=48, experts=8):
    ds_layer = pytest.importorskip("deepspeed.moe.layer")
    expert = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))
    kwargs = dict(num_experts=experts, k=k, capacity_factor=capacity_factor, eval_capacity_factor=capacity_factor,
                  min_capacity=4, drop_tokens=drop_tokens, use_rts=False, top2_2nd_expert_sampling=False)
    theirs, ours = ds_layer.MoE(hidden, expert, **kwargs), MoE(hidden, expert, **kwargs)
    with torch.no_grad():
        ours.deepspeed_moe.router.wg.weight.copy_(theirs.deepspeed_moe.gate.wg.weight)
        grouped = ours.deepspeed_moe.experts
        for e, ex in enumerate(theirs.deepspeed_moe.experts.deepspeed_experts):
            for module in (ex[0], ex[2]):
                nn.init.normal_(module.weight, std=0.2)
                nn.init.normal_(module.bias, std=0.1)
            grouped.w_in_LDF[e].copy_(ex[0].weight.t())
            grouped.b_in_LF[e].copy_(ex[0].bias)
            grouped.w_out_LFD[e].copy_(ex[2].weight.t())
            grouped.b_out_LD[e].copy_(ex[2].bias)
    return theirs, ours


@pytest.mark.parametrize("k,capacity_factor,drop_tokens", [(2, 1.0, True), (4, 1.0, True), (2, 1.0, False)])
def test_same_outputs_loss_counts_and_gradients_as_deepspeed(k, capacity_factor, drop_tokens):
    theirs, ours = _deepspeed_pair(k, capacity_factor, drop_tokens)
    x1 = torch.randn(4, 48, 32, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    out1, aux1, counts1 = theirs(x1)
    out2, aux2, counts2 = ours(x2)
    torch.testing.assert_close(out2, out1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(aux2, aux1)
    assert torch.equal(counts2, counts1.long())
    (out1.square().sum() + aux1).backward()
    (out2.square().sum() + aux2).backward()
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours.deepspeed_moe.router.wg.weight.grad, theirs.deepspeed_moe.gate.wg.weight.grad,
                               rtol=1e-4, atol=1e-4)
    for e, ex in enumerate(theirs.deepspeed_moe.experts.deepspeed_experts):
        torch.testing.assert_close(ours.deepspeed_moe.experts.w_in_LDF.grad[e], ex[0].weight.grad.t(),
                                   rtol=1e-4, atol=1e-4)


def test_z_loss_enters_l_aux_with_its_coefficient_and_residual_mixes_a_dense_branch():
    expert = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    plain = MoE(16, expert, num_experts=4, k=2, drop_tokens=False)
    with_z = MoE(16, expert, num_experts=4, k=2, drop_tokens=False, z_loss_coef=0.1, use_residual=True)
    with_z.deepspeed_moe.load_state_dict(plain.deepspeed_moe.state_dict())
    x = torch.randn(30, 16)
    out_plain, aux_plain, _ = plain(x)
    out_z, aux_z, _ = with_z(x)
    routing = plain.deepspeed_moe.router(x)
    torch.testing.assert_close(aux_z, aux_plain + 0.1 * routing.z_loss)
    coef = F.softmax(with_z.coefficient(x), -1)
    torch.testing.assert_close(out_z, out_plain * coef[:, :1] + expert(x) * coef[:, 1:])


def test_ep_size_without_groups_is_refused_at_forward():
    layer = MoELayer(8, GroupedExperts(2, 8, 8), MoEConfig(num_experts=4, ep_size=2))
    with pytest.raises(RuntimeError, match="expert-parallel groups"):
        layer(torch.randn(4, 8))
    with pytest.raises(ValueError, match="moe.num_experts"):
        MoELayer(8, GroupedExperts(3, 8, 8), MoEConfig(num_experts=4, ep_size=2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("policy,drop_tokens", [("position", True), ("random", True), ("probs", False)])
def test_routing_and_sort_do_not_sync_the_device(policy, drop_tokens):
    """The layer's one host sync is the count copy; routing and the sort must not add others."""
    from moe.dispatch import sort_routes

    cfg = MoEConfig(num_experts=8, top_k=2, drop_policy=policy, drop_tokens=drop_tokens, min_capacity=1)
    router = Router(32, cfg).cuda()
    x = torch.randn(64, 32, device="cuda")
    used = (torch.rand(64, device="cuda") > 0.2).float()
    router(x, used)  # warm-up: first calls may load kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        routing = router(x, used)
        sorted_routes = sort_routes(routing, cfg.num_experts, num_chunks=3)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert int(sorted_routes.rows_CE.sum()) == int(routing.kept_TK.sum())
    assert int(routing.counts_E.sum()) == 2 * int(used.sum())


def test_grouped_mm_needs_aligned_widths_on_every_weight():
    from moe.experts import grouped_mm_supported

    x = torch.zeros(4, 16, dtype=torch.float32)
    w_in, w_out = torch.zeros(2, 16, 24), torch.zeros(2, 12, 16)  # swiglu: 24 wide in, 12 wide out
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    assert grouped_mm_supported(x, w_in, torch.zeros(2, 24, 16))
    assert not grouped_mm_supported(x, w_in, torch.zeros(2, 13, 16)), "a 13-wide fp32 row is 52 bytes, not 16-aligned"
    assert not grouped_mm_supported(x, w_in, w_out.to(torch.float64)), "mixed dtypes"
