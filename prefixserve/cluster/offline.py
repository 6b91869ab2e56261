"""The offline API over replicas: `LLM(..., num_replicas=N)` runs its prompts through this.

`generate` is synchronous, so each call runs one event loop (`asyncio.run`) that sends every
prompt through the `ClusterEngine` (routed, as the server's requests are) and gathers the
finished outputs in input order. The event feeds of the replicas live in that loop; the next
call's loop subscribes them again from where the router's index stands.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from typing import Any

from tqdm.auto import tqdm

from prefixserve.outputs import RequestOutput


def run_items(
    cluster: Any,
    items: Sequence[tuple[Any, ...]],
    request_ids: Iterator[str],
    use_tqdm: bool,
    cache_retention: str | None,
) -> list[RequestOutput]:
    """Each (token ids, text, salt, params, LoRA request, embeddings) item's final output."""
    bar = tqdm(total=len(items), desc="Processed prompts", disable=not use_tqdm)

    async def one(item: tuple[Any, ...]) -> RequestOutput:
        ids, text, salt, params, lora, embeds = item
        stream = await cluster.add_request(
            next(request_ids),
            ids,
            params,
            cache_salt=salt,
            prompt=text,
            cache_retention=cache_retention,
            lora_request=lora,
            prompt_embeds=embeds,
        )
        final = None
        async for output in stream:
            final = output
        if final is None or not final.finished:
            raise RuntimeError(f"request {stream.request_id} was aborted before it finished")
        bar.update(1)
        return final

    async def run_all() -> list[RequestOutput]:
        return list(await asyncio.gather(*(one(item) for item in items)))

    try:
        return asyncio.run(run_all())
    finally:
        bar.close()
