"""The scheduler and what it decides with: `scheduler.py` (the step plan), `output.py` (the
records a step passes between the scheduler and the worker), `fair_share.py` (tenants' shares),
`prefix_order.py` (the order within a tenant's queue), `prefill_dedup.py` (waiting for a
running prefill of the same prefix), `step_results.py` (what sampled tokens do: stops, counters),
`spec_metrics.py` (speculation's acceptance rates), `interfaces.py` (what the scheduler asks of
a tier connector and a draft proposer, as protocols the rooms above implement).

May import `core/kv_cache/`, `core/request.py` and `config.py`; never `kv_store/` or
`spec_decode/` (they implement `interfaces.py`), nor anything above them.
"""
