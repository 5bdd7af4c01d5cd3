#!/usr/bin/env bash
# The users' workloads on one GPU (bench/user_workloads.py): their model, their DeepSpeed JSON, DeepSpeed and
# this engine in the same run. Name the runs to do (each is cut at its limit while the others still run):
#
#   source .devdeps/gpu-setup.sh && bash bench/user_runs.sh "$OUT" nngpt_2p7b_cap llama_2p7b_cap
#
# Writes OUT/<run>.out (the table, the plans and per-step notes, or the failure's tail); traces of one step of
# this engine under OUT/traces/.
source "$(dirname "$0")/named_runs.sh"  # run NAME LIMIT command...; $out
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-16}
mkdir -p /tmp/nvme_swap  # bench/configs/zero_nvme.json's nvme_path
configs=bench/configs
bench=(python3 bench/user_workloads.py --steps 8)
cap=(--memory-cap 22GB)
both=(--engines deepspeed angelptm)

# A 24 GB GPU: ZeRO-Infinity and ZeRO-Offload JSON, the model written from torch.nn and transformers' Llama.
run nngpt_2p7b_cap 420 "${bench[@]}" "${cap[@]}" "${both[@]}" --models nngpt --sizes 2.7b \
    --configs $configs/zero_infinity.json $configs/zero_offload.json --trace "$out/traces"
run nngpt_2p7b_host_adam 200 "${bench[@]}" "${cap[@]}" --engines angelptm --models nngpt --sizes 2.7b \
    --configs $configs/zero_offload.json --set zero_cache.device_steps=0
run llama_2p7b_cap 420 "${bench[@]}" "${cap[@]}" "${both[@]}" --models hf_llama --sizes 2.7b \
    --configs $configs/zero_infinity.json --trace "$out/traces"
run gpt2_2p7b_cap 420 "${bench[@]}" "${cap[@]}" "${both[@]}" --models hf_gpt2 --sizes 2.7b \
    --configs $configs/zero_infinity.json
# The bench's own GPT at the same shape and cap, for the gap between it and the users' models.
run ours_2p7b_cap 200 python3 bench/engine_step.py --steps 8 --memory-cap 22GB --build-on-host --sizes 2.7b \
    --modes zero_cache --anchor zero_cache
# The largest size DeepSpeed fits under the cap, and the whole GPU against plain torch.
run nngpt_6p9b_cap 540 "${bench[@]}" "${cap[@]}" "${both[@]}" --models nngpt --sizes 6.9b \
    --configs $configs/zero_infinity.json
run gpu_tests 200 python3 -m pytest -q -p no:cacheprovider tests/gpu
[ -d "$out/traces" ] && tar czf "$out/traces.tgz" -C "$out" traces && rm -rf "$out/traces"
