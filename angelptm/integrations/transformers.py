"""The transformers ``Trainer`` on this engine: ``TrainingArguments(deepspeed=...)`` scripts, one import changed.

    from angelptm.integrations.transformers import Trainer   # instead of: from transformers import Trainer

transformers already runs DeepSpeed through accelerate: it resolves the config's ``"auto"`` values from
``TrainingArguments`` (``HfTrainerDeepSpeedConfig``), hands backward, the optimizer and scheduler steps
and clipping to the engine (``accelerator.backward`` -> ``engine.backward`` + ``engine.step``), and
saves and resumes with ``engine.save_checkpoint`` / ``load_checkpoint`` in ``checkpoint-N/global_stepN``.
This subclass keeps all of that and changes the one place where DeepSpeed's engine is built
(accelerate's ``Accelerator._prepare_deepspeed``) to build ours with :func:`angelptm.initialize`, so
ZeRO-Cache sections of the config work too. ``save_model()`` writes the engine's consolidated fp32
weights with ``save_pretrained``.

A ZeRO-3 config works as with DeepSpeed: models that transformers builds after the ``TrainingArguments``
(``from_config``, ``from_pretrained``) are built under :class:`angelptm.zero.Init` and loaded whole into
its parameters (in host memory when the config puts params there), and ``deepspeed.zero.GatheredParameters``
is this package's for them (``angelptm.integrations.transformers_zero3``, installed by importing this module).
``zero_cache`` values set to ``"auto"`` are left for the engine to resolve.

Refused rather than run some other way: a ``TrainingArguments`` without ``deepspeed`` (that would be
plain PyTorch training), DeepSpeed tensor/sequence parallelism, fp8, ``torch_compile``, and a model
partitioned by DeepSpeed's own ``zero.Init`` outside transformers (a script's ``with deepspeed.zero.Init()``
of the real DeepSpeed).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import transformers
from accelerate import Accelerator
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import (
    DeepSpeedEngineWrapper,
    DeepSpeedOptimizerWrapper,
    DeepSpeedSchedulerWrapper,
    DummyOptim,
    DummyScheduler,
)
from torch import nn
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

import angelptm
import angelptm.comm
from angelptm.errors import ConfigError
from angelptm.integrations import transformers_zero3

__all__ = ["Trainer"]

transformers_zero3.install()  # transformers' ZeRO-3 model construction builds on angelptm.zero from here on


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` whose DeepSpeed engine is this package's.

    Takes exactly ``transformers.Trainer``'s arguments; ``args.deepspeed`` (a path or a dict) is required.

    Raises:
        ConfigError: ``TrainingArguments`` without ``deepspeed``, or a feature this engine does not have.
    """

    def create_accelerator_and_postprocess(self) -> None:
        if not self.args.deepspeed:
            raise ConfigError("angelptm.integrations.transformers.Trainer trains on the angelptm engine, which it "
                              "configures from a DeepSpeed config: pass TrainingArguments(deepspeed='ds_config.json') "
                              "(or a dict); without one, use transformers.Trainer")
        super().create_accelerator_and_postprocess()
        if not self.is_deepspeed_enabled:  # e.g. use_cpu=True, which makes accelerate drop DeepSpeed
            raise ConfigError("accelerate did not enable its DeepSpeed path (TrainingArguments(use_cpu=True) or "
                              "ACCELERATE_USE_CPU turn it off), so training would run as plain PyTorch; leave use_cpu "
                              "unset: the engine runs on the CPU when there is no GPU")
        # Swapping the class of this one instance (it adds no state) reroutes engine construction without
        # patching accelerate or deepspeed for anyone else in the process.
        self.accelerator.__class__ = _EngineAccelerator

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        # train() again: accelerate's free_memory() destroyed the engine the Trainer still holds as model_wrapped,
        # and transformers would train on it as "already wrapped" (under DeepSpeed that ends in "'NoneType' object
        # has no attribute 'backward'", transformers issue 24558). A new engine is built over the module instead,
        # from the weights the old one handed back.
        if isinstance(model, angelptm.Engine) and model.destroyed:
            model = self.model
        return super()._wrap_model(model, training, dataloader)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write a ``save_pretrained`` directory of the engine's consolidated fp32 weights (rank 0 writes); before
        training, or after accelerate's ``free_memory()`` destroyed the engine, the module's own weights.

        Every rank must call it when ZeRO-Cache shards the weights (the masters are gathered).
        """
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        engine = self.deepspeed
        state = None
        # Only writers build the fp32 copy (8 B/param of host memory), unless sharded masters need every rank.
        if engine is not None and not engine.destroyed and (self.args.should_save or engine.zero_cache_shards > 1):
            state = engine.consolidated_state_dict()
        self._save(output_dir, state_dict=state)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)


class _EngineWrapper(DeepSpeedEngineWrapper):
    """accelerate's hook for ``accelerator.backward``: backward, then ``step()`` on every micro-batch.

    DeepSpeed's wrapper calls ``step()`` only at the boundary; calling it on each micro-batch (it only
    counts one there) keeps the engine's micro-step count true, which its checkpoints record.
    """

    def backward(self, loss: torch.Tensor, sync_gradients: bool = True, **kwargs: Any) -> None:
        self.engine.set_gradient_accumulation_boundary(sync_gradients)
        self.engine.backward(loss, **kwargs)
        self.engine.step()


class _EngineAccelerator(Accelerator):
    """An ``Accelerator`` whose DeepSpeed preparation builds :class:`angelptm.Engine` instead."""

    def _prepare_deepspeed(self, *args: Any) -> tuple:
        _refuse_unsupported(self)
        result = [self._prepare_one(obj, first_pass=True) if isinstance(obj, DataLoader) else obj for obj in args]
        plugin = self.deepspeed_plugin
        plugin.fill_match("gradient_accumulation_steps", must_match=False,
                          gradient_accumulation_steps=self.gradient_accumulation_steps)
        self.gradient_accumulation_steps = plugin.get_value("gradient_accumulation_steps")
        model = next((obj for obj in result if isinstance(obj, nn.Module)), None)
        if model is None:  # a dataloader alone (the Trainer prepares it before the model)
            return tuple(result)
        optimizer = next((obj for obj in result if isinstance(obj, (torch.optim.Optimizer, DummyOptim))), None)
        scheduler = next((obj for obj in result if isinstance(obj, (LRScheduler, DummyScheduler))), None)
        config = _resolved_config(plugin, model, optimizer, scheduler, result, self.num_processes)
        kwargs: dict[str, Any] = {}
        if isinstance(optimizer, DummyOptim):  # the config's "optimizer" section
            kwargs["model_parameters"] = optimizer.params
            if isinstance(scheduler, DummyScheduler) and scheduler.lr_scheduler_callable is not None:
                kwargs["lr_scheduler"] = scheduler.lr_scheduler_callable  # the Trainer's schedule, built on ours
        elif optimizer is not None:
            kwargs["optimizer"] = optimizer  # the Trainer's own (create_optimizer), with its param groups
        else:
            config.pop("optimizer", None)
            config.pop("scheduler", None)  # evaluation only: nothing to step
        if not torch.distributed.is_initialized():
            # The Trainer's DeepSpeed path gathers logged values with torch.distributed, so a process
            # group must exist, as deepspeed.initialize makes one: a world of one without a launcher.
            angelptm.comm.init_distributed()
        engine, engine_optimizer, _, engine_scheduler = angelptm.initialize(model=model, config=config, **kwargs)
        wrapped_optimizer = DeepSpeedOptimizerWrapper(engine_optimizer) if engine_optimizer is not None else None
        if engine_scheduler is not None:
            wrapped_scheduler = DeepSpeedSchedulerWrapper(engine_scheduler, wrapped_optimizer)  # the engine steps it
        elif scheduler is not None and not isinstance(scheduler, DummyScheduler):
            wrapped_scheduler = AcceleratedScheduler(scheduler, wrapped_optimizer,
                                                     step_with_optimizer=self.step_scheduler_with_optimizer)
        else:
            wrapped_scheduler = None
        for i, obj in enumerate(result):
            if obj is model:
                result[i] = engine
            elif obj is optimizer:
                result[i] = wrapped_optimizer
            elif obj is scheduler:
                result[i] = wrapped_scheduler
        self.deepspeed_engine_wrapped = _EngineWrapper(engine)
        self._models.append(engine)
        self._optimizers += [wrapped_optimizer] if wrapped_optimizer is not None else []
        self._schedulers += [wrapped_scheduler] if wrapped_scheduler is not None else []
        return tuple(result)


def _refuse_unsupported(accelerator: Accelerator) -> None:
    """Raise for what DeepSpeed's path in accelerate can do and this engine cannot."""
    config = accelerator.deepspeed_plugin.deepspeed_config
    problems = []
    if config.get("tensor_parallel", {}).get("autotp_size", 0) > 1:
        problems.append("tensor_parallel.autotp_size > 1 (tensor parallelism)")
    parallelism = accelerator.parallelism_config
    if parallelism is not None and getattr(parallelism, "sp_enabled", False):
        problems.append("parallelism_config with sequence parallelism")
    if accelerator.fp8_backend != "NO":
        problems.append("fp8 mixed precision")
    if accelerator.state.dynamo_plugin.backend.value != "NO":
        problems.append("torch_compile (compile the model yourself before building the Trainer)")
    if problems:
        raise ConfigError(f"the angelptm Trainer does not support: {'; '.join(problems)}")


