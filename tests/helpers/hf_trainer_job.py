"""Runs transformers' Trainer on one backend and writes per-step losses as JSON (tests/unit/test_hf_trainer.py).

    python hf_trainer_job.py deepspeed|angelptm OUT.json WORKDIR

``deepspeed``: ``transformers.Trainer`` on real DeepSpeed (CPU: the caller sets DS_ACCELERATOR=cpu and a
one-rank launcher environment). ``angelptm``: :class:`angelptm.integrations.transformers.Trainer`, plus
resume, ZeRO-Cache, ``save_model`` and ``--hf`` export checks. Both run the same fp32 cases, so losses
agree to rounding. A process of its own: TrainingArguments(deepspeed=...) sets process-wide state.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import transformers

STEPS, MICRO, ACCUMULATION, SEQ, VOCAB = 4, 2, 2, 16, 64


def model_config(kind: str) -> transformers.PretrainedConfig:
    if kind == "gpt2":  # dropout off: the backends draw no random numbers differently
        return transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                    bos_token_id=0, eos_token_id=0, pad_token_id=0)


def build_model(kind: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model_class = transformers.GPT2LMHeadModel if kind == "gpt2" else transformers.LlamaForCausalLM
    return model_class(model_config(kind))


def dataset() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (STEPS * MICRO * ACCUMULATION, SEQ), generator=generator)
    ids[:, 1::2] = ids[:, ::2]  # learnable: every odd token repeats the one before it
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def ds_config(stage: int, *, own_optimizer: bool, zero_cache: dict | None = None) -> dict:
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": {"stage": stage}}
    if own_optimizer:  # the config's optimizer and schedule (DeepSpeed builds them), every value "auto"
        config["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                           "weight_decay": "auto"}}
        config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                              "warmup_num_steps": "auto"}}
    if zero_cache is not None:
        config["zero_cache"] = zero_cache
    return config


def arguments(out: Path, config: dict, **overrides) -> transformers.TrainingArguments:
    values = dict(output_dir=str(out), per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUMULATION,
                  max_steps=STEPS, learning_rate=2e-2, weight_decay=0.01, warmup_steps=1, max_grad_norm=0.5,
                  logging_steps=1, report_to=[], save_strategy="no", deepspeed=config, seed=3,
                  dataloader_num_workers=0, disable_tqdm=True)
    values.update(overrides)
    return transformers.TrainingArguments(**values)


def losses(trainer: transformers.Trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


CASES = {f"{kind}_stage{stage}": (kind, stage) for kind in ("gpt2", "llama") for stage in (0, 1, 2)}
"""gpt2 takes the config's optimizer and WarmupLR; llama the Trainer's own AdamW and linear schedule."""


def run_cases(trainer_class: type, work: Path) -> dict:
    results = {}
    for name, (kind, stage) in CASES.items():
        config = ds_config(stage, own_optimizer=kind == "gpt2")
        trainer = trainer_class(model=build_model(kind, 0), args=arguments(work / name, config),
                                train_dataset=dataset())
        trainer.train()
        results[name] = losses(trainer)
    return results


ZERO3_CASES = ("llama_stage3_from_config", "gpt2_stage3_from_config_resized", "llama_stage3_from_pretrained_offload")
"""run_clm.py's order: TrainingArguments with a ZeRO-3 config first, then the model, which transformers builds
under ``deepspeed.zero.Init`` (from_config, from_pretrained) and edits under ``GatheredParameters``
(weight init, resize_token_embeddings)."""
OFFLOAD_ZERO_CACHE = {"enabled": True, "chunk_size": "auto", "device_memory_budget": 80_000,
                      "host_memory_budget": "auto"}
"""angelptm's from_pretrained case: "auto" values through the Trainer, and a device budget smaller than the
model's fp32 weights (90,752 bytes), so they can only train from homes in host memory."""


def run_zero3_cases(trainer_class: type, work: Path, *, zero_cache: dict | None = None) -> tuple[dict, Any]:
    """The ZERO3_CASES; returns their losses and the from_pretrained case's trainer."""
    build_model("llama", 5).save_pretrained(work / "pretrained")  # while no ZeRO-3 config is registered
    results = {}
    args = arguments(work / "z3_llama", ds_config(3, own_optimizer=False))
    torch.manual_seed(0)
    trainer = trainer_class(model=transformers.AutoModelForCausalLM.from_config(model_config("llama")), args=args,
                            train_dataset=dataset())
    trainer.train()
    results[ZERO3_CASES[0]] = losses(trainer)
    args = arguments(work / "z3_gpt2", ds_config(3, own_optimizer=True))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(model_config("gpt2"))
    model.resize_token_embeddings(VOCAB + 8)  # new rows: the mean and covariance of the old, under GatheredParameters
    trainer = trainer_class(model=model, args=args, train_dataset=dataset())
    trainer.train()
    results[ZERO3_CASES[1]] = losses(trainer)
    config = ds_config(3, own_optimizer=False)
    config["zero_optimization"]["offload_param"] = {"device": "cpu"}  # ZeRO-Infinity's "too large for the GPU"
    if zero_cache is not None:
        config["zero_cache"] = zero_cache
    args = arguments(work / "z3_pretrained", config)
    model = transformers.AutoModelForCausalLM.from_pretrained(work / "pretrained")
    trainer = trainer_class(model=model, args=args, train_dataset=dataset())
    trainer.train()
    results[ZERO3_CASES[2]] = losses(trainer)
    return results, trainer


