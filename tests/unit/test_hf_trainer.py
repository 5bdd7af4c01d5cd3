"""transformers' Trainer on this engine against Trainer + real DeepSpeed (CPU, fp32, ZeRO stages 0-2).

Both backends run in processes of their own at the same time (tests/helpers/hf_trainer_job.py):
``TrainingArguments(deepspeed=...)`` leaves process-wide state behind, and DeepSpeed needs a launcher
environment. Each writes per-step losses; the checks read them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from launch import beside_deepspeed

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("deepspeed")

from hf_trainer_job import CASES, OFFLOAD_ZERO_CACHE, STEPS, ZERO3_CASES  # noqa: E402  (tests/helpers, after the skips)

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "helpers" / "hf_trainer_job.py"


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("hf_trainer")
    return beside_deepspeed(JOB, root, per_backend_dir=True, one_thread=False)


@pytest.mark.parametrize("case", sorted(CASES) + list(ZERO3_CASES))
def test_losses_equal_trainer_with_deepspeed(results, case):
    ours, theirs = results["angelptm"][case], results["deepspeed"][case]
    assert len(ours) == len(theirs) == STEPS
    assert min(theirs[1:]) < theirs[0], "the model must learn, or agreement proves little"
    assert max(abs(a - b) for a, b in zip(ours, theirs)) <= 1e-5, (ours, theirs)


def test_resume_from_a_trainer_checkpoint_continues_like_the_uninterrupted_run(results):
    resume = results["angelptm"]["resume"]
    straight, resumed = resume["straight"], resume["resumed"]
    assert len(straight) == len(resumed) == STEPS  # steps 1-2 from the checkpoint's log, 3-4 trained after it
    # The resumed model started from other weights (seed 7): only a real load gives these losses.
    assert resumed[2:] == pytest.approx(straight[2:], abs=1e-6)


def test_save_model_and_hf_export_load_with_from_pretrained(results):
    saved = results["angelptm"]["save_model"]
    assert saved["scale"] > 0.1
    assert saved["diff"] <= 1e-6 and saved["export_diff"] <= 1e-6
    assert "model.safetensors.index.json" in saved["export_files"], "a small max_shard_size must shard"


def test_zero_cache_config_trains_and_tracks_the_plain_engine(results):
    cached = results["angelptm"]["zero_cache"]
    assert cached["tiers"] == ["device", "host"], "the budgets must split the states over two tiers"
    assert min(cached["losses"][1:]) < cached["losses"][0]
    assert cached["losses"] == pytest.approx(cached["plain"], rel=1e-5)


def test_training_again_destroys_the_engine_and_trains_on_from_its_weights(results):
    """A second ``trainer.train()``: accelerate's ``free_memory()`` calls ``engine.destroy()``, and the Trainer builds
    a new engine over the module (under DeepSpeed it trains on the destroyed one and stops with "'NoneType' object
    has no attribute 'backward'"). The ZeRO-3 from_pretrained case streams its params from host memory, so the
    module gets them back from the old engine whole: the new run starts below where the first one started."""
    again = results["angelptm"]["train_again"]
    assert again["old_destroyed"] and again["new_engine"]
    assert again["handed_back_diff"] == 0.0, "the module must hold the weights the engine ended with (fp32 here)"
    assert len(again["again"]) == len(again["first"]) and again["again"][0] < again["first"][0]


def test_training_arguments_without_deepspeed_are_refused(results):
    message = results["angelptm"]["refusal"]
    assert message.startswith("ConfigError") and "TrainingArguments(deepspeed=" in message


def test_from_pretrained_under_zero3_trains_from_host_homes_within_a_device_budget_below_the_weights(results):
    """The "too large for one GPU" path: from_pretrained after a ZeRO-3 + offload_param TrainingArguments loads
    the weights into whole host tensors (angelptm.zero.Init), and the engine trains them from homes in host
    memory with a device tier that never held even the fp32 weights; losses equal DeepSpeed's (above), with
    zero_cache "auto" values that went through the Trainer's own auto-filling."""
    case = results["angelptm"]["from_pretrained_offload"]
    assert case["device_budget"] == OFFLOAD_ZERO_CACHE["device_memory_budget"] < case["weight_bytes"]
    assert 0 < case["device_peak"] <= case["device_budget"]
    assert case["param_homes"] == ["host"] and case["optimizer_tiers"] == ["host"]


def test_the_model_is_built_with_the_trainers_precision_and_param_placement_not_its_unresolved_autos():
    from angelptm.integrations.transformers_zero3 import construction_config

    hf_config = {"train_batch_size": "auto", "fp16": {"enabled": False}, "bf16": {"enabled": False},
                 "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "reduce_bucket_size": "auto",
                                       "stage3_prefetch_bucket_size": "auto"},
                 "zero_cache": {"enabled": True, "chunk_size": "auto"}, "optimizer": {"params": {"lr": "auto"}}}
    config = construction_config(hf_config)
    assert config == {"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": False}, "bf16": {"enabled": False},
                      "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
                      "zero_cache": {"enabled": True, "chunk_size": "auto"}}
    assert hf_config["zero_optimization"]["reduce_bucket_size"] == "auto", "the Trainer's dict is left as it was"
    import angelptm

    init = angelptm.zero.Init(config_dict_or_path=config)
    assert init.dtype == torch.float32 and init.device == torch.device("cpu")
    assert construction_config({"zero_optimization": {"stage": 3}})["bf16"] == {"enabled": False}, \
        "no precision enabled means fp32, as DeepSpeed trains"


def test_initialize_refuses_params_the_real_deepspeed_partitioned_naming_the_way_out():
    import angelptm

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    model[0].weight.ds_id = 0  # what the real zero.Init leaves on a parameter it emptied (a fake of one)
    with pytest.raises(angelptm.ConfigError, match=r"\['0.weight'\] were partitioned by the real DeepSpeed.*"
                                                   r"import angelptm.integrations.transformers"):
        angelptm.initialize(model=model, config={"train_batch_size": 1})


def test_only_transformers_own_zero3_calls_are_routed_to_angelptm():
    """deepspeed.zero.Init with transformers' registered config (what from_config / from_pretrained pass) builds on
    angelptm.zero; any other call, and GatheredParameters over DeepSpeed-partitioned params, reach DeepSpeed."""
    from transformers.integrations import HfDeepSpeedConfig

    import angelptm
    from angelptm.integrations import transformers_zero3

    calls = []

    def deepspeeds(*args, **kwargs):  # stands in for DeepSpeed's own class
        calls.append((args, kwargs))
        return "deepspeed's"

    init, gathered = transformers_zero3._routed_init(deepspeeds), transformers_zero3._routed_gathered(deepspeeds)
    registered = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    routed = init(config_dict_or_path=registered.config)
    assert not calls and hasattr(routed, "__enter__") and routed != "deepspeed's"
    assert init(config_dict_or_path={"zero_optimization": {"stage": 3}}) == "deepspeed's"
    plain, partitioned = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    partitioned.ds_id = 0
    assert isinstance(gathered(plain, modifier_rank=0), angelptm.zero.GatheredParameters)
    assert gathered([plain, partitioned], modifier_rank=0) == "deepspeed's" and len(calls) == 2
    del registered
