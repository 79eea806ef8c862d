#!/usr/bin/env bash
# Set up fastpersist-dist on a fresh Debian machine, for one megatron-core stack:
#   FASTPERSIST_STACK=mcore-0.16 (default): Python 3.11, megatron-core 0.16.1, venv .venv
#   FASTPERSIST_STACK=mcore-0.19:           Python 3.12, megatron-core 0.19.2, venv .venv-0.19
#   FASTPERSIST_STACK=mcore-0.17, mcore-0.18: Python 3.12, megatron-core 0.17.1 / 0.18.2, venv .venv-0.17 / .venv-0.18
# Installs libaio-dev (apt, only when missing), makes the venv, installs torch==2.13.0 (only when
# the venv has no torch; never an unpinned torch), the package with its test extras and the
# stack's megatron-core, torchtitan beside the venv (<venv>/torchtitan, for its test), and prebuilds the
# DeepSpeed ops it uses into <venv>/torch_ext, so the first save does not pay the ~5-minute JIT build.
# FASTPERSIST_VENV and PYTHON override the defaults.
# FASTPERSIST_OVERLAY=DIR instead installs only the stack's megatron-core, without dependencies, into DIR: put
# on PYTHONPATH in front of FASTPERSIST_VENV (set up already, with the stack's Python), it gives that venv's
# torch, DeepSpeed ops and other packages under another megatron-core, with no copy or rebuild. Refused where
# that megatron-core would need other packages than the venv has, or where the venv's megatron holds a part
# DIR lacks (megatron is a namespace package: such a part would come from the venv's release).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/common.sh
source scripts/common.sh
STACK="${FASTPERSIST_STACK:-mcore-0.16}"
stack_versions "$STACK"
VENV="${FASTPERSIST_VENV:-$DEFAULT_VENV}"

if [ -n "${FASTPERSIST_OVERLAY:-}" ]; then
    overlay=$FASTPERSIST_OVERLAY
    "$VENV/bin/python" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$PY_VERSION'.split('.'))))" ||
        { echo "setup: FASTPERSIST_OVERLAY needs $VENV set up first, with Python $PY_VERSION" >&2; exit 2; }
    echo "setup: megatron-core==$MCORE alone into $overlay, in front of $VENV"
    extra=$("$VENV/bin/python" -m pip install -q --disable-pip-version-check --dry-run --report - \
        "megatron-core==$MCORE" 2>/dev/null | "$VENV/bin/python" -c 'import json, sys
print(" ".join(i["metadata"]["name"] + "==" + i["metadata"]["version"] for i in json.load(sys.stdin)["install"]
               if i["metadata"]["name"] != "megatron-core"))')
    [ -z "$extra" ] || { echo "setup: megatron-core==$MCORE needs $extra beside $VENV's packages: set up" \
        "FASTPERSIST_STACK=$STACK in a venv of its own" >&2; exit 1; }
    rm -rf "$overlay"
    pip_install "$VENV/bin/python" --no-deps --target "$overlay" "megatron-core==$MCORE"
    PYTHONPATH="$overlay" "$VENV/bin/python" - "$overlay" "$MCORE" <<'EOF'
import importlib.metadata, os, sys
import megatron
overlay, release = os.path.realpath(sys.argv[1]), sys.argv[2]
version = importlib.metadata.version("megatron-core")
assert version == release, f"setup: megatron-core {version} imported with {overlay} in front, not {release}"
ours = set(os.listdir(os.path.join(overlay, "megatron")))
for portion in megatron.__path__:
    lacking = sorted(set(os.listdir(portion)) - ours - {"__pycache__"})
    assert not lacking, f"setup: {portion} has {lacking}, which {overlay}/megatron lacks"
EOF
    exit 0
fi

apt_install libaio-dev

[ -x "$VENV/bin/python" ] || "$(find_python "$PY_VERSION")" -m venv "$VENV"
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    echo "setup: installing torch==2.13.0 into $VENV ($STACK)"
    pip_install "$VENV/bin/python" torch==2.13.0
fi
echo "setup: installing fastpersist-dist[test] with megatron-core==$MCORE into $VENV"
pip_install "$VENV/bin/python" -e ".[test]" "megatron-core==$MCORE"
if [ "$STACK" != mcore-0.16 ] && [ ! -d "$VENV/nvrx/nvidia_resiliency_ext" ]; then
    # megatron-core 0.17+'s default async queue ("nvrx") comes from nvidia-resiliency-ext, whose
    # only Python 3.12 wheel is tagged manylinux_2_39 (this Debian has glibc 2.36). Its async
    # checkpoint queue is pure Python; it goes beside the venv, not on its path, so only the test
    # of that queue (tests/test_torch_dist_format.py) imports it and megatron's default stays as is.
    echo "setup: nvidia-resiliency-ext 0.7.0 into $VENV/nvrx (for the test of megatron's nvrx queue)"
    pip_install "$VENV/bin/python" --no-deps --only-binary=:all: --platform manylinux_2_39_x86_64 --python-version 3.12 \
        --target "$VENV/nvrx" nvidia-resiliency-ext==0.7.0
fi
if [ ! -d "$VENV/torchtitan/torchtitan-0.3.0.dist-info" ]; then
    # torchtitan 0.3.0, for the test of its checkpoint manager through ours (tests/test_dcp_library.py), beside
    # the venv, not on its path. Without its dependencies: the trainer's (datasets, torchdata, wandb, ...) are
    # not imported by its checkpoint manager and optimizers, and some would move the venv's torch; those that
    # are (tyro with docstring-parser and typeguard, spmd_types) come pinned, 15 MB in all.
    echo "setup: torchtitan 0.3.0 into $VENV/torchtitan (for the test of its checkpoint manager)"
    rm -rf "$VENV/torchtitan"
    pip_install "$VENV/bin/python" --no-deps --target "$VENV/torchtitan" torchtitan==0.3.0 spmd_types==0.2.3 \
        tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1
fi
echo "setup: building DeepSpeed ops (cached under $VENV/torch_ext)"
"$VENV/bin/fastpersist-dist" build-ops
