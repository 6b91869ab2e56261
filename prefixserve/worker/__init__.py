"""torch's side of a step: `model_runner.py` (SchedulerOutput -> tensors -> forward ->
sampled tokens) and `sampler.py`.

May import `model/`, `lora/`, `kv_store/` (moving bytes), `core/` records; never the engine.
"""
