"""Helpers shared by the tests, one module per subject; import them as `tests.helpers.<module>`
(the checkout's root is on sys.path through `pythonpath` in pyproject.toml's pytest section).

- here: `random_tokens`, `common_prefix`, `free_port` (standard library only);
- `models`: the tiny random-weight transformers models (`build_hf_model`, the one builder, and
  `tiny_llama_dir`, the model the cluster and server-combination tests serve) and our model over
  the same weights;
- `runner`: a ModelRunner harness (recording sampler, block ids, steps) and `greedy_generate`;
- `scheduler`: the real Scheduler over a fake model that hashes what its block tables read;
- `kv_cache`: requests, a KVCacheManager and its snapshot for the cache-core tests;
- `kv_store`: keys, token ids and payloads for the disk-tier tests;
- `valkey`: a real Valkey server on a unix socket, started and stopped by PID (the shared tier);
- `lora`: PEFT adapters of the tiny models and our engine around them;
- `server`: a live OpenAI server (uvicorn in a thread) and its constants;
- `asgi`: a stand-in engine and raw ASGI calls for server tests without a model;
- `cluster`: stand-in replicas and a ClusterEngine over them, and a real replica's engine config;
- `router`: block hashes and BlockStored events as a replica's engine makes them;
- `bench`: made-up words and a byte-level BPE trained on them (the benchmark tests' tokenizer);
- `stub_openai`: a fake OpenAI completions server for the benchmark client (also a script).
"""

from __future__ import annotations

import random
import socket


def random_tokens(n: int, seed: int) -> list[int]:
    """`n` reproducible token ids in [1000, 20000): inside every packaged model's vocabulary."""
    rng = random.Random(seed)
    return [rng.randrange(1000, 20000) for _ in range(n)]


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
