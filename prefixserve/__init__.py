"""prefixserve: an LLM serving engine built around automatic prefix caching.

    from prefixserve import LLM, SamplingParams
    outputs = LLM().generate(["Hello"], SamplingParams(temperature=0.0))

`LLM` is imported lazily, so `import prefixserve.kv_cache` (pure Python) stays light.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# OpenMP threads that spin while waiting make small matmuls 10-50x slower whenever the cores are
# shared with anything else; libgomp reads this once, when torch loads. Users may override it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from prefixserve.outputs import CompletionOutput, RequestOutput
from prefixserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from prefixserve.llm import LLM

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from prefixserve.llm import LLM

        return LLM
    raise AttributeError(f"module 'prefixserve' has no attribute {name!r}")
