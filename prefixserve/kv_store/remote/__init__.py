"""KV tiers shared across hosts (issue 39): blocks on Redis or Valkey.

- `lookup.py`: `RemoteLookup`, the read-only face of one namespace on the server (keys, the
  pipelined EXISTS lookup, the hosts' seed read, faults as misses with a back-off); the cluster
  router opens one to price what the server holds (cluster/remote_probe.py).
- `redis_tier.py`: `RedisTier`, the engine's tier on it (loads, the bounded writer, the seed
  created once and put back after a restart).

`--kv-remote URL` (`KVStoreConfig.remote_url`) opens one beside the disk tier, or alone
(`open_tiers.open_engine_kv_store`): the connector looks there for the blocks after the disk's
run, loads from it what the disk misses, and writes it every block it writes to disk; the hosts
hash with the seed kept in the server (docs/shared-tier.md).
"""
