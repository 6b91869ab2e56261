"""From files to a model: Hugging Face directories (`hf_dir.py`, `hf_config.py`), safetensors
weights (`weights.py`), GGUF conversion (`gguf_convert.py`, `gguf_tokenizer.py`), the packaged
default model (`default_model.py`), and `loading.py`'s `load_model` over them.

May import `model/models/`, `model/config.py`, `model/tokenizer.py`.
"""
