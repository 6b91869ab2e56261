"""Eviction policies: which free cached block the pool reuses first. `policies.py` names them
(`lru.py`, the default free queue; `slru.py`; `cost_aware.py`) and builds one for the pool.

Imports nothing of the package outside `core/kv_cache/`.
"""
