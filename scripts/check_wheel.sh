#!/usr/bin/env bash
# The package as users install it: build the wheel and the sdist (python -m build), install the wheel,
# not editable, into a new venv, and run the README's quickstart there, outside the checkout, with an empty
# cache for the streaming copy (built at first use) and site-packages left unwritten.
#   bash scripts/check_wheel.sh   (FASTPERSIST_STACK: the Python and megatron-core of the new venv, as
#                                  scripts/setup.sh names them, default mcore-0.16; PYTHON: that interpreter)
# Needs what scripts/setup.sh installs (libaio-dev).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/common.sh
source scripts/common.sh
stack_versions "${FASTPERSIST_STACK:-mcore-0.16}"
root=$PWD
py=$(find_python "$PY_VERSION")
venv=$root/.venv-wheel
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

"$py" -m venv "$out/build-env"
pip_install "$out/build-env/bin/python" build
"$out/build-env/bin/python" -m build --outdir "$out/dist" "$root" >"$out/build.log" 2>&1 ||
    { tail -n 40 "$out/build.log"; exit 1; }
wheel=$(ls "$out"/dist/fastpersist_dist-*.whl)
sdist=$(ls "$out"/dist/fastpersist_dist-*.tar.gz)
echo "check_wheel: built $(basename "$wheel") and $(basename "$sdist")"
# Both hold the C source of the streaming copy, which the package builds at first use.
tar -tzf "$sdist" >"$out/sdist.txt" && grep -q "fastpersist_dist/storage/stream_copy.c" "$out/sdist.txt"
"$py" -m zipfile -l "$wheel" >"$out/wheel.txt" && grep -q "fastpersist_dist/storage/stream_copy.c" "$out/wheel.txt"

rm -rf "$venv"
"$py" -m venv "$venv"
# torch==2.13.0 first, as scripts/setup.sh does: the wheel's "torch>=2.4" then installs nothing more.
pip_install "$venv/bin/python" torch==2.13.0
pip_install "$venv/bin/python" "$wheel" "megatron-core==$MCORE"
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
location=$(cd "$out" && "$venv/bin/python" -c 'import fastpersist_dist, os; print(os.path.dirname(fastpersist_dist.__file__))')
[ "$location" = "$site/fastpersist_dist" ] || { echo "check_wheel: imported $location, not the installed wheel" >&2; exit 1; }
"$venv/bin/fastpersist-dist" build-ops

cp "$root/examples/quickstart.py" "$out/"
touch "$out/stamp"
(cd "$out" && env -u PYTHONPATH XDG_CACHE_HOME="$out/cache" OMP_NUM_THREADS=1 \
    "$venv/bin/python" -m torch.distributed.run --standalone --nproc-per-node 2 quickstart.py "$out/ckpts") |
    tee "$out/quickstart.log"
grep -q "quickstart: 2 ranks saved, loaded resharded and verified" "$out/quickstart.log"
ls "$out"/cache/fastpersist_dist/stream_copy-*.so >/dev/null  # built at first use, into the user's cache
written=$(find "$site" -newer "$out/stamp" -print | head -n 5)
[ -z "$written" ] || { echo "check_wheel: the quickstart wrote into site-packages: $written" >&2; exit 1; }
echo "check_wheel: the wheel installed into a new venv runs the quickstart, outside the checkout, writing nothing there"
