"""The W9 agent driver (prefixserve/bench/agent_workload.py) against a live server: two sessions
of three tool turns, streamed. Every forced call parses (its arguments validate against its
tool's schema), and each later turn of a session finds its history cached: more cached tokens
than the turn before, at least the previous turn's prompt less one block."""

from __future__ import annotations

import asyncio

from prefixserve.bench.agent_summary import summarize_agent
from prefixserve.bench.agent_workload import AgentConfig, run_agent_workload
from tests.helpers.server import BLOCK_SIZE, MODEL_NAME

# No rules in the system prompt: the tools (about 600 tokens rendered) and three turns then fit
# the fixture's 1,024-token context.
CONFIG = AgentConfig(sessions=2, turns=3, max_tokens=64, rules=0)


def test_w9_driver_parses_every_forced_call_and_later_turns_hit_the_cache(open_server):
    run = asyncio.run(run_agent_workload(open_server.url, MODEL_NAME, CONFIG))
    assert [r.error for r in run.records] == [None] * CONFIG.num_requests
    forced = [r for r in run.records if r.tool_choice == "required"]
    assert len(forced) == 4
    assert all(r.parse_ok for r in forced), [(r.request_id, r.parse_error) for r in forced]
    for session in range(CONFIG.sessions):
        turns = [r for r in run.records if r.session == session]
        assert [r.turn for r in turns] == [0, 1, 2]
        for before, after in zip(turns, turns[1:], strict=False):
            assert after.cached_source == "usage.prompt_tokens_details.cached_tokens"
            assert after.cached_tokens > (before.cached_tokens or 0), (before, after)
            assert after.cached_tokens >= before.prompt_tokens - BLOCK_SIZE, (before, after)
    summary = summarize_agent(run.records, run.duration)
    assert summary.forced_parsed == summary.forced_turns == 4
    assert summary.cached_share is not None and summary.cached_share > 0.5
    open_server.check_no_leaks()
