# Sourced by bench/user_runs.sh and bench/matrix.sh: the named-run helper and what every run of
# bench/user_workloads.py shares (threads, the NVMe JSON's swap directory, the configs, the 22 GB cap).
source "$(dirname "${BASH_SOURCE[0]}")/named_runs.sh"  # run NAME LIMIT command...; $out
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-16}
mkdir -p /tmp/nvme_swap  # bench/configs/zero_nvme.json's nvme_path
c=bench/configs
bench=(python3 bench/user_workloads.py --steps 10)  # the protocol: at least 10 measured steps
user=(--init default --data reused)  # what a first script of a user does: PyTorch's init, one batch reused
clip=(--set gradient_clipping=0.01 --require-clip)  # a clip row clips every measured step (docs/benchmarking.md)
noclip=(--set gradient_clipping=10000.0)  # the norm computed, never clipped
cap=(--memory-cap 22GB)  # a 24 GB GPU
