"""What is computed and what is reused, in pure Python (no torch, no model, no server):
`request.py`, the scheduler and its records (`sched/`), and the prefix cache's blocks, hashes,
pins and eviction policies (`kv_cache/`).

May import the root's records and config (`sampling_params`, `outputs`, `config`, `settings`)
and `spec_decode/` for its proposer's interface; nothing else of the package.
"""
