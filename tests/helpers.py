"""Small helpers shared by tests in every folder (tests/ is on sys.path through conftest.py)."""

from __future__ import annotations

import random
import socket


def random_tokens(n: int, seed: int) -> list[int]:
    """`n` reproducible token ids in [1000, 20000): inside every packaged model's vocabulary."""
    rng = random.Random(seed)
    return [rng.randrange(1000, 20000) for _ in range(n)]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
