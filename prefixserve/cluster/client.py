"""`ClusterEngine`: the engine the OpenAI server runs on with `--replicas N`.

It is an `EngineClient` (engine/client.py), as `AsyncLLMEngine` is (pins excepted: refused with
`NotSupportedByEngine`), and behind it routes each request
to one replica (a Ray actor, `replica.py`) chosen by the router (`router.py`), streams that
replica's outputs back, and keeps the router's index current from every replica's event stream
(`event_feed.py`). Tokenization, chat templates and the API checks stay in the server's process;
the replica validates, schedules, computes and detokenizes, as one engine does.

A replica that dies: each of its requests whose reader has taken none of its outputs yet is sent
again to another replica from scratch (its unread partial output dropped: the reader never sees
the first attempt), and so is a request whose caller passes on only the final output
(`final_only`, the offline API), once (MAX_START_OVERS). The others end with
`ReplicaDiedError`, an `EngineDeadError`:
the server answers it with a 503 and Retry-After, or an SSE error event after the chunks it
sent. Ray restarts the replica and the feed registers it again.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from prefixserve.cluster.event_feed import EventFeed
from prefixserve.cluster.remote_probe import open_remote_probe
from prefixserve.cluster.route_inputs import PROBE_ARGS, LoraDigests, route_args
from prefixserve.cluster.router import NoReplicaError, Route, Router
from prefixserve.cluster.store_probe import open_store_probe
from prefixserve.config import EngineConfig
from prefixserve.engine.cache_summary import merge_summaries
from prefixserve.engine.client import MAX_BUFFERED_KV_EVENTS, EngineRequest, generate_outputs
from prefixserve.engine.exceptions import EngineDeadError, NotSupportedByEngine
from prefixserve.engine.metrics import combine_metrics
from prefixserve.engine.request_stream import ABORTED, Aborted, OutputQueue, RequestStream
from prefixserve.lora.config import LoRASlotsBusyError
from prefixserve.model.loader.loading import ModelInfo
from prefixserve.outputs import RequestOutput
from prefixserve.structured_output.errors import GrammarError

logger = logging.getLogger(__name__)

REPLICA_DIED = "the engine replica serving this request died after its outputs were read"
METRICS_TIMEOUT_S = 5.0
SYNC_TIMEOUT_S = 10.0  # the longest a request waits for the replicas' first snapshots
# Times a request starts over on another replica after the one serving it died: a request that
# kills every replica it meets (a crash it triggers) takes down two at most.
MAX_START_OVERS = 1
_PINS_NEED_ONE_ENGINE = "pinned prefixes need one engine; this server runs replicas (--replicas)"


class ReplicaDiedError(EngineDeadError):
    """The replica serving a request died after the request's reader had taken outputs it may
    have passed on (streamed): the request cannot start over on another replica unseen."""


class _ReadTrackingQueue(OutputQueue):
    """An OutputQueue that knows whether its reader has taken an output yet: until it has, the
    request can start over on another replica unseen. Put and read in the loop's thread."""

    __slots__ = ("taken",)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self.taken = False

    async def get(self) -> RequestOutput | BaseException | Aborted:
        item = await super().get()
        self.taken = self.taken or isinstance(item, RequestOutput)
        return item

    def start_over(self, final_only: bool) -> bool:
        """Drop the unread output so the request can start again from scratch; False (nothing
        dropped) when the reader took an output and may have passed it on (not `final_only`)."""
        with self._lock:
            if self.taken and not final_only:
                return False
            self._output = None
            self.unread_since = None
            return True


def _client_error(cause: ValueError) -> ValueError:
    """The replica's refusal as the caller should see it: its kind kept where the server answers
    it differently (busy adapter slots: a 429; a grammar that does not compile: its reason's
    code and metric), else a plain ValueError of its message."""
    if isinstance(cause, LoRASlotsBusyError):
        return LoRASlotsBusyError(str(cause))
    if isinstance(cause, GrammarError):
        return GrammarError(str(cause), cause.reason)
    return ValueError(str(cause))


