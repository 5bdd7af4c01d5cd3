#!/usr/bin/env bash
# The 2-GPU benchmarks of the MoE and AutoPipe issues, plus the GPU tests, in one device call
# (about 11 minutes of limits in all, more than one device call allows, so name the runs to do;
# each run is cut at its limit and the others still run):
#
#   source .devdeps/gpu-setup.sh && bash bench/two_gpu.sh "$OUT" moe_layer_2gpu moe_alltoall
#   source .devdeps/gpu-setup.sh && bash bench/two_gpu.sh "$OUT" autopipe_split autopipe_split_12 moe_layer_1gpu gpu_tests
#
# Writes OUT/<run>.log (the bench's own report) and OUT/<run>.out (its stdout and stderr).
source "$(dirname "$0")/named_runs.sh"  # run NAME LIMIT command...; $out

run moe_layer_2gpu 150 torchrun --standalone --nproc-per-node 2 bench/moe_layer.py \
    --log-file "$out/moe_layer_2gpu.log" --rounds 2 --iters 10
run moe_alltoall 60 torchrun --standalone --nproc-per-node 2 bench/moe_alltoall.py --log-file "$out/moe_alltoall.log"
run autopipe_split 150 torchrun --standalone --nproc-per-node 2 bench/autopipe_split.py \
    --log-file "$out/autopipe_split.log" --steps 6 --warmup-steps 2 --profile-repeats 3
# Fewer blocks against the same vocabulary: a more unequal model.
run autopipe_split_12 120 torchrun --standalone --nproc-per-node 2 bench/autopipe_split.py \
    --log-file "$out/autopipe_split_12.log" --steps 6 --warmup-steps 2 --profile-repeats 3 --layers 12
run moe_layer_1gpu 90 python3 bench/moe_layer.py --log-file "$out/moe_layer_1gpu.log" --rounds 2 --iters 10
run gpu_tests 150 python3 -m pytest -q -p no:cacheprovider tests/gpu tests/unit/test_moe_layer.py \
    tests/unit/test_zero_cache_nvme.py
