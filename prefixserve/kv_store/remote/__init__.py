"""KV tiers shared across hosts (issue 39): `redis_tier.py`, blocks on Redis or Valkey.

Not yet wired into the engine's connector: the tier is built and tested against a real server
(tests/kv_store/test_redis_tier.py); the connector's cascade RAM -> disk -> shared tier, the
`--kv-remote` flag and the router's view of it come next (docs/architecture.md).
"""
