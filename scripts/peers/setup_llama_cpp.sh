#!/usr/bin/env bash
# Install llama-cpp-python's OpenAI server in its own venv ($PEERS_DIR/llama_cpp) and make a GGUF
# of the default model's bf16 weights ($PEERS_DIR/gguf/<model>-bf16.gguf).
#
#   scripts/peers/setup_llama_cpp.sh         # then: $PEERS_DIR/llama_cpp/bin/python -m llama_cpp.server ...
#
# llama-cpp-python is built from source (about 6 minutes on 2 cores). Its server needs
# sse-starlette, starlette-context and pydantic-settings. convert_hf_to_gguf.py ships only in the
# sdist (vendor/llama.cpp/), so the sdist is downloaded and unpacked for it; it needs sentencepiece
# and the gguf package from that same tree. Set PREFIXSERVE_MODEL_DIR to convert another HF dir.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

LLAMA_CPP_VERSION="${LLAMA_CPP_VERSION:-0.3.36}"
VENV="$PEERS_DIR/llama_cpp"
SRC="$PEERS_DIR/src"
mkdir -p "$PEERS_DIR" "$SRC" "$PEERS_DIR/gguf"
start=$SECONDS

# The sdist is fetched once: it is both what gets built and where convert_hf_to_gguf.py lives.
new_venv "$VENV"
SDIST="$SRC/llama_cpp_python-$LLAMA_CPP_VERSION.tar.gz"
if [[ ! -f "$SDIST" ]]; then
    log "fetching the llama-cpp-python $LLAMA_CPP_VERSION sdist"
    "$VENV/bin/pip" download -q --no-deps --no-binary :all: -d "$SRC" \
        "llama-cpp-python==$LLAMA_CPP_VERSION"
fi
CONVERTER="$SRC/llama_cpp_python-$LLAMA_CPP_VERSION/vendor/llama.cpp/convert_hf_to_gguf.py"
[[ -f "$CONVERTER" ]] || tar -xzf "$SDIST" -C "$SRC"

if [[ ! -f "$VENV/.installed-$LLAMA_CPP_VERSION" ]]; then
    log "building llama-cpp-python==$LLAMA_CPP_VERSION from source (about 6 minutes)"
    CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
        "$VENV/bin/pip" install -q "$SDIST" sse-starlette starlette-context pydantic-settings \
        uvicorn fastapi
    "$VENV/bin/python" -c 'import llama_cpp, llama_cpp.server.app; print("llama_cpp", llama_cpp.__version__)'
    touch "$VENV/.installed-$LLAMA_CPP_VERSION"
    log "llama-cpp-python built ($((SECONDS - start)) s)"
fi

LLAMA_SRC="$(dirname "$CONVERTER")"
if ! "$VENV/bin/python" -c 'import sentencepiece, gguf, transformers, torch' 2>/dev/null; then
    log "installing the converter's needs (sentencepiece, transformers, torch CPU, gguf-py)"
    "$VENV/bin/pip" install -q "torch==2.13.0"
    "$VENV/bin/pip" install -q sentencepiece "transformers>=4.50,<5" "$LLAMA_SRC/gguf-py"
fi

MODEL_DIR="$(default_model_dir)"
OUT="$PEERS_DIR/gguf/$(basename "$MODEL_DIR")-bf16.gguf"
if [[ ! -f "$OUT" || "$MODEL_DIR" -nt "$OUT" ]]; then
    log "converting $MODEL_DIR -> $OUT (bf16)"
    "$VENV/bin/python" "$CONVERTER" "$MODEL_DIR" --outtype bf16 --outfile "$OUT"
fi
log "llama.cpp peer ready ($((SECONDS - start)) s): $OUT"
printf '%s\n' "$OUT"
