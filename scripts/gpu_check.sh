#!/usr/bin/env bash
# The accelerator check, one command on a CUDA machine (docs/performance.md, "GPU"):
#   scripts/gpu_check.sh /mnt/nvme/fp_gpu_check
# 1. tests/test_gpu.py (marker gpu): GPU tensors saved and loaded bit-exactly in both formats,
#    async snapshots copied device-to-host into page-locked memory. Fails rather than skips.
# 2. the benchmark on that directory (put it on the NVMe), one GPU per rank, NCCL (ranks beyond the
#    GPUs would share them under gloo).
# 3. the training-loop benchmark (docs/async.md) with at least two ranks: on a one-GPU
#    machine both share it, under gloo.
# PYTHON (default .venv/bin/python), RANKS (default: every GPU; the loop takes at least 2), GIB
# (default 4) override.
# The bench runs through fastpersist_dist_cli, whose main asks for CUDA through NVML before
# anything else can, so the ranks it forks can still initialize CUDA (docs/performance.md, "GPU").
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:?usage: scripts/gpu_check.sh <directory on the NVMe to benchmark>}
py=${PYTHON:-.venv/bin/python}
"$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "gpu_check: torch sees no CUDA device")'
ranks=${RANKS:-$("$py" -c 'import torch; print(torch.cuda.device_count())')}
FASTPERSIST_REQUIRE=gpu "$py" -m pytest tests/test_gpu.py -m gpu -q -p no:cacheprovider
mkdir -p "$dir"
"$py" -m fastpersist_dist_cli bench --contenders device_bound,fastpersist,fastpersist_async,fastpersist_dcp,torch_dist,torch_save \
    --ranks "$ranks" --tp 1 --gib "${GIB:-4}" --reps 3 --dir "$dir" --json "$dir/gpu_bench.json" --log-level INFO
"$py" -m fastpersist_dist_cli bench-train --ranks "$(( ranks > 1 ? ranks : 2 ))" --tp 1 --gib "${GIB:-4}" --reps 3 \
    --dir "$dir" --json "$dir/gpu_bench_train.json"
