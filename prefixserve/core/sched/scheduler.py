"""The step planner: which requests compute how many tokens this step, over which KV blocks.

No prefill or decode phase: each step lets a request's `num_computed_tokens` (K/V in its blocks)
catch up with its `num_tokens` (prompt plus generated) within a token budget. A prefix-cache hit
starts a request with `num_computed_tokens > 0`; chunked prefill did not catch up in one step;
decoding is one token behind (plus, with speculation, its drafts in lookahead slots).

Order inside a step (vLLM v1, with fair shares between tenants):
0. (fair) when every running slot is taken and a waiting tenant holds less than an equal share
   of them, the newest request of the tenant holding the most is preempted (one a step);
1. running requests, oldest first, each within its tenant's share of the budget; when the pool
   is full the newest running request of the tenant with the most is preempted (blocks freed
   tail first, keeping their hashes; back to the front of its tenant's queue) until slots fit;
2. unless something was preempted for lack of blocks, waiting requests, tenants in turn, each
   tenant's in arrival order (`fair_share.WaitingQueue`): a prefix-cache lookup, then slots for
   the rest of the prompt or a chunk (within the tenant's share; once every waiting tenant has
   used its share, the rest goes to whoever is next); the first that does not fit stops it.
Shares (and `fair_chunk_tokens`) apply only while several tenants have work; with one tenant
(the offline API, a server without keys) the step is planned as vLLM's FCFS scheduler plans it.

A structured request (`Request.structured_output`, a `RequestGrammar`) waits apart until its
grammar is compiled (vLLM's WAITING_FOR_FSM), so the requests behind it are admitted meanwhile;
its drafts are cut to what its grammar allows; each token it emits advances its grammar; it
stops when the grammar is complete; and with jump-forward the tokens its grammar forces are
appended at once, to be computed as one chunk in the next step.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prefixserve.config import SchedulerConfig
from prefixserve.core.kv_cache.breakpoint_spec import HoldStatus
from prefixserve.core.kv_cache.tier_hit import TierHit
from prefixserve.core.request import Request, RequestStatus
from prefixserve.core.sched.fair_share import (
    WaitingQueue,
    preemption_victim,
    slot_preemption_victim,
    tenant_shares,
)
from prefixserve.core.sched.output import (
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from prefixserve.core.sched.prefill_dedup import prefill_in_flight, waits_for_prefill
from prefixserve.core.sched.prefix_order import promote_longest_prefix
from prefixserve.core.sched.step_results import (
    RequestUpdate,
    SchedulerStats,
    append_forced,
    append_until_stop,
    forced_logprobs,
    sampled_run,
)

if TYPE_CHECKING:
    from prefixserve.core.kv_cache.kv_cache_manager import KVCacheManager
    from prefixserve.core.kv_cache.reports.explain import CacheExplainer
    from prefixserve.core.sched.interfaces import DraftProposer, TierConnector


# How long a schedule() with nothing else to do waits for a structured request's compile.
_GRAMMAR_WAIT_S = 0.05
# The most tokens one update appends by jump-forward (a grammar forcing a long constant would
# otherwise keep the step thread computing its forced tokens).
_MAX_FORCED_PER_STEP = 256


@dataclass(slots=True)
class _StepPlan:
    """What `Scheduler.schedule` has decided so far this step, and what budget is left."""

    token_budget: int
    shares: dict[Hashable, int] | None = None  # each tenant's tokens left (policy fair)
    contended: bool = False  # several tenants had work when the step began
    # The step will likely carry a chunk of several tokens (`Scheduler._prefill_pending`):
    # decoding requests propose no drafts (`Scheduler._drafts`).
    prefill_pending: bool = False
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    kv_loads: list[tuple[int, bytes]] = field(default_factory=list)

    def take(self, request: Request, num_tokens: int) -> None:
        self.token_budget -= num_tokens
        if self.shares is not None:
            self.shares[request.tenant] -= num_tokens


class Scheduler:
    """Plans each engine step over a KVCacheManager; owns the waiting and running queues.

    `eos_token_ids` are the model's end-of-sequence ids; a request stops on any of them unless
    its params say `ignore_eos`.

    With a `proposer` (a `DraftProposer`: spec_decode/ngram.py's), each decoding request may
    carry drafts: they are counted in the token budget and its tenant's share (leaving a token to
    every running request after it), get lookahead slots (never cached), and a request whose
    drafts' slots do not fit drops them rather than preempt anyone for its own allocation.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
        proposer: DraftProposer | None = None,
        kv_connector: TierConnector | None = None,
        explainer: CacheExplainer | None = None,
    ) -> None:
        """`kv_connector`: the load side of the tiers below RAM (a `TierConnector`:
        kv_store/connector.py's), when the engine has one. `explainer`: what explains each
        request's hit at its first scheduling (kv_cache/reports/explain.py)."""
        self.config = config
        self.proposer = proposer
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.kv_connector = kv_connector
        self.explainer = explainer
        self.fair = config.scheduling_policy == "fair"
        self.waiting = WaitingQueue(per_tenant=self.fair)
        self.running: list[Request] = []
        # Structured requests whose grammar is still compiling, in arrival order.
        self.waiting_for_grammar: list[Request] = []
        # request id -> why its grammar failed (compile error, timeout, a refused token): the
        # engine fails these requests after the step.
        self.grammar_failures: dict[str, str] = {}
        self._set_aside: set[str] = set()  # failed while waiting for their grammar: no queue
        # Finished, aborted or preempted since the last schedule(): the runner drops their state.
        self.finished_req_ids: set[str] = set()
        self.stats = SchedulerStats()

    # ----------------------------------------------------------------- queue management

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in the scheduler")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        if request.structured_output is not None:
            self.waiting_for_grammar.append(request)
            self._poll_grammars()
        else:
            self.waiting.append(request)

    def finish_requests(
        self,
        request_ids: str | Iterable[str],
        status: RequestStatus,
        stop_reason: int | str | None = None,
    ) -> None:
        """Finish (or abort) requests from outside the step, e.g. on a stop string or an abort.

        Unknown or already finished ids are ignored, so aborting twice is harmless.
        """
        assert status.is_finished, status
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request in self.waiting_for_grammar:
                self.waiting_for_grammar.remove(request)
            elif request.request_id in self._set_aside:
                self._set_aside.discard(request.request_id)  # its grammar failed: in no queue
            else:
                self.waiting.remove(request)
            request.status = status
            if stop_reason is not None:
                request.stop_reason = stop_reason
            self._free_request(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.waiting_for_grammar)

    # ----------------------------------------------------------------- the step plan

    def schedule(self) -> SchedulerOutput:
        """Decide this step's work: running requests first, then waiting ones (none in a step
        that had to preempt). Allocates KV slots; does not advance `num_computed_tokens`
        (update_from_output does, once the tokens are computed)."""
        plan = _StepPlan(self.config.max_num_batched_tokens)
        self.kv_cache_manager.held.expire_breakpoints()
        if self.waiting_for_grammar:
            self._poll_grammars(wait=not self.running and not self.waiting)
        if self.fair:
            self._give_short_tenant_a_slot()
            plan.shares = self._tenant_shares(plan.token_budget)
            plan.contended = plan.shares is not None
        plan.prefill_pending = self._prefill_pending()
        self._schedule_running(plan)
        if not plan.preempted:
            self._schedule_waiting(plan)
        output = SchedulerOutput(
            scheduled=plan.scheduled, finished_req_ids=self.finished_req_ids, kv_loads=plan.kv_loads
        )
        self.finished_req_ids = set()
        return output

    def _poll_grammars(self, wait: bool = False) -> None:
        """Queue the structured requests whose grammar compiled (with jump-forward, after the
        tokens it forces from its start); set aside those whose grammar failed. `wait`: nothing
        else to do, so wait a moment for the first compile instead of spinning."""
        if wait:
            self.waiting_for_grammar[0].structured_output.wait(_GRAMMAR_WAIT_S)
        still: list[Request] = []
        for request in self.waiting_for_grammar:
            grammar = request.structured_output
            ready = grammar.poll()
            if ready is None:
                still.append(request)
            elif ready:
                self._append_initial_forced(request)
                self.waiting.append(request)
            else:
                self.grammar_failures[request.request_id] = grammar.error or "grammar failed"
                self._set_aside.add(request.request_id)
        self.waiting_for_grammar = still

    def _append_initial_forced(self, request: Request) -> None:
        """Jump-forward from the grammar's start: the forced tokens join the prompt's prefill
        (at least one token is left to sample; reported with the first sampled token)."""
        grammar = request.structured_output
        forced = grammar.take_forced()
        room = min(
            (request.max_tokens or self.max_model_len) - 1,
            self.max_model_len - request.num_tokens - 1,
        )
        forced = forced[: max(0, room)]
        ends = self.eos_token_ids | request.stop_token_ids
        stop = next((i for i, token in enumerate(forced) if token in ends), len(forced))
        forced = forced[:stop]  # a token that ends the request is left to its first step
        if not forced:
            return
        request.append_output_token_ids(forced)
        grammar.unreported = forced
        if not grammar.accept(forced):
            self.grammar_failures[request.request_id] = grammar.error or "grammar refused"
        elif grammar.stopped:
            grammar.finishing = True  # complete already: its first step computes it, then stops

    def _give_short_tenant_a_slot(self) -> None:
        """A waiting tenant short of its share of the running slots takes one this step."""
        slot = slot_preemption_victim(self.running, self.waiting, self.config.max_num_seqs)
        if slot is not None:
            victim, short_tenant = slot
            head = next(self.waiting.requests_of(short_tenant, 1), None)
            if head is not None and self._reading_below(head):
                return  # its head waits for its read: preempting now would only churn
            self.running.remove(victim)
            self._preempt(victim, turn_next=False)
            self.waiting.take_turn_next(short_tenant)

    # ---- 1. running requests, in admission order

    def _schedule_running(self, plan: _StepPlan) -> None:
        if self.proposer is not None:
            self.proposer.start_step(self.running)
        req_index = 0
        while req_index < len(self.running) and plan.token_budget > 0:
            request = self.running[req_index]
            num_new_tokens = min(self._chunk(request, plan.contended), plan.token_budget)
            if plan.shares is not None:
                num_new_tokens = min(num_new_tokens, plan.shares[request.tenant])
                if num_new_tokens == 0:
                    req_index += 1  # its tenant's share is spent: it waits for the next step
                    continue
            assert num_new_tokens > 0, request
            drafts = self._drafts(request, num_new_tokens, plan)
            drafts = self._allocate_or_preempt(request, req_index, num_new_tokens, drafts, plan)
            if drafts is None:
                continue  # this request preempted itself; the next one now sits at req_index
            plan.take(request, num_new_tokens + len(drafts))
            plan.scheduled.append(self._scheduled(request, num_new_tokens, drafts))
            req_index += 1

    def _prefill_pending(self) -> bool:
        """Whether this step will likely carry a chunk of several tokens, where the proposer
        holds its drafts back then (`DraftProposer.holds_for_prefill`): a running request with
        more than its last token to compute (its prompt, or tokens its grammar forced), or a
        waiting request that may be admitted now (a free running slot, a free KV block, no read
        of the tiers below in flight: a request that cannot start keeps no one's drafts away).
        The drafts' verification rows would lengthen the step that the chunk's next token (a
        prompt's first) waits for; on W9, holding them for forced tokens too gave the lower
        TTFT (BENCHMARKS.md §52)."""
        if self.proposer is None or not self.proposer.holds_for_prefill:
            return False
        if any(r.num_computed_tokens < r.num_tokens - 1 for r in self.running):
            return True
        if not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return False
        if self.kv_cache_manager.num_free_blocks == 0:
            return False
        loading = self.kv_connector.loading if self.kv_connector is not None else None
        return any(loading is None or not loading(r) for r in self.waiting)

    def _drafts(self, request: Request, num_new_tokens: int, plan: _StepPlan) -> list[int]:
        """Speculative drafts for a decoding request, within the budget and its tenant's share;
        none in a step that carries a chunk of several tokens (`_prefill_pending`)."""
        if self.proposer is None or num_new_tokens != 1 or plan.prefill_pending:
            return []
        share = None if plan.shares is None else plan.shares[request.tenant]
        drafts = self.proposer.propose_within(
            request, plan.token_budget, share, self._threshold(plan.contended), self.max_model_len
        )
        if drafts and request.structured_output is not None:
            return request.structured_output.valid_drafts(drafts)  # never leave the grammar
        return drafts

    def _allocate_or_preempt(
        self,
        request: Request,
        req_index: int,
        num_new_tokens: int,
        drafts: list[int],
        plan: _StepPlan,
    ) -> list[int] | None:
        """Slots for a running request's tokens (and drafts, dropped first when they do not
        fit), preempting victims until they fit; the drafts kept, or None when the request
        preempted itself."""
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(
                request, num_new_tokens, num_lookahead_tokens=len(drafts)
            )
            if new_blocks is not None:
                return drafts
            if drafts:
                drafts = []  # no room for the drafts: none this step, nobody preempted
                continue
            victim = preemption_victim(self.running, req_index, self.fair)
            self.running.remove(victim)
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is request:
                return None

    # ---- 2. waiting requests, tenants in turn (preempted ones sit at the front)

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        deferred: set[Hashable] = set()  # queues whose head waits for a running prefill
        in_flight: set[bytes] | None = None
        while self.waiting and plan.token_budget > 0:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting.peek(plan.shares, deferred)
            if request is None:
                if plan.shares is None:
                    break  # only deferred queues are left
                plan.shares = None  # every share is spent: the rest goes to whoever is next
                continue
            if self.config.admission_order == "longest_prefix":
                request = promote_longest_prefix(self.waiting, request, self.kv_cache_manager)
            if in_flight is None:
                in_flight = prefill_in_flight(self.running, self.kv_cache_manager)
            admitted = self._admit(request, plan, in_flight)
            if admitted is None:
                break  # stays waiting; nobody behind it jumps the queue
            if not admitted:
                deferred.add(self.waiting.key(request))

    def _admit(self, request: Request, plan: _StepPlan, in_flight: set[bytes]) -> bool | None:
        """Schedule a waiting request after its cache hit (RAM, then disk and shared tiers): True
        when it runs, False when it waits for a running prefill of its next block or for its
        blocks' background read (`TierConnector.start_load`: the read overlaps the running
        requests' compute), None when it does not fit."""
        mgr = self.kv_cache_manager
        assert request.num_computed_tokens == 0, request
        if self._reading_below(request):
            return False
        computed_blocks, num_computed = mgr.get_computed_blocks(request)
        below = self.kv_connector.match(request, num_computed) if self.kv_connector else TierHit()
        num_loaded = below.tokens
        if waits_for_prefill(request, num_computed + num_loaded, mgr.block_size, in_flight):
            if request.cache.hit_when_waited is None:
                request.cache.hit_when_waited = num_computed + num_loaded
            return False
        if (
            num_loaded
            and self.running
            and self.kv_connector.start_load(request, num_computed, below)
        ):
            return False  # it waits while its blocks are read and the running requests compute
        report = None
        if self.explainer is not None and request.num_cached_tokens < 0:
            # Before its own allocation, which may evict blocks the report should still see.
            report = self.explainer.explain(request, num_computed, below)
        num_new_tokens = request.num_tokens - num_computed - num_loaded
        assert num_new_tokens > 0, (request, num_computed, num_loaded)
        threshold = self._threshold(plan.contended)
        if 0 < threshold < num_new_tokens:
            num_new_tokens = threshold
        num_new_tokens = min(num_new_tokens, plan.token_budget)
        if plan.shares is not None:
            num_new_tokens = min(num_new_tokens, plan.shares[request.tenant])
        new_blocks = mgr.allocate_slots(
            request,
            num_loaded + num_new_tokens,
            num_new_computed_tokens=num_computed,
            new_computed_blocks=computed_blocks,
        )
        if new_blocks is None:
            return None
        self.waiting.pop(request)
        self.running.append(request)
        in_flight |= prefill_in_flight((request,), mgr)
        if num_loaded and self.kv_connector is not None:
            # Blocks whose read fails are computed instead, from this chunk on (their slots are
            # allocated already).
            below = self.kv_connector.load_into_pool(
                mgr, request, num_computed, num_loaded // mgr.block_size, plan.kv_loads
            )
            num_loaded = below.tokens
        if self.kv_connector is not None:
            self.kv_connector.forget_load(request)  # admitted: its background read is spent
        if report is not None:
            request.cache.report = self.explainer.commit(request, report, below)
        self._start_running(request, num_computed, num_loaded)
        plan.scheduled.append(self._scheduled(request, num_new_tokens))
        plan.take(request, num_new_tokens)
        return True

    def _reading_below(self, request: Request) -> bool:
        """Whether `request` waits for its background read of the tiers below RAM: while
        others run; with nothing else to compute, the step waits for the read instead."""
        if self.kv_connector is None or not self.kv_connector.loading(request):
            return False
        if self.running:
            return True
        self.kv_connector.wait_for_load(request)
        return False

    def _start_running(self, request: Request, num_computed: int, num_loaded: int) -> None:
        if request.num_cached_tokens < 0:  # its first scheduling
            # (Tokens a grammar forced before the first step are output, not prompt: a hit on
            # them is not counted as cached prompt.)
            request.num_cached_tokens = min(num_computed + num_loaded, request.num_prompt_tokens)
            request.cache.num_disk_cached_tokens = num_loaded
            self.stats.num_prompt_tokens += request.num_prompt_tokens
            self.kv_cache_manager.held.refresh_breakpoints(request, num_computed + num_loaded)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed + num_loaded

    def _chunk(self, request: Request, contended: bool = False) -> int:
        """The tokens `request` would compute this step with the whole budget to itself."""
        num_new_tokens = request.num_tokens - request.num_computed_tokens
        threshold = self._threshold(contended)
        return threshold if 0 < threshold < num_new_tokens else num_new_tokens

    def _threshold(self, contended: bool) -> int:
        """The cap on one request's chunk this step (0: none): `long_prefill_token_threshold`,
        and `fair_chunk_tokens` while tenants share the step (`contended`), so that no tenant's
        long prefill makes the step that carries the others' tokens long."""
        threshold = self.config.long_prefill_token_threshold
        fair_cap = self.config.fair_chunk_tokens if contended else 0
        if fair_cap and (not threshold or fair_cap < threshold):
            return fair_cap
        return threshold

    def _tenant_shares(self, budget: int) -> dict[Hashable, int] | None:
        """Each tenant's share of this step's tokens (None: at most one tenant has work)."""
        free_seqs = self.config.max_num_seqs - len(self.running)
        return tenant_shares(
            self.running, self.waiting, free_seqs, budget, lambda r: self._chunk(r, True)
        )

    def stuck_request(self) -> Request | None:
        """The head of the waiting queue when nothing runs: after a step that scheduled nothing,
        it could not get blocks from an idle pool, so it never will (a queue of structured
        requests whose grammars compile is not stuck)."""
        if self.running or not self.waiting:
            return None
        return self.waiting[0]

    def _scheduled(
        self, request: Request, num_new_tokens: int, drafts: list[int] | None = None
    ) -> ScheduledRequest:
        prompt_end = min(request.num_computed_tokens + num_new_tokens, request.num_prompt_tokens)
        if prompt_end > request.num_computed_tokens:
            self.stats.num_computed_prompt_tokens += prompt_end - request.num_computed_tokens
        return ScheduledRequest(
            request=request,
            num_computed_tokens=request.num_computed_tokens,
            num_new_tokens=num_new_tokens,
            block_ids=self.kv_cache_manager.get_block_ids(request),
            draft_token_ids=drafts or [],
        )

    def _preempt(self, request: Request, turn_next: bool = True) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        # Not in finished_req_ids: the runner keeps the request's seeded generator, so a resumed
        # request continues its random stream instead of replaying it.
        self.waiting.appendleft(request, turn_next)

    # ----------------------------------------------------------------- applying the results

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestUpdate]:
        """Advance each scheduled request by the tokens computed (accepted drafts included),
        append the accepted drafts and the sampled token, and finish requests that hit a stop
        condition on any of them (their blocks are freed here).

        Returns one update per scheduled request that is still known (not aborted meanwhile).
        """
        updates: list[RequestUpdate] = []
        for entry in scheduler_output.scheduled:
            request = entry.request
            if request.is_finished or self.requests.get(request.request_id) is not request:
                continue  # aborted between schedule() and now
            request.num_computed_tokens = entry.num_computed_tokens + entry.num_new_tokens
            update = RequestUpdate(request=request)
            prompt_logprobs = runner_output.prompt_logprobs.get(request.request_id)
            if prompt_logprobs:
                update.new_prompt_logprobs = prompt_logprobs
                update.first_prompt_logprob_pos = entry.num_computed_tokens + 1
            token_id = runner_output.sampled_token_ids.get(request.request_id)
            if token_id is not None:
                assert entry.samples, entry
                if request.cache_breakpoints and request.cache.breakpoint_statuses is None:
                    self._hold_breakpoints(request)
                if self._append_sampled(entry, runner_output, token_id, update):
                    self.running.remove(request)
                    self._free_request(request)
                    update.finished = True
            updates.append(update)
        return updates

    def _append_sampled(
        self,
        entry: ScheduledRequest,
        runner_output: ModelRunnerOutput,
        token_id: int,
        update: RequestUpdate,
    ) -> bool:
        """Append the accepted drafts and the sampled token, checking the stop conditions after
        each (a stop inside an accepted run ends the request there). The accepted drafts' K/V is
        in their slots already: they count as computed, and a block they complete is cached now.
        Returns True when the request stopped."""
        request = entry.request
        grammar = request.structured_output
        if grammar is not None and grammar.unreported:
            update.new_token_ids.extend(grammar.unreported)  # forced at its start
            update.new_logprobs.extend(forced_logprobs(request, grammar.unreported))
            self.stats.num_generation_tokens += len(grammar.unreported)
            grammar.unreported = []
        if grammar is not None and grammar.finishing:
            request.status = RequestStatus.FINISHED_STOPPED  # its forced tail is computed now
            return True
        accepted, tokens, logprobs = sampled_run(runner_output, request.request_id, token_id)
        if entry.draft_token_ids:
            self.stats.record_verification(len(entry.draft_token_ids), len(accepted))
            if self.proposer is not None:
                self.proposer.record(request.request_id, len(entry.draft_token_ids), len(accepted))
        request.num_computed_tokens += len(accepted)
        generated_before = len(update.new_token_ids)
        stopped = append_until_stop(
            request, tokens, logprobs, update, self.eos_token_ids, self.max_model_len
        )
        if grammar is not None and not stopped:
            stopped = self._advance_grammar(request, tokens, update)
        self.stats.num_generation_tokens += len(update.new_token_ids) - generated_before
        if accepted:  # (a stop inside the run appended fewer: cache_blocks stops at num_tokens)
            self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
        return stopped

    def _advance_grammar(self, request: Request, tokens: list[int], update: RequestUpdate) -> bool:
        """Advance a structured request's grammar over the tokens it emitted; stop it when the
        grammar is complete; with jump-forward, append the tokens the grammar forces next (its
        next step computes them as one chunk). A refused token sets the request aside to fail
        (`grammar_failures`). Returns True when the request stopped."""
        grammar = request.structured_output
        appended = 0
        while True:
            if not grammar.accept(tokens):
                self.grammar_failures[request.request_id] = grammar.error or "grammar refused"
                return False
            if grammar.stopped:
                if request.num_tokens - request.num_computed_tokens > 1:
                    # It ended on a run of forced tokens: one more step computes them (their
                    # K/V is the next turn's prefix), then it stops (`_append_sampled`).
                    grammar.finishing = True
                    return False
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            if appended >= _MAX_FORCED_PER_STEP:
                return False  # the rest comes one per step (each the step's only allowed token)
            tokens = grammar.take_forced()
            if not tokens:
                return False
            appended += len(tokens)
            if append_forced(request, tokens, update, self.eos_token_ids, self.max_model_len):
                return True

    def _hold_breakpoints(self, request: Request) -> None:
        """Its prompt is computed (the first sample): hold its breakpoints' prefixes and count
        the prompt tokens it wrote to them (those past its cache hit, up to the furthest one
        held)."""
        statuses = self.kv_cache_manager.held.hold_breakpoints(
            request, request.cache_breakpoints, self._held_blocks_fit
        )
        request.cache.breakpoint_statuses = statuses
        block_size = self.kv_cache_manager.block_size
        written = max(0, request.num_cached_tokens)  # the end of what the request read
        for bp, status in zip(request.cache_breakpoints, statuses, strict=True):
            end = bp.num_tokens - bp.num_tokens % block_size
            if status in (HoldStatus.HELD, HoldStatus.REFRESHED) and end > written:
                # Breakpoints come in prompt order with non-increasing ttls: the tokens up to
                # this one that no earlier one wrote are written for its ttl.
                by_ttl = request.cache.write_tokens_by_ttl
                by_ttl[bp.ttl_s] = by_ttl.get(bp.ttl_s, 0) + end - written
                written = end
        request.cache.num_write_tokens = sum(request.cache.write_tokens_by_ttl.values())
        if request.cache.counted_in_reports:
            self.stats.num_cache_write_tokens += request.cache.num_write_tokens

    def _held_blocks_fit(self, num_new_held: int) -> bool:
        """Whether `num_new_held` more held blocks leave every request here room for its longest
        sequence (counted without shared blocks: an upper bound of its need)."""
        mgr = self.kv_cache_manager
        free_for_requests = mgr.num_kv_blocks - mgr.held.num_blocks - num_new_held
        longest = max(
            (r.num_prompt_tokens + r.max_tokens for r in self.requests.values()), default=0
        )
        return -(-longest // mgr.block_size) * mgr.num_groups <= free_for_requests

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        if self.kv_connector is not None:
            self.kv_connector.forget_load(request)
        if self.proposer is not None:
            self.proposer.drop((request.request_id,))
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)
        self.stats.num_finished_requests += 1

    # ----------------------------------------------------------------- cache control

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached block hash. Fails (returns False) while blocks are in use, unless
        `reset_running_requests` first preempts every running request so nothing is in use."""
        if reset_running_requests:
            while self.running:
                self._preempt(self.running.pop())
        return self.kv_cache_manager.reset_prefix_cache()
