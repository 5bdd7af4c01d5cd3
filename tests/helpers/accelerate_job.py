"""An ``accelerate`` training script with a DeepSpeed config, run on one backend; writes what it saw as JSON.

    python accelerate_job.py deepspeed|angelptm OUT.json WORKDIR

The same API calls as accelerate's ``examples/by_feature/deepspeed_with_config_support.py``: a
``DeepSpeedPlugin`` from a config whose values are ``"auto"`` (accelerate's ZeRO templates), ``DummyOptim``
and ``DummyScheduler`` for the config's optimizer and schedule, ``accelerator.prepare``,
``accelerator.accumulate``, ``accelerator.backward``, ``clip_grad_norm_``, ``reduce``,
``gather_for_metrics``, ``save_state`` / ``skip_first_batches`` / ``load_state``, ``unwrap_model``,
``get_state_dict`` and ``save_pretrained``. ``angelptm``: the one line
``import angelptm.integrations.accelerate`` comes first; nothing else differs. ``deepspeed``: the caller sets
DS_ACCELERATOR=cpu and a one-rank launcher environment.

Per case: the losses and grad norms of every optimizer step, the losses of the steps after ``load_state``
(which repeat the steps after the checkpoint), the eval loss, and the max difference between the
reloaded ``from_pretrained`` model's and ``get_state_dict``'s weights.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# The switch is read only when run as a script: tests import this module for its constants, under a pytest
# whose own argv says nothing about a backend.
if __name__ == "__main__" and sys.argv[1:2] == ["angelptm"]:
    import angelptm.integrations.accelerate  # noqa: F401  (the switch: before anything imports deepspeed)

import torch
import transformers
from accelerate import Accelerator, DeepSpeedPlugin
from accelerate.state import AcceleratorState, GradientState, PartialState
from accelerate.utils import DummyOptim, DummyScheduler, set_seed
from torch.utils.data import DataLoader

STEPS, MICRO, ACCUMULATION, SEQ, VOCAB, SAVE_AFTER = 6, 2, 2, 16, 64, 3


def ds_config(stage: int, offload: bool) -> dict:
    """accelerate's ``zero_stage{2,3}_config.json`` templates, fp32 (fp16 is off on a CPU)."""
    zero: dict = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": "auto"}
    if stage == 3:
        zero.update({"stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                     "sub_group_size": 1e9, "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                     "stage3_gather_16bit_weights_on_model_save": True})
    params: dict = {"lr": "auto", "weight_decay": "auto"}
    if offload:
        zero.update({"offload_optimizer": {"device": "cpu", "pin_memory": True},
                     "offload_param": {"device": "cpu", "pin_memory": True}})
        # torch's AdamW for DeepSpeed's offloaded states: its DeepSpeedCPUAdam would JIT-compile for minutes on a
        # fresh machine. (ZeRO-Cache runs its own host Adam either way.)
        params["torch_adam"] = True
    return {"fp16": {"enabled": False}, "bf16": {"enabled": False}, "zero_force_ds_cpu_optimizer": False,
            "optimizer": {"type": "AdamW", "params": params},
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                              "warmup_num_steps": "auto", "total_num_steps": "auto"}},
            "zero_optimization": zero, "gradient_accumulation_steps": ACCUMULATION, "gradient_clipping": "auto",
            "steps_per_print": 2000, "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
            "wall_clock_breakdown": False}


CASES = {"stage2": (2, False), "stage3_offload": (3, True)}


def data() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, ((STEPS * ACCUMULATION + 2) * MICRO, SEQ), generator=generator)
    ids[:, 1::2] = ids[:, ::2]  # learnable: every odd token repeats the one before it
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def initial_model(directory: Path) -> Path:
    """A tiny GPT-2 saved once, so both backends (and ZeRO-3's construction) start from the same weights."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    transformers.GPT2LMHeadModel(config).save_pretrained(directory)
    return directory


def train(accelerator: Accelerator, model, optimizer, loader, scheduler, skip: int = 0) -> tuple[list, list]:
    losses, norms, window = [], [], []
    active = accelerator.skip_first_batches(loader, skip * ACCUMULATION) if skip else loader
    for batch in active:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            window.append(accelerator.reduce(loss.detach().clone()).item())
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            losses.append(sum(window) / len(window))
            window = []
    return losses, norms


def run_case(name: str, work: Path, init: Path) -> dict:
    stage, offload = CASES[name]
    plugin = DeepSpeedPlugin(hf_ds_config=ds_config(stage, offload))
    accelerator = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=ACCUMULATION)
    set_seed(3)
    model = transformers.AutoModelForCausalLM.from_pretrained(init)
    rows = data()
    train_loader = DataLoader(rows[:STEPS * ACCUMULATION * MICRO], batch_size=MICRO, shuffle=False)
    eval_loader = DataLoader(rows[STEPS * ACCUMULATION * MICRO:], batch_size=MICRO)
    optimizer = DummyOptim(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = DummyScheduler(optimizer, total_num_steps=STEPS, warmup_num_steps=1)
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler)
    # The first SAVE_AFTER steps, then a checkpoint, then the rest of the same loader.
    head = accelerator.prepare_data_loader(DataLoader(rows[:SAVE_AFTER * ACCUMULATION * MICRO], batch_size=MICRO))
    losses, norms = train(accelerator, model, optimizer, head, scheduler)
    accelerator.save_state(str(work / name / "checkpoint"))
    tail_losses, tail_norms = train(accelerator, model, optimizer, train_loader, scheduler, skip=SAVE_AFTER)
    model.eval()
    eval_losses = [accelerator.gather_for_metrics(model(**batch).loss.detach().reshape(1)) for batch in eval_loader]
    model.train()
    accelerator.load_state(str(work / name / "checkpoint"))
    resumed_losses, _ = train(accelerator, model, optimizer, train_loader, scheduler, skip=SAVE_AFTER)
    unwrapped = accelerator.unwrap_model(model)
    state = accelerator.get_state_dict(model)
    unwrapped.save_pretrained(work / name / "model", is_main_process=accelerator.is_main_process,
                              save_function=accelerator.save, state_dict=state)
    torch.save(state, work / name / "state.pt")  # the caller reloads the model in a process without a ZeRO-3 config
    result = {"losses": losses + tail_losses, "norms": norms + tail_norms, "resumed": resumed_losses,
              "eval": torch.cat(eval_losses).mean().item(), "unwrapped": type(unwrapped).__name__}
    accelerator.free_memory()
    for state_class in (AcceleratorState, GradientState, PartialState):  # the next case builds its own Accelerator
        state_class._reset_state()
    return result


def main() -> None:
    backend, out, work = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    if backend == "deepspeed":  # skip its CPU shared-memory all-reduce, JIT-compiled on first use (40 s on a fresh
        import deepspeed  # cache); gloo adds the same. A harness setting, not part of the script under test.

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    init = initial_model(work / "init")
    results = {name: run_case(name, work, init) for name in CASES}
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
