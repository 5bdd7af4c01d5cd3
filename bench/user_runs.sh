#!/usr/bin/env bash
# The users' workloads on one GPU (bench/user_workloads.py): their model, their DeepSpeed JSON, DeepSpeed and
# this engine in the same run. Name the runs to do (each is cut at its limit while the others still run):
#
#   source .devdeps/gpu-setup.sh && bash bench/user_runs.sh "$OUT" nngpt_2p7b llama_2p7b
#
# Writes OUT/<run>.out (the table, the plans and per-step notes, or the failure's tail); traces of one step of
# this engine under OUT/traces/ (packed into OUT/traces.tgz).
source "$(dirname "$0")/user_bench.sh"  # run NAME LIMIT command...; $out, $c, bench, cap
both=(--engines deepspeed angelptm)

# Under the cap: ZeRO-Infinity and ZeRO-Offload JSON; the GPT written from torch.nn, transformers' Llama and GPT-2.
run nngpt_2p7b 420 "${bench[@]}" "${cap[@]}" "${both[@]}" --models nngpt --sizes 2.7b \
    --configs $c/zero_infinity.json $c/zero_offload.json --trace "$out/traces"
run llama_2p7b 300 "${bench[@]}" "${cap[@]}" "${both[@]}" --models hf_llama --sizes 2.7b \
    --configs $c/zero_infinity.json --trace "$out/traces"
run gpt2_2p7b 300 "${bench[@]}" "${cap[@]}" "${both[@]}" --models hf_gpt2 --sizes 2.7b --configs $c/zero_infinity.json
# The largest size DeepSpeed ZeRO-Infinity fits on this host, both engines.
run nngpt_4p4b 420 "${bench[@]}" "${cap[@]}" "${both[@]}" --models nngpt --sizes 4.4b --configs $c/zero_infinity.json
# The user's NVMe JSON (params offloaded to the host, optimizer states to the disk), both engines: DeepSpeed puts the
# states on the disk; here offload_optimizer nvme permits the disk, and the plan keeps on the host what fits.
run nvme_2p7b 420 python3 bench/user_workloads.py --steps 4 "${cap[@]}" "${both[@]}" --models nngpt --sizes 2.7b \
    --configs $c/zero_nvme.json
# Params and optimizer states on NVMe (issue 30): DeepSpeed ZeRO-Infinity against this engine, a workstation's
# budget (22 GB GPU, 32 GiB of host memory for our tiers; DeepSpeed has no such key), the local disk. DeepSpeed's
# param swapper needs more buffers than the JSON's 5 ("Not enough buffers 0 for swapping 1" at step 1), each as
# large as the embedding (1.4e8 elements at 2.7B). Here offload_param nvme is a permission: the nvme_auto runs take
# the JSON as it is, the nvme_params runs force every shard onto the disk (zero_cache.param_home "nvme").
nvme_json=(--configs $c/zero_infinity_nvme.json --set angelptm:zero_cache.host_memory_budget=32GiB
           --set deepspeed:zero_optimization.offload_param.buffer_count=32
           --set deepspeed:zero_optimization.offload_param.buffer_size=140000000)
homes_on_disk=(--set 'angelptm:zero_cache.param_home="nvme"')
run nvme_auto_2p7b 560 python3 bench/user_workloads.py --steps 3 --tuning-steps 3 "${cap[@]}" \
    --engines angelptm deepspeed --models nngpt --sizes 2.7b "${nvme_json[@]}"
run nvme_auto_4p4b 560 python3 bench/user_workloads.py --steps 8 --tuning-steps 0 "${cap[@]}" --engines angelptm \
    --anchor angelptm --models nngpt --sizes 4.4b "${nvme_json[@]}"
run nvme_params_1p3b 560 python3 bench/user_workloads.py --steps 3 --tuning-steps 3 "${cap[@]}" \
    --engines angelptm deepspeed --models nngpt --sizes 1.3b "${nvme_json[@]}" "${homes_on_disk[@]}"
run nvme_params_2p7b 560 python3 bench/user_workloads.py --steps 8 --tuning-steps 0 "${cap[@]}" --engines angelptm \
    --anchor angelptm --models nngpt --sizes 2.7b "${nvme_json[@]}" "${homes_on_disk[@]}"
# The whole host and the disk under the cap: the largest the plan fits on the 1x H200 machine measured
# (125 GiB of host, 64 GiB of free disk: 11.7B).
run nvme_whole_host_12b 560 python3 bench/user_workloads.py --steps 3 --tuning-steps 0 "${cap[@]}" \
    --engines angelptm --anchor angelptm --models nngpt --sizes 12b --configs $c/zero_infinity_nvme.json
# The newest DeepSpeed offloads at the same size and cap (DeepSpeed only; compare with nngpt_2p7b's zero_offload).
run ds_newest_2p7b 400 "${bench[@]}" "${cap[@]}" --engines deepspeed --models nngpt --sizes 2.7b \
    --configs $c/zero_superoffload.json $c/zero_zenflow.json
run ours_offload_2p7b 150 "${bench[@]}" "${cap[@]}" --engines angelptm --anchor angelptm --models nngpt \
    --sizes 2.7b --configs $c/zero_offload.json
# The whole GPU: plain torch bf16 without fp32 masters against this engine with the ZeRO-Offload JSON.
run full_2p7b 300 "${bench[@]}" --engines torch angelptm --anchor torch --models nngpt --sizes 2.7b \
    --configs $c/zero_offload.json
# Clipping on every step (random tokens: the norm is above 1 at every step) against none, the whole GPU.
run clip_10b 560 "${bench[@]}" --engines angelptm --anchor angelptm --models nngpt --sizes 10b \
    --configs $c/zero_offload.json $c/zero_offload_noclip.json
# 13B on the whole H200 (issue 27): the default (device steps "auto", tuned) against device_steps 0, same machine.
run h200_13b_auto 300 "${bench[@]}" --engines angelptm --anchor angelptm --models nngpt --sizes 13b \
    --configs $c/zero_offload.json
run h200_13b_no_device_steps 260 "${bench[@]}" --tuning-steps 0 --engines angelptm --anchor angelptm --models nngpt \
    --sizes 13b --configs $c/zero_offload.json --set angelptm:zero_cache.device_steps=0
run gpu_user_model 400 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_user_model_cuda.py
run gpu_tests 500 python3 -m pytest -q -p no:cacheprovider tests/gpu
if [ -d "$out/traces" ]; then tar czf "$out/traces.tgz" -C "$out" traces && rm -rf "$out/traces"; fi
