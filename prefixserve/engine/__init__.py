"""The engine shell: its parts built through their constructors (`builder.py`), the step loop
(`llm_engine.py`), the same loop on its own thread for asyncio callers (`async_llm.py`,
`request_stream.py`, `stats_log.py`), the interface every engine client offers the server
(`client.py`: `EngineClient`, `EngineRequest`), what comes in (`input_processor.py`,
`input_checks.py`; prompt embeddings are `inputs/`'s), what goes out (`output_processor.py`,
`metrics.py`) and the operator's controls (`operator_controls.py`: summary, explain, reset,
pins).

May import `core/`, `worker/`, `model/`, `kv_store/`, `lora/`, `spec_decode/`, `inputs/` and the
root's records and config; never `entrypoints/` or `cluster/`.
"""
