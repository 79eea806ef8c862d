#!/usr/bin/env bash
# Set up fastpersist-dist on a fresh Debian machine, for one megatron-core stack:
#   FASTPERSIST_STACK=mcore-0.16 (default): Python 3.11, megatron-core 0.16.1, venv .venv
#   FASTPERSIST_STACK=mcore-0.19:           Python 3.12, megatron-core 0.19.2, venv .venv-0.19
#   FASTPERSIST_STACK=mcore-0.17, mcore-0.18: Python 3.12, megatron-core 0.17.1 / 0.18.2, venv .venv-0.17 / .venv-0.18
# Installs libaio-dev (apt, only when missing), makes the venv, installs torch==2.13.0 (only when
# the venv has no torch; never an unpinned torch), the package with its test extras and the
# stack's megatron-core, and prebuilds the DeepSpeed ops it uses into <venv>/torch_ext, so the
# first save does not pay the ~5-minute JIT build. FASTPERSIST_VENV and PYTHON override the defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
STACK="${FASTPERSIST_STACK:-mcore-0.16}"
case "$STACK" in
    mcore-0.16) PY_VERSION=3.11; MCORE=0.16.1; DEFAULT_VENV=.venv ;;
    mcore-0.17) PY_VERSION=3.12; MCORE=0.17.1; DEFAULT_VENV=.venv-0.17 ;;
    mcore-0.18) PY_VERSION=3.12; MCORE=0.18.2; DEFAULT_VENV=.venv-0.18 ;;
    mcore-0.19) PY_VERSION=3.12; MCORE=0.19.2; DEFAULT_VENV=.venv-0.19 ;;
    *) echo "setup: FASTPERSIST_STACK must be mcore-0.16, mcore-0.17, mcore-0.18 or mcore-0.19, got '$STACK'" >&2; exit 2 ;;
esac
VENV="${FASTPERSIST_VENV:-$DEFAULT_VENV}"

# shellcheck source=scripts/common.sh
source scripts/common.sh

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
echo "setup: building DeepSpeed ops (cached under $VENV/torch_ext)"
"$VENV/bin/fastpersist-dist" build-ops
