"""The offline API over replicas: `LLM(..., num_replicas=N)` runs its prompts through this.

`generate` is synchronous, so each call runs one event loop (`asyncio.run`) that sends every
prompt through the `ClusterEngine` (routed, as the server's requests are) and gathers the
finished outputs in input order. The event feeds of the replicas live in that loop; the next
call's loop subscribes them again from where the router's index stands.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

from tqdm.auto import tqdm

from prefixserve.engine.client import EngineClient, EngineRequest
from prefixserve.outputs import RequestOutput


def run_requests(
    cluster: EngineClient, requests: Sequence[EngineRequest], use_tqdm: bool
) -> list[RequestOutput]:
    """Each request's final output, in order."""
    bar = tqdm(total=len(requests), desc="Processed prompts", disable=not use_tqdm)

    async def one(request: EngineRequest) -> RequestOutput:
        # Only the final output is returned: one whose replica dies starts over on another.
        stream = await cluster.add_request(dataclasses.replace(request, final_only=True))
        final = None
        async for output in stream:
            final = output
        if final is None or not final.finished:
            raise RuntimeError(f"request {stream.request_id} was aborted before it finished")
        bar.update(1)
        return final

    async def run_all() -> list[RequestOutput]:
        return list(await asyncio.gather(*(one(request) for request in requests)))

    try:
        return asyncio.run(run_all())
    finally:
        bar.close()
