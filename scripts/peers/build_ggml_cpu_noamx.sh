#!/usr/bin/env bash
# Build ggml's CPU backend without AMX ($PEERS_DIR/ggml_cpu_noamx/libggml-cpu.so.0) from the
# llama.cpp tree of the llama-cpp-python sdist that setup_llama_cpp.sh unpacked: the same ggml as
# that peer's library, built for this CPU (GGML_NATIVE) with the AMX instructions turned off.
#
#   scripts/peers/setup_llama_cpp.sh && scripts/peers/build_ggml_cpu_noamx.sh
#   benchmarks/bench_model.py ... --llama-cpp --llama-cpp-ggml-cpu "$PEERS_DIR/ggml_cpu_noamx/libggml-cpu.so.0"
#
# Why: on a host with AMX (Intel Xeon 4th gen and later) the peer's native build puts Q4_0, Q8_0
# and the K-quants' weights in ggml's AMX buffer type, and on the 2-core Xeon VM measured here
# every quantized file then dies with SIGSEGV in libggml-cpu.so (bf16 files run: AMX takes no
# bf16 weights). Without AMX ggml keeps its other repacked layouts (CPU_REPACK), what llama.cpp
# runs on an AVX-512 CPU without AMX. bench_model.py preloads the library into llama.cpp's process
# only (LD_PRELOAD: the venv's libllama.so then finds this libggml-cpu.so.0 already loaded); the
# peer's venv is not touched. Only the ggml-cpu target is built: a few minutes on 2 cores.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
require_llama_src ggml/src/ggml-cpu/ggml-cpu.c

OUT="$PEERS_DIR/ggml_cpu_noamx"
BUILD="$OUT/build"
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
start=$SECONDS

if [[ ! -f "$OUT/libggml-cpu.so.0" || ! -f "$OUT/.installed-$LLAMA_CPP_VERSION" ]]; then
    log "building ggml-cpu without AMX from llama-cpp-python $LLAMA_CPP_VERSION's llama.cpp"
    mkdir -p "$BUILD"
    nice -n 19 cmake -S "$LLAMA_SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
        "-DCMAKE_C_FLAGS=$NO_AMX" "-DCMAKE_CXX_FLAGS=$NO_AMX" >"$OUT/cmake.log"
    nice -n 19 cmake --build "$BUILD" --target ggml-cpu -j "${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
        >"$OUT/build.log"
    cp -L "$BUILD/bin/libggml-cpu.so.0" "$OUT/libggml-cpu.so.0"
    touch "$OUT/.installed-$LLAMA_CPP_VERSION"
    log "ggml-cpu without AMX built ($((SECONDS - start)) s)"
fi
printf '%s\n' "$OUT/libggml-cpu.so.0"
