#!/usr/bin/env bash
# The regression matrix (BENCHMARKS.md, "Regression matrix"): fixed rows of the users' workloads, each run on the
# card it names, each with its best figure kept in BENCHMARKS.md. A change that can touch a row runs it on the
# device before its issue is resolved; a row more than 5% slower than its best on the same card is fixed or
# explained. Name the rows to run (each cut at its limit while the others still run), grouped by card:
#
#   H200:                     source .devdeps/gpu-setup.sh && bash bench/matrix.sh "$OUT" h200_13b_user h200_13b_user_clip
#                             source .devdeps/gpu-setup.sh && bash bench/matrix.sh "$OUT" h200_13b h200_13b_no_device_steps
#                             source .devdeps/gpu-setup.sh && bash bench/matrix.sh "$OUT" h200_2p7b_capped h200_2p7b_capped_clip
#                             source .devdeps/gpu-setup.sh && bash bench/matrix.sh "$OUT" h200_2p7b_capped_ds_newest
#                             source .devdeps/gpu-setup.sh && bash bench/matrix.sh "$OUT" h200_2p7b_checkpoint_save
#                             source .devdeps/gpu-setup.sh && bash bench/matrix.sh "$OUT" h200_16b_largest h200_2p7b_whole
#   H100:                     source .devdeps/gpu-setup.sh && bash bench/matrix.sh "$OUT" h100_10b h100_2p7b_capped
#                             source .devdeps/gpu-setup.sh && bash bench/matrix.sh "$OUT" h100_2p7b_whole h100_llama_capped
#                             source .devdeps/gpu-setup.sh && bash bench/matrix.sh "$OUT" h100_nvme_2p7b
#   2x H200 (one host):       source .devdeps/gpu-setup.sh && bash bench/matrix.sh "$OUT" h200x2_6p9b_scaling
#
# Each line fits in 600 s. A 13B run of ours takes about 3 minutes (2 to build and initialize, 32 steps);
# a 2.7B capped run about 2 (1.5 to initialize), DeepSpeed's about 1.5.
#
# Every row is a DeepSpeed script of a user's model (bench/user_models.py: the GPT written from torch.nn modules,
# transformers' Llama) driven by its DeepSpeed JSON (bench/configs/), micro-batch 8, seq 1024, bf16, timed as a user's
# loop times it (docs/benchmarking.md): the median and the mean with the pending work of the last 10 steps after the
# warm-up and the engine's tuning, no drain outside the clock. "_user" rows are a user's first script: PyTorch's
# init, one batch reused, the model built under zero.Init(dtype=bf16); "_clip" rows clip every measured step (a
# threshold of 0.01, under every norm; --require-clip fails the row otherwise), and the rows beside them set 1e4 so
# the same norms are computed and never clip. Each run's JSON line carries every step's time and norm. Writes
# OUT/<row>.out.
source "$(dirname "$0")/user_bench.sh"  # run NAME LIMIT command...; $out, $c, bench, cap, user, clip, noclip
ours=(--engines angelptm --anchor angelptm)
u13b=("${bench[@]}" "${ours[@]}" "${user[@]}" --build zero_init_bf16 --models nngpt --sizes 13b --configs $c/zero_offload.json)

# The whole H200, the ZeRO-Offload JSON, 13.1B: a user's first script unclipped and clipping every step (the clipped
# step's cost is their ratio), the bench's own data and init, and device steps off.
run h200_13b_user 290 "${u13b[@]}" "${noclip[@]}"
run h200_13b_user_clip 290 "${u13b[@]}" "${clip[@]}"
run h200_13b 290 "${bench[@]}" "${ours[@]}" --models nngpt --sizes 13b --configs $c/zero_offload.json "${noclip[@]}"
run h200_13b_no_device_steps 290 "${bench[@]}" "${ours[@]}" --tuning-steps 6 --models nngpt --sizes 13b \
    --configs $c/zero_offload.json "${noclip[@]}" --set angelptm:zero_cache.device_steps=0
# The largest measured on the whole H200 with fp32 states and no disk (16.25B; 125 GiB of host), the same script.
run h200_16b_largest 330 "${bench[@]}" "${ours[@]}" "${user[@]}" --build zero_init_bf16 --models nngpt --sizes 16.3b \
    --configs $c/zero_offload.json "${noclip[@]}"
