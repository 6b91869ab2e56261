# Shared settings for the peer setup scripts (sourced, not run).
# Every peer lives in its own virtual environment under $PEERS_DIR so it never touches the
# project's .venv. Override the location with PREFIXSERVE_PEERS_DIR.
set -euo pipefail

PEERS_DIR="${PREFIXSERVE_PEERS_DIR:-$HOME/.cache/prefixserve/peers}"
PYTHON="${PYTHON:-python3.11}"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

log() { printf '[%s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

# new_venv DIR: create DIR as a fresh venv with an up-to-date pip (idempotent).
new_venv() {
    local dir="$1"
    if [[ ! -x "$dir/bin/python" ]]; then
        log "creating venv $dir"
        "$PYTHON" -m venv "$dir"
    fi
    "$dir/bin/pip" install -q --upgrade pip
}

# default_model_dir: the bf16 HF directory of the packaged default model, made on first use
# by the project's own conversion (prefixserve.model.loader.default_model.ensure_default_model).
default_model_dir() {
    if [[ -n "${PREFIXSERVE_MODEL_DIR:-}" ]]; then
        printf '%s\n' "$PREFIXSERVE_MODEL_DIR"
        return
    fi
    "$REPO_ROOT/.venv/bin/python" -c \
        'from prefixserve.model.loader.default_model import ensure_default_model as e; print(e())'
}

# The llama.cpp tree inside llama-cpp-python's sdist that setup_llama_cpp.sh unpacks
# ($LLAMA_CPP_VERSION, default 0.3.36); exits naming that script when FILE (a path inside the
# tree) is missing. Sets LLAMA_CPP_VERSION and LLAMA_SRC.
require_llama_src() {
    LLAMA_CPP_VERSION="${LLAMA_CPP_VERSION:-0.3.36}"
    LLAMA_SRC="$PEERS_DIR/src/llama_cpp_python-$LLAMA_CPP_VERSION/vendor/llama.cpp"
    if [[ ! -f "$LLAMA_SRC/$1" ]]; then
        log "no llama.cpp tree at $LLAMA_SRC: run scripts/peers/setup_llama_cpp.sh first"
        exit 1
    fi
}
