"""prefixserve: an LLM serving engine built around automatic prefix caching.

    from prefixserve import LLM, SamplingParams
    outputs = LLM().generate(["Hello"], SamplingParams(temperature=0.0))

`LLM` is imported lazily, so `import prefixserve.core.kv_cache` (pure Python) stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prefixserve import settings

settings.default_omp_wait_policy()  # before anything imports torch

from prefixserve.lora.config import LoRARequest  # noqa: E402
from prefixserve.outputs import CompletionOutput, RequestOutput  # noqa: E402
from prefixserve.sampling_params import SamplingParams  # noqa: E402

if TYPE_CHECKING:
    from prefixserve.llm import LLM

__all__ = ["LLM", "CompletionOutput", "LoRARequest", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from prefixserve.llm import LLM

        return LLM
    raise AttributeError(f"module 'prefixserve' has no attribute {name!r}")
