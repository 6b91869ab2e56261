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


def save_with_default_tokenizer(config: object, path: object) -> object:
    """A random-weight transformers model of `config` (seed 0) saved at `path` with the default
    model's tokenizer files beside it, so prefixserve loads it like a real checkpoint. Set
    `config.vocab_size` to `default_vocab_size()`."""
    import shutil
    from pathlib import Path

    import torch
    import transformers

    from prefixserve.model.loader.default_model import ensure_default_model

    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(
        path, safe_serialization=True
    )
    default = ensure_default_model()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(default / name, Path(path) / name)
    return path


def default_vocab_size() -> int:
    """The packaged default model's vocabulary size (what its tokenizer produces)."""
    import transformers

    from prefixserve.model.loader.default_model import ensure_default_model

    return int(transformers.AutoConfig.from_pretrained(ensure_default_model()).vocab_size)
