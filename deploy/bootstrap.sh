#!/usr/bin/env bash
# Bootstrap what `make demo` and `make test` need on a fresh machine.
#   deploy/bootstrap.sh venv        create .venv and install peertrain with the pinned torch (constraints.txt)
#   deploy/bootstrap.sh data        make sure the Fashion-MNIST IDX files exist (Debian: dataset-fashion-mnist)
#   deploy/bootstrap.sh prometheus  make sure prometheus and promtool exist (Debian: prometheus), for the tests
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
DATA_DIR=${PEERTRAIN_FASHION_MNIST:-/usr/share/datasets/fashion-mnist}

apt_install() {
    # Installs Debian packages when this user may; returns non-zero otherwise.
    local sudo=""
    if [ "$(id -u)" != "0" ]; then
        command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null || return 1
        sudo="sudo -n"
    fi
    command -v apt-get >/dev/null 2>&1 || return 1
    echo "bootstrap: installing Debian package(s) $* ..."
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q "$@" >/dev/null 2>&1 \
        || { DEBIAN_FRONTEND=noninteractive $sudo apt-get update -q >/dev/null 2>&1 \
             && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q "$@" >/dev/null 2>&1; }
}

venv() {
    if ! command -v "$PYTHON" >/dev/null 2>&1; then
        echo "bootstrap: $PYTHON not found; peertrain needs Python 3.11 (set PYTHON=... to choose one)" >&2
        exit 1
    fi
    if [ ! -x .venv/bin/python ]; then
        echo "bootstrap: creating .venv with $PYTHON"
        "$PYTHON" -m venv .venv
    fi
    echo "bootstrap: installing peertrain and its pinned dependencies into .venv (torch: CPU build unless already present)"
    if ! install_with_uv; then
        echo "bootstrap: uv could not install them; installing with pip (slower)"
        # The venv's own pip (Python 3.11's: editable installs from pyproject.toml) is enough: no self-upgrade first.
        .venv/bin/python -m pip install -q -c constraints.txt -e '.[dev]'
    fi
    touch .venv/.installed
}

pip_setting() {
    # The value pip would use for setting $1 (its environment's first, then its configuration files'); empty if none.
    .venv/bin/python -m pip config list 2>/dev/null | sed -n "s/^[^.]*\.$1='\(.*\)'\$/\1/p" | head -n 1
}

install_with_uv() {
    # uv installs and byte-compiles on every core: about 30 s where pip takes 80 s on 2 cores. It does not read pip's
    # configuration, so the indexes, local wheels and constraints pip would use are passed on, and like pip it takes
    # the best version across all of them (unsafe-best-match). Any failure falls back to pip.
    .venv/bin/python -m pip install -q uv >/dev/null 2>&1 || return 1
    local args=(--python .venv/bin/python --compile-bytecode --index-strategy unsafe-best-match -c constraints.txt)
    local value
    value=$(pip_setting index-url)
    if [ -n "$value" ]; then args+=(--index-url "$value"); fi
    for value in $(pip_setting extra-index-url); do args+=(--extra-index-url "$value"); done
    for value in $(pip_setting find-links); do args+=(--find-links "$value"); done
    for value in $(pip_setting constraint); do args+=(-c "$value"); done
    .venv/bin/uv pip install -q "${args[@]}" -e '.[dev]'
}

data() {
    local ok=1
    for f in train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte; do
        [ -e "$DATA_DIR/$f" ] || [ -e "$DATA_DIR/$f.gz" ] || ok=0
    done
    [ "$ok" = 1 ] && return 0
    if [ "$DATA_DIR" = /usr/share/datasets/fashion-mnist ] && apt_install dataset-fashion-mnist; then
        return 0
    fi
    cat >&2 <<MSG
bootstrap: the Fashion-MNIST IDX files are missing from $DATA_DIR.
  Install Debian's package 'dataset-fashion-mnist' (sudo apt-get install dataset-fashion-mnist),
  or put train-images-idx3-ubyte(.gz), train-labels-idx1-ubyte(.gz), t10k-images-idx3-ubyte(.gz) and
  t10k-labels-idx1-ubyte(.gz) in a directory and name it here with PEERTRAIN_FASHION_MNIST=DIR, and to the agents
  with --data-dir fashion-mnist=DIR (docs/operations.md, "Data on the agents").
MSG
    exit 1
}

prometheus() {
    command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 && return 0
    apt_install prometheus || echo "bootstrap: could not install Debian's 'prometheus'; the Prometheus scrape test will be skipped" >&2
    # Debian starts the service on install; the tests run their own server on a free port.
    return 0
}

for step in "$@"; do "$step"; done
