"""Unit tests of angelptm.pretraining.models: the reference GPT (GPT-2 and Llama flavours)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from angelptm.pretraining.models import GPT, ModelConfig, apply_rotary, build_model, rotary_tables

FLAVOURS = ["gpt2", "llama"]


def tiny(flavour: str, **overrides) -> ModelConfig:
    """A small config that runs in milliseconds."""
    kwargs = dict(flavour=flavour, vocab_size=97, max_seq_len=16, num_layers=2, hidden_size=32, num_heads=4)
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


def make_model(config: ModelConfig, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return build_model(config)


def random_ids(config: ModelConfig, batch: int = 3, seq: int | None = None, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (batch, seq or config.max_seq_len), generator=gen)


def hand_count(c: ModelConfig) -> int:
    """Parameter count from the architecture, independent of the module tree."""
    H, Fw, D = c.hidden_size, c.ffn_hidden_size, c.head_dim
    bias = int(c.bias)
    norm = H * (2 if c.norm == "layernorm" and c.bias else 1)
    attn = H * (c.num_heads + 2 * c.num_kv_heads) * D + bias * (c.num_heads + 2 * c.num_kv_heads) * D
    attn += c.num_heads * D * H + bias * H
    n_in = 2 * Fw if c.mlp == "swiglu" else Fw
    mlp = H * n_in + bias * n_in + Fw * H + bias * H
    total = c.vocab_size * H + c.num_layers * (2 * norm + attn + mlp) + norm
    total += c.max_seq_len * H if c.position == "learned" else 0
    total += 0 if c.tie_embeddings else c.vocab_size * H
    return total


# ----------------------------------------------------------------------------- config


def test_flavour_defaults_and_derived_sizes():
    g = ModelConfig(flavour="gpt2")
    assert (g.position, g.norm, g.mlp, g.bias) == ("learned", "layernorm", "gelu", True)
    assert g.ffn_hidden_size == 4 * g.hidden_size and g.num_kv_heads == g.num_heads
    llama = ModelConfig(flavour="llama")
    assert (llama.position, llama.norm, llama.mlp, llama.bias) == ("rotary", "rmsnorm", "swiglu", False)
    assert llama.ffn_hidden_size == 384  # round(8/3 * 128) = 341 -> next multiple of 64
    assert ModelConfig(flavour="llama", hidden_size=4096, num_heads=32).ffn_hidden_size == 10944  # 10923 -> 171*64
    mixed = ModelConfig(flavour="llama", position="learned", bias=True, ffn_hidden_size=100)
    assert (mixed.position, mixed.norm, mixed.bias, mixed.ffn_hidden_size) == ("learned", "rmsnorm", True, 100)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(flavour="bert"), "flavour"),
        (dict(position="alibi"), "position"),
        (dict(norm="batchnorm"), "norm"),
        (dict(mlp="relu"), "mlp"),
        (dict(bias="yes"), "bias"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(num_layers=-1), "num_layers"),
        (dict(hidden_size=130, num_heads=4), "hidden_size"),
        (dict(num_kv_heads=3), "num_kv_heads"),
        (dict(ffn_hidden_size=0), "ffn_hidden_size"),
        (dict(dropout=1.0), "dropout"),
        (dict(init_std=0.0), "init_std"),
        (dict(flavour="llama", hidden_size=12, num_heads=4), "rotary"),
    ],
)
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig(**kwargs)


# ----------------------------------------------------------------------------- forward


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_forward_shapes_and_loss(flavour):
    c = tiny(flavour)
    model = make_model(c)
    ids = random_ids(c, batch=3, seq=10)
    logits = model(ids)
    assert logits.shape == (3, 10, c.vocab_size) and logits.dtype == torch.float32
    labels = random_ids(c, batch=3, seq=10, seed=2)
    labels[0, :4] = -100
    loss = model(ids, labels)
    assert loss.dim() == 0
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-6)
    unmasked = F.cross_entropy(logits.flatten(0, 1), random_ids(c, 3, 10, seed=2).flatten())
    assert abs(loss.item() - unmasked.item()) > 1e-6  # the -100 positions really were ignored


def test_sequence_longer_than_max_seq_len_raises():
    c = tiny("llama")
    with pytest.raises(ValueError, match="max_seq_len"):
        make_model(c)(random_ids(c, seq=c.max_seq_len + 1))


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_causal_mask(flavour):
    c = tiny(flavour)
    model = make_model(c).eval()
    ids = random_ids(c, seed=3)
    t = 9
    changed = ids.clone()
    changed[:, t] = (ids[:, t] + 1) % c.vocab_size
    with torch.no_grad():
        a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-6)
    assert (a[:, t:] - b[:, t:]).abs().amax(dim=-1).min() > 1e-4  # every later position sees the change


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_activation_checkpointing_gives_same_gradients(flavour, dropout):
    plain = make_model(tiny(flavour, dropout=dropout))
    ckpt = make_model(tiny(flavour, dropout=dropout, activation_checkpointing=True), seed=123)
    ckpt.load_state_dict(plain.state_dict())
    ids, labels = random_ids(plain.config, seed=4), random_ids(plain.config, seed=5)
    calls = {id(plain): 0, id(ckpt): 0}
    for model in (plain, ckpt):
        for block in model.blocks:
            block.register_forward_pre_hook(lambda *_, m=id(model): calls.__setitem__(m, calls[m] + 1))
        torch.manual_seed(7)  # same dropout masks; checkpoint replays the RNG state
        model(ids, labels).backward()
    assert calls[id(plain)] == 2 and calls[id(ckpt)] == 4  # blocks really were recomputed
    grads = dict(ckpt.named_parameters())
    for name, p in plain.named_parameters():
        assert p.grad is not None and p.grad.abs().max() > 0, name
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)


# ----------------------------------------------------------------------------- structure


@pytest.mark.parametrize(
    "config",
    [tiny("gpt2"), tiny("llama"), tiny("gpt2", tie_embeddings=False), tiny("llama", num_kv_heads=2, bias=True),
     tiny("llama", norm="layernorm", bias=False)],
    ids=["gpt2", "llama", "gpt2-untied", "llama-gqa-bias", "llama-layernorm-nobias"],
)
def test_num_params_matches_hand_count(config):
    model = make_model(config)
    assert model.num_params() == hand_count(config)
    embeddings = config.vocab_size * config.hidden_size
    embeddings += config.max_seq_len * config.hidden_size if config.position == "learned" else 0
    assert model.num_params(exclude_embeddings=True) == hand_count(config) - embeddings
    S = 64
    expected = 6 * hand_count(config) + 12 * config.num_layers * config.hidden_size * S
    assert model.flops_per_token(S) == pytest.approx(expected)


def test_tied_embeddings_share_storage():
    tied, untied = make_model(tiny("gpt2")), make_model(tiny("gpt2", tie_embeddings=False))
    assert tied.lm_head.weight is tied.tok_emb.weight
    assert untied.lm_head.weight is not untied.tok_emb.weight
    assert untied.num_params() - tied.num_params() == 97 * 32


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_param_groups(flavour):
    model = make_model(tiny(flavour))
    decay, no_decay = model.param_groups(0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    grouped = [id(p) for p in decay["params"] + no_decay["params"]]
    assert len(grouped) == len(set(grouped))  # the tied weight appears once
    assert set(grouped) == {id(p) for p in model.parameters()}
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=1e-2)
    ids = random_ids(model.config)
    model(ids, ids).backward()
    opt.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_init_statistics():
    c = ModelConfig(flavour="gpt2", num_layers=8, hidden_size=256, num_heads=4)
    model = make_model(c)
    block = model.blocks[0]
    assert block.attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert block.mlp.proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)  # 1/sqrt(2*8)
    assert block.attn.proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert torch.equal(block.norm1.weight, torch.ones(256)) and torch.equal(block.attn.qkv.bias, torch.zeros(768))


def test_gqa_equals_mha_with_repeated_kv_heads():
    gqa = make_model(tiny("llama", num_heads=4, num_kv_heads=2))
    mha = make_model(tiny("llama", num_heads=4, num_kv_heads=4), seed=9)
    assert gqa.blocks[0].attn.qkv.weight.shape == ((4 + 2 * 2) * 8, 32)
    state = gqa.state_dict()
    for i in range(gqa.config.num_layers):
        key = f"blocks.{i}.attn.qkv.weight"
        q, k, v = state[key].split((32, 16, 16))
        k, v = (t.view(2, 8, 32).repeat_interleave(2, dim=0).reshape(32, 32) for t in (k, v))
        state[key] = torch.cat((q, k, v))
    mha.load_state_dict(state)
    ids = random_ids(gqa.config, seed=6)
    with torch.no_grad():
        torch.testing.assert_close(gqa(ids), mha(ids), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- positions


def test_rotary_scores_depend_only_on_relative_position():
    D = 16
    cos, sin = rotary_tables(32, D, 10000.0)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 1, D, generator=gen).expand(1, 1, 32, D)
    k = torch.randn(1, 1, 1, D, generator=gen).expand(1, 1, 32, D)
    scores = apply_rotary(q, cos, sin)[0, 0] @ apply_rotary(k, cos, sin)[0, 0].T  # [32, 32], [m, n]
    torch.testing.assert_close(scores[5, 2], scores[30, 27], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scores.diagonal(), (q[0, 0, 0] @ k[0, 0, 0]).expand(32), rtol=1e-5, atol=1e-5)
    assert scores[31].std() > 0.1 * scores[31].abs().mean()  # but they do depend on it


def test_rotary_and_learned_positions_differ_after_position_zero():
    rotary = make_model(tiny("llama", position="rotary", init_std=0.3))  # large weights: sharp attention
    learned = make_model(tiny("llama", position="learned"), seed=5)
    state = dict(rotary.state_dict(), **{"pos_emb.weight": torch.zeros(16, 32)})
    learned.load_state_dict(state)  # same weights; learned positions zeroed = no position signal
    ids = random_ids(rotary.config, seed=8)
    with torch.no_grad():
        a, b = rotary(ids), learned(ids)
    torch.testing.assert_close(a[:, 0], b[:, 0], rtol=1e-5, atol=1e-5)  # RoPE at position 0 is the identity
    assert (a[:, 1:] - b[:, 1:]).abs().amax(dim=-1).min() > 1e-4


def test_rope_tables_stay_fp32_and_out_of_state_dict():
    model = make_model(tiny("llama")).to(torch.bfloat16)
    assert model.rope_cos.dtype == torch.float32 and model.tok_emb.weight.dtype == torch.bfloat16
    assert not any(k.startswith("rope") for k in model.state_dict())
    ids = random_ids(model.config)
    loss_bf16 = model(ids, ids)
    loss_fp32 = make_model(tiny("llama"))(ids, ids)
    assert loss_bf16.dtype == torch.float32
    assert loss_bf16.item() == pytest.approx(loss_fp32.item(), abs=0.05)


# ----------------------------------------------------------------------------- Hugging Face parity


@torch.no_grad()
def _randomise(module: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(11)
    for p in module.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if p.dim() == 1 and p.shape[0] == 64 else 0.0))


def test_gpt2_flavour_matches_transformers():
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.GPT2Config(
        vocab_size=100, n_positions=32, n_embd=64, n_layer=2, n_head=4, activation_function="gelu_new",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5, attn_implementation="eager",
    )
    hf = transformers.GPT2LMHeadModel(hf_config).eval()
    _randomise(hf)  # non-trivial biases and norm weights
    config = ModelConfig(flavour="gpt2", vocab_size=100, max_seq_len=32, num_layers=2, hidden_size=64, num_heads=4)
    ours = GPT(config).eval()
    sd = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items()}
    mapped = {"tok_emb.weight": sd["wte.weight"], "pos_emb.weight": sd["wpe.weight"],
              "lm_head.weight": sd["wte.weight"], "norm_f.weight": sd["ln_f.weight"], "norm_f.bias": sd["ln_f.bias"]}
    names = [("norm1", "ln_1", False), ("norm2", "ln_2", False), ("attn.qkv", "attn.c_attn", True),
             ("attn.proj", "attn.c_proj", True), ("mlp.fc", "mlp.c_fc", True), ("mlp.proj", "mlp.c_proj", True)]
    for i in range(2):
        for ours_name, hf_name, transpose in names:
            w = sd[f"h.{i}.{hf_name}.weight"]
            mapped[f"blocks.{i}.{ours_name}.weight"] = w.T if transpose else w  # HF Conv1D stores [in, out]
            mapped[f"blocks.{i}.{ours_name}.bias"] = sd[f"h.{i}.{hf_name}.bias"]
    ours.load_state_dict(mapped)
    ids = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(12))
    labels = torch.cat((ids[:, 1:], torch.full((2, 1), -100)), dim=1)  # HF shifts internally; we take shifted labels
    with torch.no_grad():
        ref = hf(input_ids=ids, labels=ids)
        torch.testing.assert_close(ours(ids), ref.logits, rtol=1e-5, atol=1e-5)
        assert abs(ours(ids, labels).item() - ref.loss.item()) < 1e-5


def test_llama_flavour_matches_transformers():
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.LlamaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-5, tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False, attn_implementation="eager",
    )
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    _randomise(hf)
    ours = GPT(ModelConfig(flavour="llama", vocab_size=100, max_seq_len=32, num_layers=2, hidden_size=64, num_heads=4,
                           num_kv_heads=2, tie_embeddings=False)).eval()
    assert ours.config.ffn_hidden_size == 192
    sd = hf.state_dict()
    mapped = {"tok_emb.weight": sd["model.embed_tokens.weight"], "lm_head.weight": sd["lm_head.weight"],
              "norm_f.weight": sd["model.norm.weight"]}
    for i in range(2):
        p = f"model.layers.{i}."
        mapped[f"blocks.{i}.norm1.weight"] = sd[p + "input_layernorm.weight"]
        mapped[f"blocks.{i}.norm2.weight"] = sd[p + "post_attention_layernorm.weight"]
        mapped[f"blocks.{i}.attn.qkv.weight"] = torch.cat([sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        mapped[f"blocks.{i}.attn.proj.weight"] = sd[p + "self_attn.o_proj.weight"]
        mapped[f"blocks.{i}.mlp.fc.weight"] = torch.cat([sd[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up")])
        mapped[f"blocks.{i}.mlp.proj.weight"] = sd[p + "mlp.down_proj.weight"]
    ours.load_state_dict(mapped)
    ids = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(13))
    labels = torch.cat((ids[:, 1:], torch.full((2, 1), -100)), dim=1)
    with torch.no_grad():
        ref = hf(input_ids=ids, labels=ids)
        torch.testing.assert_close(ours(ids), ref.logits, rtol=1e-5, atol=1e-5)
        assert abs(ours(ids, labels).item() - ref.loss.item()) < 1e-5
