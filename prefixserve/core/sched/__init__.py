"""The scheduler and what it decides with: `scheduler.py` (the step plan), `output.py` (the
records a step passes between the scheduler and the worker), `fair_share.py` (tenants' shares),
`prefix_order.py` (the order within a tenant's queue), `prefill_dedup.py` (waiting for a
running prefill of the same prefix), `step_results.py` (what sampled tokens do: stops, counters).

May import `core/kv_cache/`, `core/request.py`, `kv_store/` (the scheduler side of the disk
tier) and `spec_decode/`.
"""
