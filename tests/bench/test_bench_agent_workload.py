"""W9's pieces without a server: the call check, the history an agent sends, what the streamed
chunks add up to, the summary, the result table, the peers' tool template and command lines.
(The driver against a live server: tests/server/test_server_bench_agent.py.)"""

from __future__ import annotations

import json

import jinja2
import pytest

from benchmarks.serving import servers
from benchmarks.serving.compare import CompareConfig
from benchmarks.serving.servers import ServerContext, peer_tool_template
from prefixserve.bench import agent_summary as asum
from prefixserve.bench import agent_tools as at
from prefixserve.bench import agent_workload as aw
from prefixserve.bench.results import report


def _call(name: str, arguments: str, call_id: str = "call_1") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_a_call_parses_only_as_a_json_object_that_validates_against_its_tools_schema():
    assert at.check_call(_call("get_weather", '{"city": "Oslo", "day": 2}')) is None
    assert "not JSON" in at.check_call(_call("get_weather", '{"city": "Oslo", "day": 2'))
    assert "schema" in at.check_call(_call("get_weather", '{"city": "Bern", "day": 2}'))
    assert "schema" in at.check_call(_call("get_weather", '{"city": "Oslo", "day": 2, "x": 1}'))
    assert "not a JSON object" in at.check_call(_call("get_weather", "[1]"))
    assert "no tool" in at.check_call(_call("get_time", "{}"))


def _record(choice: str, **fields) -> aw.AgentRecord:
    return aw.AgentRecord("W9-s0-t0", 0, fields.pop("turn", 0), choice, **fields)


def test_a_required_turn_without_a_valid_call_is_a_parse_failure_and_plain_text_counts_neither():
    missing = _record("required", content="It is sunny.")
    aw.judge_calls(missing)
    assert missing.parse_ok is False and "no tool call" in missing.parse_error
    good = _record("required", tool_calls=[_call("search_web", '{"query": "trains"}')])
    aw.judge_calls(good)
    assert good.parse_ok is True
    text = _record("auto", content="It will be sunny.")
    aw.judge_calls(text)
    assert text.parse_ok is None
    leaked = _record("auto", content='<tool_call>\n{"name": "search_web"')
    aw.judge_calls(leaked)
    assert leaked.parse_ok is False and "unparsed" in leaked.parse_error


