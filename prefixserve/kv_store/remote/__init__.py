"""KV tiers shared across hosts (issue 39): `redis_tier.py`, blocks on Redis or Valkey.

`--kv-remote URL` (`KVStoreConfig.remote_url`) opens one beside the disk tier
(`connector.open_engine_kv_store`): the connector looks there for the blocks after the disk's run,
loads from it what the disk misses, and writes it every block it writes to disk; the hosts hash
with the seed kept in the server. Still to come: one tier interface for disk and shared tiers,
the tier with the disk tier off, its own load-or-compute measure, cache reports and metrics that
name it, and the router's view of it (docs/shared-tier.md).
"""
