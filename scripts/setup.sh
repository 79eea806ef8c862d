#!/usr/bin/env bash
# Set up fastpersist-dist on a fresh Debian machine that has Python 3.11:
# libaio-dev (apt, only when missing), a virtualenv, torch==2.13.0 (only when the venv
# has no torch; never an unpinned torch), the package with its test extras, and the
# DeepSpeed ops it uses, prebuilt so the first save does not pay the ~4-minute JIT build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${FASTPERSIST_VENV:-.venv}"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3

if ! dpkg -s libaio-dev >/dev/null 2>&1; then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO=sudo
    echo "setup: installing libaio-dev"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libaio-dev >/dev/null
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    echo "setup: installing torch==2.13.0"
    "${PIP[@]}" torch==2.13.0
fi
echo "setup: installing fastpersist-dist[test]"
"${PIP[@]}" -e ".[test]"
echo "setup: building DeepSpeed ops (cached under ~/.cache/torch_extensions)"
"$VENV/bin/fastpersist-dist" build-ops
