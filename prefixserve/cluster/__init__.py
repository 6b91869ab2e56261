"""Engine replicas behind one endpoint, routed by where each prompt's prefix is cached.

Pure Python below the Ray layer, in the order the data flows:
- `messages.py`: what replicas and the router exchange (registration, event batches, snapshots).
- `event_log.py`: a replica's side: numbers its KV-event batches, keeps a bounded ring for
  replays and a mirror of its cached blocks for snapshots.
- `index.py`: the router's side: keys it computes itself from the events' token ids and parent
  chains, per replica, with gap detection, replays and snapshots.
- `policy.py`: which replica gets a request (prefix-aware cost, round-robin, least-loaded,
  power-of-two choices, an approximate prefix tree).
- `replica.py`, `ray_cluster.py`, `client.py`: the Ray actors, their start-up, and the engine
  client the OpenAI server (server/) runs on instead of one in-process engine.
"""
