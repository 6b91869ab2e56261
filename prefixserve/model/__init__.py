"""The model side, torch: `models/` (the families and their registry), `layers/` (linears,
attention, rotary, norms, the native decoder layer), `loader/` (HF directories, safetensors, GGUF
conversion, the packaged default model), `kernels/` (the native CPU kernels in `csrc/`, their
build, the host's calibration, the paths per CPU kind, huge pages), `quant/` (8-bit KV rows,
8- and 4-bit weight formats), `config.py` (`ModelConfig`), `tokenizer.py`, `errors.py`.

Imports `core/kv_cache/spec.py` (the KV-cache specs a model declares) and the root's records;
never the scheduler, the engine, the worker or the server.
"""
