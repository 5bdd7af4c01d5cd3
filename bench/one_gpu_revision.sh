#!/usr/bin/env bash
# Host updates during backward under clipping, accumulation and fp16 (zero_cache.revision) on one H200, each
# against the same run without clipping (or in bf16) in the same invocation; plus the checkpoint checksum's
# cost on that machine's disk (issue 19). Name the runs to do:
#
#   source .devdeps/gpu-setup.sh && bash bench/one_gpu_revision.sh "$OUT" gpu_tests clip_13p7b
#
# Writes OUT/<run>.out (the bench's table, the plan and per-step notes, or the failure's tail).
source "$(dirname "$0")/named_runs.sh"  # run NAME LIMIT command...; $out
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-16}
step=(python3 bench/engine_step.py --steps 10)

run gpu_tests 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_zero_cache_cuda.py
# 13.7B, whole GPU (bench/results/HISTORY.md: 410 TFLOPS without clipping, 292 with clipping 1.0 before this change).
run clip_13p7b 300 "${step[@]}" --sizes 13.7b --modes zero_cache zero_cache_clip --anchor zero_cache
# Accumulating, 4 micro-batches of 2. (At 13.7B the fp32 accumulators, 4 B/param more, do not fit this host's
# 125 GiB: "host tier needs 125.44 GiB but its budget is 111.48 GiB"; 6.9B with a 60 GB device budget puts
# about half of the optimizer groups on the host instead. Params resident: streamed params accumulate through
# gradient buckets, updated after backward, at about 14 s a step here: a separate matter.)
run accumulate_6p9b 420 "${step[@]}" --steps 6 --sizes 6.9b --micro 2 --accumulation 4 --device-budget 60GB \
    --param-home device --modes zero_cache zero_cache_clip --anchor zero_cache
# fp16 with dynamic loss scaling against bf16, 6.9B under a 60 GB device budget (host chunks update in backward).
run fp16_6p9b 240 "${step[@]}" --sizes 6.9b --device-budget 60GB --modes zero_cache zero_cache_fp16 \
    --anchor zero_cache
run checkpoint_hash 240 bash -c "mkdir -p /tmp/ckpt_hash && python3 bench/checkpoint_hash.py --gib 8 --repeats 3 --dir /tmp/ckpt_hash"
