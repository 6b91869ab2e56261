"""Why a prompt missed, and what the cache holds: per-request cache reports and the operators'
summary.

- `report.py`: the reasons vocabulary and the `CacheReport` record;
- `ghost.py`: a bounded memory of recently evicted block hashes (`evicted` vs `never_seen`);
- `recorder.py`: what the pool does to each block (who cached it, its parent, hits, last use,
  evictions), fed by `BlockPool`'s observer calls;
- `explain.py`: one request's report, from the pool, the ghosts, the tenant's other namespaces
  and the disk tier's stat-only probe;
- `summary.py`: the cache-wide summary (occupancy by tenant, top prefixes, the prefix tree).

Pure Python, like the rest of `core/`: imports only `core/kv_cache/` and `core/request.py`.
"""
