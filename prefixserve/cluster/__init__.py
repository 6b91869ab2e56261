"""Engine replicas behind one endpoint, routed by where each prompt's prefix is cached.

Pure Python below the Ray layer, in the order the data flows:
- `messages.py`: what replicas and the router exchange (registration, event batches, snapshots).
- `event_log.py`: a replica's side: numbers its KV-event batches, keeps a bounded ring for
  replays and a mirror of its cached blocks for snapshots.
- `index.py`: the router's side: keys it computes itself from the events' token ids and parent
  chains, per replica, with gap detection, replays and snapshots.
- `policy.py`: which replica gets a request (prefix-aware cost, round-robin, least-loaded,
  power-of-two choices, an approximate prefix tree).
- `route_inputs.py`: what the router hashes of a prompt (salt, adapter, embeddings' digests).
- `router.py`: the decision: each replica's held blocks (the index), the blocks it could load
  from a shared disk store (`store_probe.py`) or the shared tier (`remote_probe.py`, the seed
  of the replicas' key file), its load, then the policy.
- `replica.py`, `ray_cluster.py`, `event_feed.py`, `client.py`: the Ray actors, their start-up,
  the feed of their KV events to the index, and the engine client (`ClusterEngine`) the HTTP
  server (entrypoints/) runs on instead of one in-process engine; `offline.py` the same for
  `LLM(num_replicas=...)`, `options.py` the flags.

Imports `core/kv_cache/`, `kv_store/` (stat-only lookups), `inputs/`, `lora/`, the model's
loader (its config and tokenizer only) and the engine's client side (`engine/client.py`, its
errors, streams, metrics kinds and summary merge); the step loop only inside `replica.py`'s
function that builds one, and Ray only inside functions (importing `cluster/` imports neither).
"""
