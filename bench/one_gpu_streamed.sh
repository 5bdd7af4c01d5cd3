#!/usr/bin/env bash
# Streamed params (param_home host) on one H200 standing for a 24 GB GPU: ZeRO-Cache against DeepSpeed
# ZeRO-Infinity (offload_param + offload_optimizer to pinned CPU) under the same 22 GB cap, the largest
# model that cap holds, and the full-budget sizes that must not regress. Name the runs to do (their limits
# add up to more than one device call allows; each is cut at its limit while the others still run):
#
#   source .devdeps/gpu-setup.sh && bash bench/one_gpu_streamed.sh "$OUT" gpu_tests infinity_2p7b streamed_6p9b
#
# Writes OUT/<run>.out (the bench's table, the plan and per-step notes, or the failure's tail).
source "$(dirname "$0")/named_runs.sh"  # run NAME LIMIT command...; $out
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-16}
cap=(--memory-cap 22GB --build-on-host)  # the cap binds every mode; zero_cache's "auto" budget plans within it
step=(python3 bench/engine_step.py --steps 8)

run gpu_tests 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_zero_cache_streamed_cuda.py
# zero_cache_host_adam: the same with every host group on the host's Adam (zero_cache.device_steps 0).
run infinity_2p7b 360 "${step[@]}" "${cap[@]}" --sizes 2.7b --modes zero_cache zero_cache_host_adam \
    deepspeed_infinity --anchor deepspeed_infinity
run infinity_4p4b 480 "${step[@]}" "${cap[@]}" --sizes 4.4b --modes zero_cache zero_cache_host_adam \
    deepspeed_infinity --anchor deepspeed_infinity
run streamed_6p9b 300 "${step[@]}" "${cap[@]}" --sizes 6.9b --modes zero_cache --anchor zero_cache
run largest_8p5b 540 "${step[@]}" "${cap[@]}" --sizes 8.5b --modes zero_cache --anchor zero_cache
mkdir -p /tmp/zero_cache_swap  # the NVMe tier's swap directory (on the H200 machines measured, /tmp is on the local disk)
# Expandable segments: without them the re-plan's placement failed at step 1 on fragmentation (1.42 GiB reserved
# but unallocated under the cap; 2026-11-25-h200-streamed-10b-nvme-22gb-first-oom-c34a7be.log).
run largest_nvme_10b 420 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "${step[@]}" "${cap[@]}" --sizes 10b --modes zero_cache --anchor zero_cache \
    --nvme-path /tmp/zero_cache_swap
# A picture of one 6.9B step under a 22 GB device budget (built on the GPU to save time; OUT/trace_6p9b/).
run trace_6p9b 300 "${step[@]}" --steps 6 --device-budget 22GB --sizes 6.9b --modes zero_cache --anchor zero_cache \
    --trace "$out/trace_6p9b"
# No regression: the whole GPU, params resident (bench/results/HISTORY.md: 6.9B 463, 13.7B 410 model TFLOPS).
run full_6p9b 150 "${step[@]}" --sizes 6.9b --modes zero_cache --anchor zero_cache
run full_13p7b 260 "${step[@]}" --sizes 13.7b --modes zero_cache --anchor zero_cache
