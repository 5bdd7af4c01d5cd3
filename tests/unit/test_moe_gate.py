"""Routing math of moe.gate against hand computations (python loops) on fresh random logits."""

from __future__ import annotations

import math

import pytest
import torch

from moe import MoEConfig, Router, route


def loop_route(logits, top_k, capacity, policy, priority=None):
    """Reference: queues per expert built token by token, GShard / DeepSpeed semantics."""
    probs = torch.softmax(logits.double(), -1).tolist()
    num_tokens, num_experts = logits.shape
    chosen = [sorted(range(num_experts), key=lambda e: -probs[t][e])[:top_k] for t in range(num_tokens)]
    routes = [(t, i) for i in range(top_k) for t in range(num_tokens)]  # k-major: GShard's priority
    if policy == "probs":
        routes.sort(key=lambda r: -probs[r[0]][chosen[r[0]][r[1]]])
    elif policy == "random":
        routes.sort(key=lambda r: -priority[r[0]][r[1]])
    kept, taken = set(), [0] * num_experts
    for t, i in routes:
        e = chosen[t][i]
        if capacity is None or taken[e] < capacity:
            kept.add((t, i))
            taken[e] += 1
    weights = []
    for t in range(num_tokens):
        w = [probs[t][chosen[t][i]] if (t, i) in kept else 0.0 for i in range(top_k)]
        if top_k > 1:
            w = [v / max(sum(w), torch.finfo(torch.float32).eps) for v in w]
        weights.append(w)
    return chosen, kept, weights


@pytest.mark.parametrize("top_k,policy", [(1, "position"), (2, "position"), (3, "probs"), (1, "random"), (2, "random")])
def test_route_matches_per_token_queues(top_k, policy):
    num_tokens, num_experts, capacity = 40, 6, 7  # 40 * k routes over 6 experts of 7 slots: drops happen
    logits = torch.randn(num_tokens, num_experts) * 2
    priority = torch.rand(num_tokens, top_k)
    r = route(logits, top_k=top_k, capacity=capacity, drop_policy=policy, priority_TK=priority)
    chosen, kept, weights = loop_route(logits, top_k, capacity, policy, priority.tolist())
    assert r.expert_TK.tolist() == chosen
    assert {(t, i) for t in range(num_tokens) for i in range(top_k) if r.kept_TK[t, i]} == kept
    assert len(kept) < num_tokens * top_k  # the capacity limit was exercised
    torch.testing.assert_close(r.weight_TK, torch.tensor(weights, dtype=torch.float32))
    expected_counts = torch.bincount(torch.tensor(chosen).flatten(), minlength=num_experts)
    assert torch.equal(r.counts_E, expected_counts)


def test_balance_and_z_loss_by_hand():
    for top_k in (1, 2, 3):
        logits = torch.randn(12, 4)
        r = route(logits, top_k=top_k, capacity=None)
        probs = torch.softmax(logits, -1).tolist()
        chosen = [sorted(range(4), key=lambda e: -probs[t][e])[:top_k] for t in range(12)]
        counted = [c[:1] for c in chosen] if top_k <= 2 else chosen  # GShard: first choice; k > 2: all / k
        share = [sum(c.count(e) for c in counted) / (12 * len(counted[0])) for e in range(4)]
        mean_prob = [sum(probs[t][e] for t in range(12)) / 12 for e in range(4)]
        expected = 4 * sum(s * p for s, p in zip(share, mean_prob))
        assert r.balance_loss.item() == pytest.approx(expected, rel=1e-5)
        z = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / 12
        assert r.z_loss.item() == pytest.approx(z, rel=1e-5)


def test_balance_loss_is_one_for_uniform_routing_and_grows_with_imbalance():
    uniform = route(torch.eye(4).repeat(8, 1) * 5, top_k=1, capacity=None)
    skewed_logits = torch.eye(4).repeat(8, 1) * 5
    skewed_logits[:, 0] += 10
    skewed = route(skewed_logits, top_k=1, capacity=None)
    assert uniform.balance_loss.item() == pytest.approx(1.0, rel=1e-3)
    assert skewed.balance_loss.item() > 3.5


def test_dropless_keeps_every_route_and_weights_sum_to_one():
    r = route(torch.randn(50, 5), top_k=2, capacity=None)
    assert bool(r.kept_TK.all()) and r.capacity is None
    torch.testing.assert_close(r.weight_TK.sum(-1), torch.ones(50))


def test_unchosen_expert_gets_zero_count_and_unused_tokens_are_not_routed():
    logits = torch.randn(30, 4)
    logits[:, 2] = -30.0  # never in the top 2 of 4
    used = (torch.rand(30) > 0.3).float()
    r = route(logits, top_k=2, capacity=100, used_T=used)
    assert r.counts_E[2].item() == 0
    assert int(r.counts_E.sum()) == 2 * int(used.sum())
    assert not r.kept_TK[used == 0].any() and r.kept_TK[used == 1].all()


def test_capacity_train_eval_and_minimum():
    cfg = MoEConfig(num_experts=8, top_k=2, capacity_factor=1.25, eval_capacity_factor=2.0, min_capacity=4)
    assert cfg.capacity(64, training=True) == 20  # ceil(1.25 * 64 * 2 / 8)
    assert cfg.capacity(64, training=False) == 32
    assert cfg.capacity(4, training=True) == 4  # ceil(1.25) = 2, raised to min_capacity
    router = Router(16, cfg)
    assert router.capacity(64) == 20
    assert router.eval().capacity(64) == 32
    assert Router(16, MoEConfig(num_experts=8, drop_tokens=False)).capacity(64) is None


def test_router_noise_only_in_training():
    torch.manual_seed(0)
    x = torch.randn(64, 16)
    for policy in ("Jitter", "RSample"):
        router = Router(16, MoEConfig(num_experts=8, top_k=1, noisy_gate_policy=policy, drop_tokens=False))
        clean = route(torch.nn.functional.linear(x, router.wg.weight), top_k=1, capacity=None)
        assert torch.equal(router.eval()(x).expert_TK, clean.expert_TK)
        noisy = router.train()(x)
        assert not torch.equal(noisy.expert_TK, clean.expert_TK) or not torch.equal(noisy.weight_TK, clean.weight_TK)


def test_second_expert_sampling_keeps_the_first_choice():
    torch.manual_seed(1)
    router = Router(16, MoEConfig(num_experts=8, top_k=2, drop_tokens=False), second_expert_sampling=True)
    x = torch.randn(200, 16)
    clean = router.eval()(x)
    sampled = router.train()(x)
    assert torch.equal(sampled.expert_TK[:, 0], clean.expert_TK[:, 0])
    assert not torch.equal(sampled.expert_TK[:, 1], clean.expert_TK[:, 1])


@pytest.mark.parametrize("field,value", [("drop_policy", "lifo"), ("overlap_chunks", 0), ("top_k", 9),
                                         ("ep_size", 3), ("inter_node_bandwidth_gbs", 0.0), ("ffn_hidden_size", 0)])
def test_config_errors_name_the_key(field, value):
    with pytest.raises(ValueError, match=f"moe.{field}"):
        MoEConfig(num_experts=8, **{field: value})


def test_default_drop_policy_follows_deepspeed():
    assert MoEConfig(top_k=1).resolved_drop_policy == "random"
    assert MoEConfig(top_k=1, use_rts=False).resolved_drop_policy == "position"
    assert MoEConfig(top_k=2).resolved_drop_policy == "position"
    assert MoEConfig(top_k=4).resolved_drop_policy == "probs"
