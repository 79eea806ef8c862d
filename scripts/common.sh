# Sourced by scripts/setup.sh and scripts/check_wheel.sh.

# find_python VERSION: an interpreter of that Python version: $PYTHON if set, else pythonVERSION on PATH, else
# pyenv's newest VERSION.x.
find_python() {
    local version=$1
    if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
    if command -v "python$version" >/dev/null && "python$version" -c 1 2>/dev/null; then
        echo "python$version"; return
    fi
    local root="${PYENV_ROOT:-$HOME/.pyenv}"
    local found
    found="$(ls -d "$root"/versions/"$version".*/bin/python 2>/dev/null | sort -V | tail -n 1 || true)"
    if [ -n "$found" ]; then echo "$found"; return; fi
    echo "no Python $version found (python$version on PATH or under pyenv)" >&2
    return 2
}

# pip_install PYTHON ARGS...: `PYTHON -m pip install -q ARGS`, without pip's warning for each unusable index
# location of the machine's pip configuration (one per package looked up, harmless); the rest on stderr.
pip_install() {
    local python=$1
    shift
    "$python" -m pip install -q --disable-pip-version-check "$@" 2>&1 |
        { grep -v "^WARNING: Location '.*' is ignored: it is neither a file nor a directory\.$" >&2 || true; }
}
