"""torch's side of a step: `model_runner.py` (SchedulerOutput -> tensors -> forward ->
sampled tokens) and `sample/` (the sampler and speculative decoding's verification rows and
acceptance, together).

May import `model/`, `lora/`, `kv_store/` (moving bytes), `inputs/` (prompt embeddings' rows),
`core/` records; never the engine.
"""
