# Sourced by scripts/setup.sh, scripts/check_wheel.sh and .ci/run; a message starts with the name of the script
# that sourced it.

# stack_versions STACK: PY_VERSION, MCORE and DEFAULT_VENV of a megatron-core stack (exits 2 on another name).
stack_versions() {
    case "$1" in
        mcore-0.16) PY_VERSION=3.11; MCORE=0.16.1; DEFAULT_VENV=.venv ;;
        mcore-0.17) PY_VERSION=3.12; MCORE=0.17.1; DEFAULT_VENV=.venv-0.17 ;;
        mcore-0.18) PY_VERSION=3.12; MCORE=0.18.2; DEFAULT_VENV=.venv-0.18 ;;
        mcore-0.19) PY_VERSION=3.12; MCORE=0.19.2; DEFAULT_VENV=.venv-0.19 ;;
        *) echo "$(basename "$0" .sh): FASTPERSIST_STACK must be mcore-0.16, mcore-0.17, mcore-0.18 or mcore-0.19, got '$1'" >&2; exit 2 ;;
    esac
}

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
    echo "$(basename "$0" .sh): no Python $version found (python$version on PATH or under pyenv)" >&2
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

# apt_install PACKAGE...: install those of the Debian packages that are missing (as root, else through sudo).
apt_install() {
    local missing=() package sudo=""
    for package in "$@"; do
        dpkg -s "$package" >/dev/null 2>&1 || missing+=("$package")
    done
    [ ${#missing[@]} -gt 0 ] || return 0
    [ "$(id -u)" -eq 0 ] || sudo=sudo
    echo "setup: installing ${missing[*]}"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" 2>&1 >/dev/null |
        { grep -v "^debconf: delaying package configuration, since apt-utils is not installed" >&2 || true; }
}
