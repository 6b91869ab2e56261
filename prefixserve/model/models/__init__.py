"""The decoder families (`llama.py`, `qwen3.py`, `gemma3.py`) and the architecture registry.

May import `model/layers/`, `model/config.py`, `model/kernels/`.
"""
