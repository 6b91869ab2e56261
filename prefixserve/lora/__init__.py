"""LoRA adapters: `config.py` (LoRARequest; LoRAConfig is in `prefixserve/config.py`),
`adapter.py` (a PEFT directory, checked against the model), `layers.py` (the step's rows per
adapter, the low-rank update of a linear), `manager.py` (the engine's loaded adapters)."""
