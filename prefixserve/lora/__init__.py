"""LoRA adapters: `config.py` (LoRAConfig, LoRARequest), `adapter.py` (a PEFT directory, checked
against the model), `layers.py` (the step's rows per adapter, the low-rank update of a linear),
`manager.py` (the engine's loaded adapters)."""
