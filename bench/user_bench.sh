# Sourced by bench/user_runs.sh and bench/matrix.sh: the named-run helper and what every run of
# bench/user_workloads.py shares (threads, the NVMe JSON's swap directory, the configs, the 22 GB cap).
source "$(dirname "${BASH_SOURCE[0]}")/named_runs.sh"  # run NAME LIMIT command...; $out
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-16}
mkdir -p /tmp/nvme_swap  # bench/configs/zero_nvme.json's nvme_path
c=bench/configs
bench=(python3 bench/user_workloads.py --steps 8)
cap=(--memory-cap 22GB)  # a 24 GB GPU
