#!/usr/bin/env bash
# Install llama-cpp-python's OpenAI server in its own venv ($PEERS_DIR/llama_cpp) and make a GGUF
# of the default model's bf16 weights ($PEERS_DIR/gguf/<model>-bf16.gguf), and its Q8_0 and
# Q4_K_M quantizations by llama.cpp (<model>-Q8_0.gguf, <model>-Q4_K_M.gguf).
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
    # The default model's tokenizer.json (rebuilt from a GGUF by transformers) is a byte-level
    # BPE flagged byte_fallback with a Sequence decoder: convert_hf_to_gguf.py then takes it for
    # a SentencePiece (Llama) vocabulary and writes a GGUF whose tokenizer crashes llama.cpp at
    # the first request ("unordered_map::at"). The conversion reads a view of the model dir
    # whose tokenizer.json says what it is: byte-level BPE as in SmolLM2's own tokenizer.json.
    VIEW="$PEERS_DIR/gguf/$(basename "$MODEL_DIR")-view"
    rm -rf "$VIEW" && mkdir -p "$VIEW"
    for f in "$MODEL_DIR"/*; do
        [[ "$(basename "$f")" == tokenizer.json ]] || ln -s "$f" "$VIEW/"
    done
    "$VENV/bin/python" - "$MODEL_DIR/tokenizer.json" "$VIEW/tokenizer.json" <<'PY'
import json, sys
tok = json.load(open(sys.argv[1], encoding="utf-8"))
if tok["model"]["type"] == "BPE" and (tok.get("pre_tokenizer") or {}).get("type") == "ByteLevel":
    tok["model"]["byte_fallback"] = False
    tok["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                      "use_regex": True}
    # SmolLM's pre-tokenizer splits digits one by one before the byte-level split; the GGUF
    # round trip lost that, and convert_hf_to_gguf.py recognises the vocabulary ("smollm") by
    # how it pre-tokenizes a test text.
    tok["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ]}
    # Nor does its tokenizer.json put a BOS (<|im_start|>) before every text. The converter
    # writes add_bos_token=false for "smollm" whatever we say, so llama.cpp's prompts are one
    # token shorter than the token-id prompts the other engines get (which carry that BOS).
    tok["post_processor"] = None
json.dump(tok, open(sys.argv[2], "w", encoding="utf-8"), ensure_ascii=False)
PY
    log "converting $MODEL_DIR -> $OUT (bf16)"
    "$VENV/bin/python" "$CONVERTER" "$VIEW" --outtype bf16 --outfile "$OUT"
fi
# The files llama.cpp's users run, quantized from that bf16 file by llama.cpp itself
# (llama_model_quantize): Q8_0 and Q4_K_M, beside it.
for QTYPE in Q8_0 Q4_K_M; do
    QOUT="${OUT%-bf16.gguf}-$QTYPE.gguf"
    if [[ ! -f "$QOUT" || "$OUT" -nt "$QOUT" ]]; then
        log "quantizing $OUT -> $QOUT"
        "$VENV/bin/python" - "$OUT" "$QOUT" "$QTYPE" <<'PY'
import ctypes, sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{sys.argv[3]}")
params.nthread = 2
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(),
                                        ctypes.byref(params)))
PY
    fi
done
log "llama.cpp peer ready ($((SECONDS - start)) s): $OUT"
printf '%s\n' "$OUT"