_HIDDEN_SIZE_KEYS = ("zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
                     "zero_optimization.stage3_param_persistence_threshold")


def _resolved_config(plugin: Any, model: nn.Module, optimizer: Any, scheduler: Any, prepared: list,
                     num_processes: int) -> dict[str, Any]:
    """The DeepSpeed config with every ``"auto"`` filled as accelerate fills it for DeepSpeed, as a new dict.

    ``TrainingArguments`` filled most of them already (batch sizes, clipping, lr, betas, eps, weight decay,
    warmup, fp16/bf16); this fills what only the prepared objects know.

    Raises:
        ConfigError: an ``"auto"`` that nothing here can resolve, named by its dotted key.
    """
    micro = plugin.get_value("train_micro_batch_size_per_gpu")
    if micro == "auto":
        sizes = [obj.batch_size for obj in prepared if isinstance(obj, DataLoader) and obj.batch_size]
        micro = min(sizes) if sizes else None
    fills: dict[str, Any] = {"gradient_clipping": 1.0, "zero_optimization.stage3_gather_16bit_weights_on_model_save":
                             False}
    if micro is not None:
        fills["train_micro_batch_size_per_gpu"] = micro
        fills["train_batch_size"] = micro * plugin.get_value("gradient_accumulation_steps") * num_processes
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    if hidden is not None:
        fills.update(dict(zip(_HIDDEN_SIZE_KEYS, (hidden * hidden, int(0.9 * hidden * hidden), 10 * hidden))))
    if isinstance(optimizer, DummyOptim):
        fills.update({"optimizer.params.lr": optimizer.lr, "optimizer.params.weight_decay": optimizer.weight_decay})
    if isinstance(scheduler, DummyScheduler) and scheduler.lr_scheduler_callable is None:
        fills.update({"scheduler.params.warmup_min_lr": 0, "scheduler.params.warmup_num_steps":
                      max(1, scheduler.warmup_num_steps)})
        if scheduler.total_num_steps is not None:
            fills["scheduler.params.total_num_steps"] = scheduler.total_num_steps
    # zero_cache's "auto" values are the engine's to resolve (chunk size, budgets, ...): fill them with
    # themselves, or accelerate's pass over every "auto" in the config stops at the first one it cannot fill.
    own = _auto_keys(plugin.deepspeed_config.get("zero_cache") or {}, "zero_cache.")
    fills.update(dict.fromkeys(own, "auto"))
    plugin.deepspeed_config_process(must_match=False, **fills)
    config = copy.deepcopy(plugin.deepspeed_config)
    unresolved = sorted(set(_auto_keys(config)) - set(own))
    if unresolved:
        raise ConfigError(f"the DeepSpeed config still has \"auto\" for {', '.join(unresolved)}, which neither "
                          "TrainingArguments nor the model determine; set a value")
    # transformers sets this DeepSpeed permission for its own optimizers; it means nothing here, and
    # leaving it would list it among the keys "accepted without effect" in a warning the user never caused.
    config.pop("zero_allow_untested_optimizer", None)
    if config.get("steps_per_print") == float("inf"):  # accelerate's "never": the Trainer logs progress itself
        config["steps_per_print"] = 2**62
    return transformers_zero3.fp32_unless_enabled(config)


def _auto_keys(config: dict[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for key, value in config.items():
        if isinstance(value, dict):
            keys += _auto_keys(value, f"{prefix}{key}.")
        elif value == "auto":
            keys.append(prefix + key)
    return keys