# The whole H200 against plain torch bf16 without fp32 masters, a user's first script.
run h200_2p7b_whole 240 "${bench[@]}" "${user[@]}" --engines torch angelptm --anchor torch --models nngpt \
    --sizes 2.7b --configs $c/zero_offload.json "${noclip[@]}"
# Under a 22 GB cap on the H200: the ZeRO-Infinity JSON against DeepSpeed ZeRO-Infinity, a user's first script,
# unclipped and clipping every step.
capped=("${bench[@]}" "${cap[@]}" "${user[@]}" --engines deepspeed angelptm --models nngpt --sizes 2.7b \
        --configs $c/zero_infinity.json)
run h200_2p7b_capped 290 "${capped[@]}" "${noclip[@]}"
run h200_2p7b_capped_clip 290 "${capped[@]}" "${clip[@]}"
# DeepSpeed's newest offloads beside ZeRO-Infinity at the same size and cap, unclipped (DeepSpeed only: compare with
# h200_2p7b_capped). ZenFlow runs ZeRO-2: under ZeRO-3, DeepSpeed 0.19.8's ZenFlow transposes every 2-D parameter,
# the embedding's too, and the first forward fails (bench/results/*-deepspeed-zenflow-stage3-fails-*.out); and with
# overlap_step false: with it, the run was SIGKILLed at its first full update, likely out of host memory
# (*-zenflow-stage2-overlap-killed*).
run h200_2p7b_capped_ds_newest 400 "${bench[@]}" "${cap[@]}" "${user[@]}" --engines deepspeed --anchor deepspeed \
    --models nngpt --sizes 2.7b --configs $c/zero_zenflow.json $c/zero_superoffload.json "${noclip[@]}"
# Checkpoints beside training (issue 52), the same 2.7B capped workload: the disk's bandwidth, a run saving in the
# background every 10 steps (the stall per 100 steps, GB/s against the disk's, host RSS), a fresh process loading its
# last checkpoint, and that resume against the spread of two uninterrupted runs: three processes of about 2 minutes
# (1.5 to build and initialize each), about 7 in all.
run h200_2p7b_checkpoint_save 580 python3 bench/checkpoint_save.py --model 2.7b
# The whole H100, the ZeRO-Offload JSON: 10B unclipped and clipping every step.
run h100_10b 560 "${bench[@]}" "${ours[@]}" "${user[@]}" --models nngpt --sizes 10b --configs $c/zero_offload.json \
    "${noclip[@]}"
run h100_10b_clip 300 "${bench[@]}" "${ours[@]}" "${user[@]}" --models nngpt --sizes 10b \
    --configs $c/zero_offload.json "${clip[@]}"
# Under a 22 GB cap: the ZeRO-Infinity JSON against DeepSpeed ZeRO-Infinity, the torch.nn GPT and Llama.
run h100_2p7b_capped 420 "${bench[@]}" "${cap[@]}" "${user[@]}" --engines deepspeed angelptm --models nngpt \
    --sizes 2.7b --configs $c/zero_infinity.json "${noclip[@]}"
run h100_llama_capped 300 "${bench[@]}" "${cap[@]}" --engines deepspeed angelptm --models hf_llama --sizes 2.7b \
    --configs $c/zero_infinity.json "${clip[@]}"
# The user's NVMe JSON at 2.7B under the cap, against DeepSpeed. Ours first: DeepSpeed's steps take 50-60 s here,
# and with DeepSpeed first the row's limit ran out before ours started.
run h100_nvme_2p7b 560 python3 bench/user_workloads.py --steps 4 --warmup-steps 1 "${cap[@]}" \
    --engines angelptm deepspeed --anchor deepspeed --models nngpt --sizes 2.7b --configs $c/zero_nvme.json
# The whole H100 against plain torch bf16 without fp32 masters.
run h100_2p7b_whole 300 "${bench[@]}" --engines torch angelptm --anchor torch --models nngpt --sizes 2.7b \
    --configs $c/zero_offload.json "${noclip[@]}"
# Two ranks against one, and DeepSpeed ZeRO-3 on the same GPUs (6.9B, micro-batch 8 per GPU).
run h200x2_6p9b_scaling 560 python3 bench/engine_step.py --sizes 6.9b --modes zero_cache deepspeed_zero3 \
    --anchor deepspeed_zero3 --nproc 1 2 --steps 8