class ClusterEngine:
    def __init__(
        self,
        handles: Sequence[Any],
        model: ModelInfo,
        config: EngineConfig,
        router: Router,
        *,
        drop_event_fraction: float = 0.0,
        collect_kv_events: bool = False,
        on_stop: Any = None,
    ) -> None:
        self.handles = list(handles)
        self.model = model
        self.config = config
        self.router = router
        self.drop_event_fraction = drop_event_fraction
        self.on_stop = on_stop  # called by shutdown() (ray_cluster: stop the actors and Ray)
        self.on_dead: Any = None  # the CLI's death watch; a cluster fails per replica instead
        # The replicas' events always feed the router; with this, /kv_events gets them too.
        self.collect_kv_events = collect_kv_events
        self._kv_events: collections.deque[tuple[int, Any]] = collections.deque(
            maxlen=MAX_BUFFERED_KV_EVENTS
        )
        self.feeds: list[EventFeed] = []
        self.retried_requests = 0
        self.failed_midstream = 0
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._routes: dict[str, Route] = {}
        self._feed_tasks: list[asyncio.Task[None]] = []
        self._feed_loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._lora_digests = LoraDigests()
        self._infos: dict[int, Any] = {}

    # ----------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Register every replica (blocking, once): one that does not fit fails here."""
        import ray

        if self._infos:
            return
        for info in ray.get([h.info.remote() for h in self.handles]):
            self.router.register(info)
            self._infos[info.replica_id] = info
        index = self.router.index
        infos = list(self._infos.values())
        remote = open_remote_probe(infos, index.block_size, index.hash_algo)
        self.router.remote_probe = remote
        # With a shared tier the replicas chain from its seed, and so do their disk files.
        shared = None if remote is None else remote.none_hash
        self.router.store_probe = open_store_probe(
            infos, index.block_size, index.hash_algo, none_hash=shared
        )

    def _ensure_feeds(self) -> None:
        """Start the replicas' event feeds in the running loop (again in a new loop: the offline
        API runs one per call; the index keeps what the old feeds applied)."""
        loop = asyncio.get_running_loop()
        if self._stopping or (self._feed_tasks and self._feed_loop is loop):
            return
        for task in self._feed_tasks:
            task.cancel()
        self._feed_tasks, self.feeds = [], []
        self._feed_loop = loop
        for rid, handle in enumerate(self.handles):
            feed = EventFeed(
                rid,
                handle,
                self.router,
                drop_fraction=self.drop_event_fraction,
                sink=self._keep_kv_events if self.collect_kv_events else None,
            )
            self.feeds.append(feed)
            self._feed_tasks.append(loop.create_task(feed.run()))

    async def _synced(self) -> None:
        """Until every feed applied its replica's first snapshot (at most SYNC_TIMEOUT_S)."""
        waits = [feed.synced.wait() for feed in self.feeds if not feed.synced.is_set()]
        if waits:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*waits), SYNC_TIMEOUT_S)

    def shutdown(self, timeout: float = 30.0) -> None:
        self._stopping = True
        for task in [*self._feed_tasks, *self._tasks.values()]:
            task.cancel()
        if self.router.remote_probe is not None:
            self.router.remote_probe.close()
        if self.on_stop is not None:
            self.on_stop()

    @property
    def is_running(self) -> bool:
        return not self._stopping and bool(self.router.index.replica_ids)

    @property
    def shutdown_requested(self) -> bool:
        return self._stopping

    async def wait_dead(self) -> BaseException:
        while not self._stopping:
            await asyncio.sleep(1.0)
        return EngineDeadError("the cluster was shut down")

    # ------------------------------------------------------------------ what it serves
    @property
    def tokenizer(self) -> Any:
        return self.model.tokenizer.with_chat_template(self.config.chat_template)

    @property
    def model_config(self) -> Any:
        return self.model.config

    @property
    def model_path(self) -> Path:
        return self.model.path

    @property
    def max_model_len(self) -> int:
        return min(info.max_model_len for info in self._infos.values())

    @property
    def num_kv_blocks(self) -> int:
        return sum(info.num_kv_blocks for info in self._infos.values())

    @property
    def enable_prompt_embeds(self) -> bool:
        return self.config.enable_prompt_embeds

    # ------------------------------------------------------------------------ requests
    async def add_request(self, request: EngineRequest) -> RequestStream:
        """Route and send a request; the replica's ValueError (a bad request) is raised here.
        `final_only`: the caller passes on only the final output, so the request starts over on
        another replica if its replica dies, whatever outputs were read."""
        self._ensure_feeds()
        await self._synced()
        request_id = request.request_id
        if request_id in self._tasks:
            raise ValueError(f"request id {request_id!r} is already in use")
        loop = asyncio.get_running_loop()
        queue = _ReadTrackingQueue(loop)
        accepted: asyncio.Future[None] = loop.create_future()
        lora = request.lora_request
        # Read off the event loop: an adapter's files are hashed once per version.
        digest = None
        if lora is not None:
            digest = await asyncio.to_thread(self._lora_digests.get, lora.lora_path)
        args = route_args(request, digest, self.model.config.torch_dtype)
        task = loop.create_task(self._serve(request, args, queue, accepted))
        self._tasks[request_id] = task
        task.add_done_callback(lambda _t: self._tasks.pop(request_id, None))
        try:
            await accepted
        except asyncio.CancelledError:
            task.cancel()
            raise
        return RequestStream(request_id, queue, self.abort)

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        return generate_outputs(self, request)

    def abort(self, request_id: str) -> None:
        task = self._tasks.get(request_id)
        route = self._routes.get(request_id)
        if route is not None:
            self.handles[route.replica_id].abort.remote(request_id)
        if task is not None:
            task.cancel()

    async def _serve(  # noqa: C901, PLR0915 - one request's retry state machine (route, stream, replica death, abort) reads best whole
        self,
        request: EngineRequest,
        route_kwargs: dict[str, Any],
        queue: _ReadTrackingQueue,
        accepted: asyncio.Future[None],
    ) -> None:
        from ray.exceptions import RayActorError, RayTaskError

        request_id, prompt_ids = request.request_id, request.prompt_token_ids

        excluded: set[int] = set()
        last: RequestOutput | None = None
        route: Route | None = None
        # The tiers' lookups (disk stats, a round trip to the shared tier) off the event loop,
        # once: a retry routes on the same runs.
        probed = None
        if self.router.probes_tiers:
            probe_args = {k: v for k, v in route_kwargs.items() if k in PROBE_ARGS}
            probed = await asyncio.to_thread(self.router.probe_tiers, **probe_args)
        try:
            while True:
                try:
                    route = self.router.route(exclude=excluded, probed=probed, **route_kwargs)
                except NoReplicaError as exc:
                    return self._fail(accepted, queue, last, EngineDeadError(str(exc)))
                self._routes[request_id] = route
                handle = self.handles[route.replica_id]
                stream = handle.generate.options(num_returns="streaming").remote(request)
                try:
                    async for ref in stream:
                        item = await ref
                        if item is None:
                            if not accepted.done():
                                accepted.set_result(None)
                            continue
                        self.router.first_output(route)
                        item.prompt_token_ids = prompt_ids
                        last = item
                        queue.put(item)
                        if item.finished:
                            return
                    return  # aborted on the replica (the finally ends the stream)
                except (RayActorError, RayTaskError) as exc:
                    cause = getattr(exc, "cause", None) if isinstance(exc, RayTaskError) else exc
                    if isinstance(cause, ValueError) and not accepted.done():
                        accepted.set_exception(_client_error(cause))
                        return
                    if isinstance(cause, EngineDeadError):
                        # Its step loop died but the process lives: Ray restarts it.
                        self._restart(route.replica_id)
                    elif not isinstance(exc, RayActorError):
                        return self._fail(accepted, queue, last, cause or exc)
                    self.router.finished(route)
                    if len(excluded) >= MAX_START_OVERS:
                        # Another replica died under it: the request itself may be what kills
                        # them, and each death restarts a replica, so it goes no further.
                        self.failed_midstream += 1
                        return self._fail(accepted, queue, last, ReplicaDiedError(REPLICA_DIED))
                    if last is not None and not queue.start_over(request.final_only):
                        self.failed_midstream += 1
                        return self._fail(accepted, queue, last, ReplicaDiedError(REPLICA_DIED))
                    logger.warning(
                        "replica %d failed before request %s's outputs reached its client; "
                        "sending it elsewhere from scratch (%s)",
                        route.replica_id,
                        request_id,
                        type(cause).__name__,
                    )
                    last = None
                    self.retried_requests += 1
                    excluded.add(route.replica_id)
        except asyncio.CancelledError:
            # The caller went away (abort, disconnect, shutdown, an offline batch that failed):
            # the replica must stop generating for nobody.
            if route is not None and not route.done:
                with contextlib.suppress(Exception):
                    self.handles[route.replica_id].abort.remote(request_id)
            raise
        except Exception as exc:  # noqa: BLE001 - whatever broke, the caller must hear of it
            logger.exception("request %s failed in the cluster client", request_id)
            self._fail(accepted, queue, last, exc)
        finally:
            if route is not None:
                self.router.finished(route)
            self._routes.pop(request_id, None)
            # Whatever ended this task, nobody may wait on it for ever.
            if not accepted.done():
                accepted.set_exception(EngineDeadError(f"request {request_id} was not taken"))
            with contextlib.suppress(RuntimeError):  # its loop is closing
                queue.put(ABORTED)  # a no-op after an end already put

    def _restart(self, replica_id: int) -> None:
        import ray

        logger.error("replica %d's engine died; restarting it", replica_id)
        with contextlib.suppress(Exception):
            ray.kill(self.handles[replica_id], no_restart=False)

    def _fail(
        self,
        accepted: asyncio.Future[None],
        queue: OutputQueue,
        last: RequestOutput | None,
        exc: BaseException,
    ) -> None:
        if not accepted.done():
            accepted.set_exception(exc)
            return
        if last is None or isinstance(exc, EngineDeadError):
            queue.put(exc)
            return
        for completion in last.outputs:
            completion.finish_reason = completion.finish_reason or "error"
        last.finished = True
        last.error = str(exc)
        queue.put(last)

    # ------------------------------------------------------------------------ operator
    async def _broadcast(self, method: str, *args: Any) -> list[Any]:
        calls = [getattr(h, method).remote(*args) for h in self.handles]
        return list(await asyncio.gather(*calls))

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, ram_only: bool = False
    ) -> bool:
        """Every replica's reset (each clears its disk tier's namespace too, unless
        `ram_only`); True when all succeeded."""
        return all(await self._broadcast("reset_prefix_cache", reset_running_requests, ram_only))

    async def load_lora_adapter(self, name: str, path: str) -> None:
        await self._broadcast("load_lora_adapter", name, path)

    def load_lora_adapter_now(self, name: str, path: str) -> None:
        """Load an adapter on every replica before serving (blocking; ValueError if it does
        not fit)."""
        import ray
        from ray.exceptions import RayTaskError

        try:
            ray.get([h.load_lora_adapter.remote(name, path) for h in self.handles])
        except RayTaskError as exc:
            raise ValueError(str(exc.cause if exc.cause is not None else exc)) from None

    async def unload_lora_adapter(self, name: str) -> None:
        await self._broadcast("unload_lora_adapter", name)

    async def check_no_leaks(self) -> None:
        await self._broadcast("check_no_leaks")

    async def get_metrics(self) -> dict[str, Any]:
        """Every replica's engine metrics combined as their kinds say (`combine_metrics`: counters
        summed, rates recomputed), with each replica's under "replicas" (a replica that does not
        answer within METRICS_TIMEOUT_S, down or restarting, is left out)."""
        timeout = METRICS_TIMEOUT_S
        calls = [asyncio.wait_for(_ref(h.metrics.remote()), timeout) for h in self.handles]
        answers = await asyncio.gather(*calls, return_exceptions=True)
        per = {rid: m for rid, m in enumerate(answers) if isinstance(m, dict)}
        total = combine_metrics(list(per.values()))
        total["replicas"] = per
        total["replicas_up"] = len(self.router.index.replica_ids)
        total["router_decisions"] = self.router.decisions
        total["router_decision_seconds"] = self.router.decision_seconds
        total["router_retried_requests"] = self.retried_requests
        total["router_failed_midstream"] = self.failed_midstream
        stats = self.router.index.stats
        total["router_event_gaps"] = stats.gaps
        total["router_store_lookups"] = self.router.store_lookups
        total["router_remote_lookups"] = self.router.remote_lookups
        total["router_snapshots"] = stats.snapshots
        return total

    async def cache_summary(self, include_text: bool = False) -> dict[str, Any]:
        """The replicas' cache summaries merged (`merge_summaries`): a replica that does not
        answer within METRICS_TIMEOUT_S is left out, as in get_metrics."""
        timeout = METRICS_TIMEOUT_S
        calls = [
            asyncio.wait_for(_ref(h.cache_summary.remote(include_text)), timeout)
            for h in self.handles
        ]
        answers = await asyncio.gather(*calls, return_exceptions=True)
        per = {rid: s for rid, s in enumerate(answers) if isinstance(s, dict)}
        if not per:
            raise EngineDeadError("no replica answered for the cache summary")
        return merge_summaries(per)

    def _keep_kv_events(self, replica_id: int, events: Sequence[Any]) -> None:
        self._kv_events.extend((replica_id, event) for event in events)

    async def take_kv_events(self) -> list[tuple[int, Any]]:
        """(replica id, KV-cache event) pairs the feeds applied since the last call, oldest
        first (bounded: the oldest go first past MAX_BUFFERED_KV_EVENTS)."""
        self._ensure_feeds()
        events = list(self._kv_events)
        self._kv_events.clear()
        return events

    # A pin names blocks of one pool; a pin per replica would need a warm-up on each and a
    # router that knows pinned prefixes are everywhere: not built.
    async def pin_prefix(self, pin_id: str, prompt_token_ids: list[int], salt: str | None) -> int:
        raise NotSupportedByEngine(_PINS_NEED_ONE_ENGINE)

    async def unpin_prefix(self, pin_id: str) -> bool:
        raise NotSupportedByEngine(_PINS_NEED_ONE_ENGINE)

    async def describe_pins(self) -> dict[str, Any]:
        raise NotSupportedByEngine(_PINS_NEED_ONE_ENGINE)


async def _ref(ref: Any) -> Any:
    return await ref