def test_streamed_call_pieces_and_llama_cpp_timings_add_up_to_the_answer():
    record = _record("required")
    stream = aw._Stream(record, sent=0.0)
    stream.add({"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]}, 0.1)
    piece = {"index": 0, "id": "c1", "type": "function", "function": {"name": "get_weather"}}
    stream.add({"choices": [{"delta": {"tool_calls": [piece]}}]}, 0.2)
    for text in ('{"city": ', '"Rome", "day": 3}'):
        args = {"index": 0, "function": {"arguments": text}}
        stream.add({"choices": [{"delta": {"tool_calls": [args]}}]}, 0.3)
    stream.add({"choices": [{"delta": {}, "finish_reason": "tool_calls"}]}, 0.4)
    stream.add({"choices": [], "timings": {"cache_n": 700, "prompt_n": 20}}, 0.5)
    stream.finish()
    assert record.first_chunk == 0.1 and record.ttft == 0.2
    assert record.tool_calls == [_call("get_weather", '{"city": "Rome", "day": 3}', "c1")]
    assert record.finish_reason == "tool_calls" and record.content is None
    assert (record.cached_tokens, record.prompt_tokens) == (700, 720)
    assert record.cached_source == "timings.cache_n"
    # usage's cached count wins over llama.cpp's timings, whichever comes first
    details = {"prompt_tokens": 730, "prompt_tokens_details": {"cached_tokens": 704}}
    stream.add({"choices": [], "usage": details}, 0.6)
    stream.add({"choices": [], "timings": {"cache_n": 1, "prompt_n": 2}}, 0.7)
    assert (record.cached_tokens, record.prompt_tokens) == (704, 730)


def test_a_session_sends_the_answer_back_as_returned_with_a_tool_result_per_call():
    config = aw.AgentConfig(sessions=1, turns=4, rules=2)
    session = aw.Session(0, config)
    first = session.next_messages(0)
    assert [m["role"] for m in first] == ["system", "user"]
    assert first[0]["content"] == at.system_prompt(2)
    call = _call("get_weather", '{"city": "Lima", "day": 5}')
    session.add_answer(_record("required", tool_calls=[call]))
    assert session.messages[-2] == {"role": "assistant", "content": None, "tool_calls": [call]}
    result = session.messages[-1]
    assert result["role"] == "tool" and result["tool_call_id"] == "call_1"
    assert json.loads(result["content"])["city"] == "Lima"
    assert result["content"] == at.tool_result("get_weather", {"city": "Lima", "day": 5})
    # a free turn after a tool result asks nothing new; after a text answer, a follow-up
    assert session.next_messages(1)[-1]["role"] == "tool"
    session.add_answer(_record("auto", turn=1, content="Sunny in Lima."))
    assert session.messages[-1] == {"role": "assistant", "content": "Sunny in Lima."}
    assert session.next_messages(2)[-1]["role"] == "user"
    session.add_answer(_record("required", turn=2, content="no call"))
    assert session.next_messages(3)[-1]["content"] == at.FOLLOW_UP


def test_tool_results_are_small_json_made_from_the_arguments():
    for tool in at.TOOLS:
        assert at.tool_result(tool["function"]["name"], None) == '{"error": "invalid arguments"}'
    made = at.tool_result("convert_currency", {"amount": 100, "from": "EUR", "to": "USD"})
    again = at.tool_result("convert_currency", {"amount": 100, "from": "EUR", "to": "USD"})
    assert made == again and len(made) < 200 and "amount" in json.loads(made)


def test_the_default_system_prompt_has_every_rule_and_sessions_differ_in_their_questions():
    assert at.system_prompt().count("\n") == at.DEFAULT_RULES
    with pytest.raises(ValueError, match="rules"):
        at.system_prompt(at.DEFAULT_RULES + 1)
    config = aw.AgentConfig()
    questions = {aw.Session(i, config).next_messages(0)[-1]["content"] for i in range(8)}
    assert len(questions) == 8


def _run(ttfts_text, cached) -> list[aw.AgentRecord]:
    records = []
    for turn, (ttft, (prompt, hit)) in enumerate(zip(ttfts_text, cached, strict=True)):
        choice = "required" if aw.is_call_turn(turn) else "auto"
        calls = [_call("search_web", '{"query": "x"}')] if choice == "required" else []
        rec = _record(choice, turn=turn, ttft=ttft, e2e=1.0, tool_calls=calls)
        rec.prompt_tokens, rec.cached_tokens = prompt, hit
        rec.content = None if calls else "text"
        aw.judge_calls(rec)
        records.append(rec)
    return records


def test_the_summary_counts_cached_share_and_ttft_over_later_turns_only():
    records = _run([5.0, 0.1, 0.2, 0.3], [(1000, 0), (1100, 1000), (1200, 1100), (1300, 1200)])
    records.append(_record("required", turn=4, error="HTTP 500"))
    aw.judge_calls(records[-1])
    s = asum.summarize_agent(records, duration_s=2.0)
    assert s.num_failed == 1 and s.requests_per_s == 2.0
    assert s.cached_share == pytest.approx(3300 / 3600)
    assert s.later_ttft_ms[50] == pytest.approx(200.0)
    assert s.later_text_ttft_ms[50] == pytest.approx(200.0)  # turns 1 and 3 answered in text
    assert (s.forced_parsed, s.forced_turns) == (2, 3)
    assert s.parse_rate == pytest.approx(2 / 3)


def test_report_writes_the_agent_table_next_to_the_other_workloads(tmp_path):
    config = aw.AgentConfig(sessions=1, turns=4)
    run = aw.AgentRun(_run([1, 1, 1, 1], [(10, 0), (10, 5), (10, 5), (10, 5)]), 4.0)
    (tmp_path / "W9").mkdir()
    for engine, alive in (("prefixserve", True), ("peer", False)):
        payload = asum.result_payload(engine, config, run, alive)
        (tmp_path / "W9" / f"{engine}.json").write_text(json.dumps(payload))
    text = report(tmp_path, ["W9"], order=["prefixserve"])
    lines = (tmp_path / "W9.md").read_text().splitlines()
    assert lines[0] == asum.AGENT_TABLE_HEADER
    assert lines[2].startswith("| prefixserve | 1.00 |") and lines[2].endswith("| yes |")
    assert lines[3].startswith("| peer |") and lines[3].endswith("| NO |")
    assert "50.0%" in lines[2] and "### W9" in text
    assert json.loads((tmp_path / "summary.json").read_text())["W9"]["peer"]["parse_rate"] == 1


def test_the_agent_table_shows_speculative_decodings_acceptance_where_a_server_counted_it(
    tmp_path,
):
    """W9 with n-gram drafts: the run's spec-decode counters (`spec_decode`, as compare.py and
    `bench run` record them) give the row its acceptance rate and mean accepted length; a
    server without them reads n/a; a run where no server counted any keeps the table as it was."""
    from prefixserve.bench.summary import SPEC_HEADER

    config = aw.AgentConfig(sessions=1, turns=4)
    run = aw.AgentRun(_run([1, 1, 1, 1], [(10, 0), (10, 5), (10, 5), (10, 5)]), 4.0)
    spec = {"acceptance_rate": 0.25, "mean_accepted_length": 1.75}
    (tmp_path / "W9").mkdir()
    for engine, counted in (("prefixserve+ngram", spec), ("peer", None)):
        payload = asum.result_payload(engine, config, run, True, spec_decode=counted)
        (tmp_path / "W9" / f"{engine}.json").write_text(json.dumps(payload))
    report(tmp_path, ["W9"], order=["prefixserve+ngram"])
    lines = (tmp_path / "W9.md").read_text().splitlines()
    assert lines[0] == asum.AGENT_TABLE_HEADER + SPEC_HEADER
    assert lines[2].endswith("| yes | 25.0% | 1.75 |")
    assert lines[3].endswith("| yes | n/a | n/a |")
    summary = json.loads((tmp_path / "summary.json").read_text())["W9"]
    assert summary["prefixserve+ngram"]["acceptance_rate"] == 0.25
    rows = [("a", asum.summarize_agent(run.records, 4.0), True)]
    assert asum.agent_table(rows).splitlines()[0] == asum.AGENT_TABLE_HEADER


def _render(template: str, arguments: object) -> str:
    """Render a history call the way transformers does (its tojson: json.dumps)."""
    env = jinja2.Environment()
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, **kw)
    call = {"id": "c", "type": "function", "function": {"name": "get_weather"}}
    call["function"]["arguments"] = arguments
    messages = [
        {"role": "system", "content": "S"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
    ]
    return env.from_string(template).render(messages=messages, tools=at.TOOLS)


def test_the_peers_template_is_the_packaged_one_rendering_object_arguments_too(tmp_path):
    packaged = servers.packaged_tool_template().read_text()
    peer = peer_tool_template(tmp_path).read_text()
    arguments = '{"city": "Oslo", "day": 2}'
    expected = _render(packaged, arguments)
    assert '"arguments": {"city": "Oslo", "day": 2}}' in expected
    assert _render(peer, arguments) == expected
    assert _render(peer, json.loads(arguments)) == expected


def _ctx(tmp_path) -> ServerContext:
    return ServerContext(
        model_dir=tmp_path / "SmolLM2",
        gguf_path=tmp_path / "m.gguf",
        port=8123,
        threads=2,
        max_model_len=4096,
        kv_cache_gib=2,
        chat_template=tmp_path / "t.jinja",
        parallel=8,
    )


def test_vllm_hermes_parses_hermes_calls_reports_cached_tokens_and_gets_the_template(tmp_path):
    cmd = servers.get_engine("vllm-hermes").command(_ctx(tmp_path))
    assert cmd[cmd.index("--tool-call-parser") + 1] == "hermes"
    assert "--enable-auto-tool-choice" in cmd and "--enable-prompt-tokens-details" in cmd
    assert "--enable-prefix-caching" in cmd
    assert cmd[cmd.index("--chat-template") + 1] == str(tmp_path / "t.jinja")


def test_llama_server_gets_jinja_the_template_and_a_slot_of_the_same_context_per_session(
    tmp_path,
):
    cmd = servers.get_engine("llama-server").command(_ctx(tmp_path))
    assert cmd[0].endswith("llama_server/bin/llama-server") and "--jinja" in cmd
    assert cmd[cmd.index("--chat-template-file") + 1] == str(tmp_path / "t.jinja")
    assert cmd[cmd.index("--parallel") + 1] == "8"
    assert cmd[cmd.index("--ctx-size") + 1] == str(8 * 4096)
    assert cmd[cmd.index("--threads") + 1] == "2"


def test_w9_wants_engines_that_serve_tools(tmp_path):
    for engine in ("vllm", "llama.cpp"):
        with pytest.raises(ValueError, match="vllm-hermes and llama-server"):
            CompareConfig(engines=[engine], workloads=["W9"], model_dir=tmp_path, out_dir=tmp_path)
    cfg = CompareConfig(
        engines=["prefixserve-ram", "vllm-hermes", "llama-server"],
        workloads=["w9"],
        model_dir=tmp_path,
        out_dir=tmp_path,
        sessions=4,
        scale=2.0,
    )
    assert cfg.agent_workloads == ["W9"] and cfg.agent_config().sessions == 8
