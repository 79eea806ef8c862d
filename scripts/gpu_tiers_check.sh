#!/usr/bin/env bash
# Tiered checkpoints on a machine with a GPU and cores to spare (docs/tiers.md, "Benchmark"), in three parts
# that each fit a ten-minute slot:
#   scripts/gpu_tiers_check.sh write-path DIR   the local tier's write path on /dev/shm against the device
#                                               bounds, the state in host memory, 1 then 2 ranks (`bench`)
#   scripts/gpu_tiers_check.sh durable DIR      the training loop with tiered checkpoints, the state on the GPU:
#                                               TP=1 then TP=2 (`bench-train`), the persistent tier DIR (put it
#                                               on the disk to measure)
#   scripts/gpu_tiers_check.sh restart DIR      the restart at TP=1 (each rank needs the whole state) from the
#                                               local tier on /dev/shm, the state on the GPU: reads unshared there
#                                               (share_reads auto), then each byte read once and sent (on)
# Each result also goes to DIR/<part>-*.json. PYTHON (default python3), GIB (default 1) override.
# WHEELS=DIR first installs what a machine without network lacks from wheels and .deb files in DIR (DeepSpeed,
# megatron-core and their pure dependencies; Debian's libaio1 and libaio-dev) under /tmp/fp-offline, for
# this run only: pip --no-index --no-deps --target, dpkg -x, and the variables that point there.
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: scripts/gpu_tiers_check.sh write-path|durable|restart DIR"
part=${1:?$usage}
dir=${2:?$usage}
py=${PYTHON:-python3}
gib=${GIB:-1}
if [ -n "${WHEELS:-}" ]; then
    offline=/tmp/fp-offline
    mkdir -p "$offline/site" "$offline/root"
    "$py" -m pip install -q --no-index --no-deps --target "$offline/site" "$WHEELS"/*.whl
    for deb in "$WHEELS"/*.deb; do dpkg -x "$deb" "$offline/root"; done
    lib="$offline/root/usr/lib/x86_64-linux-gnu"
    export PYTHONPATH="$PWD:$offline/site${PYTHONPATH:+:$PYTHONPATH}"
    export CPATH="$offline/root/usr/include${CPATH:+:$CPATH}"
    export LIBRARY_PATH="$lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
    export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export TORCH_EXTENSIONS_DIR=/tmp/fp-offline/torch_ext
fi
"$py" -c 'import torch; print("gpu_tiers_check: torch", torch.__version__, "CUDA" if torch.cuda.is_available()
          else "without CUDA (the durable part then keeps the state in host memory)")'
nproc
mkdir -p "$dir"
case "$part" in
    write-path)
        for ranks in 1 2; do
            CUDA_VISIBLE_DEVICES= "$py" -m fastpersist_dist_cli bench --ranks "$ranks" --tp 1 --gib "$((gib * 2))" \
                --reps 5 --dir /dev/shm/fp-tiers-bench --json "$dir/write-path-$ranks.json" \
                --contenders device_bound,device_bound_checksummed,fastpersist,fastpersist_local_tier
            rm -rf /dev/shm/fp-tiers-bench
        done ;;
    durable)
        for tp in 1 2; do
            "$py" -m fastpersist_dist_cli bench-train --ranks 2 --tp "$tp" --gib "$gib" --steps 30 --every 10 \
                --compute-ms 150 --reps 2 --contenders none,fastpersist,fastpersist_tiered --dir "$dir/train" \
                --local-dir /dev/shm/fp-tiers-local --log-level INFO --json "$dir/durable-tp$tp.json"
            rm -rf "$dir/train" /dev/shm/fp-tiers-local
        done ;;
    restart)
        for share in auto on; do
            "$py" -m fastpersist_dist_cli bench-train --ranks 2 --tp 1 --gib "$gib" --steps 12 --every 10 \
                --compute-ms 150 --reps 3 --contenders none,fastpersist_tiered --dir "$dir/train" \
                --local-dir /dev/shm/fp-tiers-local --share-reads "$share" --log-level INFO \
                --json "$dir/restart-$share.json"
            rm -rf "$dir/train" /dev/shm/fp-tiers-local
        done ;;
    *) echo "gpu_tiers_check: unknown part $part (write-path, durable or restart)" >&2; exit 2 ;;
esac
