#!/usr/bin/env bash
# Build llama.cpp's own server, `llama-server` ($PEERS_DIR/llama_server/bin/llama-server), from the
# llama.cpp tree vendored in the llama-cpp-python sdist that setup_llama_cpp.sh unpacked (the
# same ggml and llama.cpp as that peer's library), and use that script's bf16 GGUF.
#
#   scripts/peers/setup_llama_cpp.sh && scripts/peers/setup_llama_server.sh
#
# llama-cpp-python's server renders no OpenAI tools with the model's template and parses no
# Hermes calls; llama-server does both (`--jinja`: the chat template through minja, tools and
# the tool-call parsers of common/chat.cpp). Built for this CPU (GGML_NATIVE), without the web UI
# (no download at build time) and without OpenSSL (the server is only ever on 127.0.0.1). Only
# the llama-server target is built: about 10 minutes on 2 cores (`nice` keeps it out of the way
# of a measurement that is running).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
require_llama_src tools/server/server.cpp

OUT="$PEERS_DIR/llama_server"
BUILD="$OUT/build"
start=$SECONDS

if [[ ! -x "$OUT/bin/llama-server" || ! -f "$OUT/.installed-$LLAMA_CPP_VERSION" ]]; then
    log "building llama-server from llama-cpp-python $LLAMA_CPP_VERSION's llama.cpp"
    mkdir -p "$BUILD" "$OUT/bin"
    nice -n 19 cmake -S "$LLAMA_SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF >"$OUT/cmake.log"
    nice -n 19 cmake --build "$BUILD" --target llama-server -j "${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
        >"$OUT/build.log"
    cp "$BUILD/bin/llama-server" "$OUT/bin/llama-server"
    touch "$OUT/.installed-$LLAMA_CPP_VERSION"
    log "llama-server built ($((SECONDS - start)) s)"
fi
"$OUT/bin/llama-server" --version 2>&1 | head -n 2 >&2
printf '%s\n' "$OUT/bin/llama-server"