def angelptm_checks(work: Path) -> dict:
    from angelptm.checkpoints import export
    from angelptm.integrations.transformers import Trainer

    results = {}
    try:
        Trainer(model=build_model("gpt2", 0), args=arguments(work / "plain", None), train_dataset=dataset())
    except Exception as err:  # noqa: BLE001  (the test reads the message)
        results["refusal"] = f"{type(err).__name__}: {err}"
    # Resume: save at step 2, resume a differently initialised model from it.
    config = ds_config(0, own_optimizer=True)
    straight = Trainer(model=build_model("llama", 0), args=arguments(work / "resume", config, save_strategy="steps",
                                                                      save_steps=2), train_dataset=dataset())
    straight.train()
    resumed = Trainer(model=build_model("llama", 7), args=arguments(work / "resumed", config),
                      train_dataset=dataset())
    resumed.train(resume_from_checkpoint=str(work / "resume" / "checkpoint-2"))
    results["resume"] = {"straight": losses(straight), "resumed": losses(resumed)}
    # save_model and the offline export of a Trainer checkpoint: from_pretrained against the engine's weights.
    straight.save_model(str(work / "saved"))
    probe = dataset()[0]["input_ids"][None]
    with torch.no_grad():
        expected = straight.model.eval()(probe).logits
        loaded = transformers.LlamaForCausalLM.from_pretrained(work / "saved").eval()(probe).logits
        export.export_hf(work / "resume" / "checkpoint-4", work / "exported", max_shard_size=20_000)
        exported = transformers.LlamaForCausalLM.from_pretrained(work / "exported").eval()(probe).logits
    results["save_model"] = {"diff": (loaded - expected).abs().max().item(), "scale": expected.abs().max().item(),
                             "export_diff": (exported - expected).abs().max().item(),
                             "export_files": sorted(p.name for p in (work / "exported").iterdir())}
    # ZeRO-Cache: a device budget a quarter of the model states, the rest on the host tier.
    zero_cache = {"enabled": True, "chunk_size": 8192, "device_memory_budget": 400_000,
                  "host_memory_budget": 10**8}
    cached = Trainer(model=build_model("llama", 0), args=arguments(work / "zc", ds_config(
        0, own_optimizer=True, zero_cache=zero_cache)), train_dataset=dataset())
    cached.train()
    tiers = sorted({str(group.tier) for group in cached.deepspeed.optimizer.store.groups})
    results["zero_cache"] = {"losses": losses(cached), "tiers": tiers}
    plain = Trainer(model=build_model("llama", 0), args=arguments(work / "zc_plain", ds_config(
        0, own_optimizer=True)), train_dataset=dataset())
    plain.train()
    results["zero_cache"]["plain"] = losses(plain)
    return results


def main() -> None:
    backend, out, work = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    if backend == "deepspeed":
        results = run_cases(transformers.Trainer, work)
        results.update(run_zero3_cases(transformers.Trainer, work)[0])
    else:
        from angelptm.integrations.transformers import Trainer

        results = run_cases(Trainer, work)
        results.update(angelptm_checks(work))
        zero3, pretrained = run_zero3_cases(Trainer, work, zero_cache=OFFLOAD_ZERO_CACHE)
        results.update(zero3)
        store = pretrained.deepspeed.optimizer.store
        device = store.tiers["device"]
        results["from_pretrained_offload"] = {
            "device_budget": device.budget_bytes, "device_peak": device.peak_bytes,
            "weight_bytes": sum(p.numel() * 4 for p in pretrained.model.parameters()),
            "param_homes": sorted(set(store.param_home)) if store.shard_params else [],
            "optimizer_tiers": sorted({str(group.tier) for group in store.groups})}
        # train() again (DeepSpeed stops here: transformers issue 24558): accelerate's free_memory() (which train()
        # calls first; called here to look in between) destroys the engine, whose streamed params go back to the
        # module whole, and a new engine trains on from them.
        first, old = losses(pretrained), pretrained.deepspeed
        trained = old.consolidated_state_dict()
        pretrained.accelerator.free_memory()
        handed_back = max((param.detach() - trained[name]).abs().max().item()
                          for name, param in pretrained.model.named_parameters())
        pretrained.train()
        results["train_again"] = {"first": first, "again": losses(pretrained), "old_destroyed": old.destroyed,
                                  "new_engine": pretrained.deepspeed is not old, "handed_back_diff": handed_back}
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
