"""``deepspeed.runtime.fp16``: importable so that scripts naming DeepSpeed's fp16 optimizers load; the optimizers
themselves are DeepSpeed's internals and are not provided (``unfused_optimizer``)."""
