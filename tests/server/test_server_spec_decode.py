"""`prefixserve serve --speculative-config`: completions over HTTP with n-gram speculation, its
counters on /metrics, and the flag's parsing."""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefixserve import cli
from prefixserve.config import CacheConfig, EngineConfig
from prefixserve.engine.async_llm import AsyncLLMEngine
from prefixserve.engine.llm_engine import LLMEngine
from prefixserve.entrypoints.api_server import build_app
from tests.helpers import random_tokens
from tests.helpers.server import MODEL_NAME, LiveServer, serve_in_thread

SPEC_JSON = json.dumps(
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
)
COUNTERS = (
    "prefixserve_spec_decode_num_drafts_total",
    "prefixserve_spec_decode_num_draft_tokens_total",
    "prefixserve_spec_decode_num_accepted_tokens_total",
)


@pytest.fixture(scope="module")
def spec_server():
    config = EngineConfig(
        dtype="float32",
        max_model_len=512,
        cache=CacheConfig(num_kv_blocks=128),
        speculative_config=SPEC_JSON,
    )
    engine = AsyncLLMEngine(LLMEngine(config), log_stats_interval_s=None)
    engine.start()
    server, thread, url = serve_in_thread(build_app(engine, [MODEL_NAME]))
    yield LiveServer(url=url, api_key=None, engine=engine)
    server.should_exit = True
    thread.join(timeout=30)
    engine.shutdown()


def scrape(live: LiveServer) -> dict[str, float]:
    with live.http() as http:
        response = http.get("/metrics")
    assert response.status_code == 200
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def test_speculative_completions_stream_and_count_accepted_drafts(spec_server):
    body = random_tokens(20, seed=81)
    prompt = body * 3 + body[:6]
    client = spec_server.client()
    before = scrape(spec_server)
    whole = client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=30,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=30,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    streamed = "".join(chunk.choices[0].text for chunk in stream)
    assert streamed == whole.choices[0].text and whole.usage.completion_tokens == 30
    after = scrape(spec_server)
    for name in COUNTERS:
        assert name in after, name
    accepted = after[COUNTERS[2]] - before.get(COUNTERS[2], 0)
    drafts = after[COUNTERS[1]] - before.get(COUNTERS[1], 0)
    assert 0 < accepted <= drafts
    spec_server.check_no_leaks()


def test_the_flag_reaches_the_engine_config():
    args = cli.build_parser().parse_args(["serve", "--speculative-config", SPEC_JSON])
    config = cli.engine_config_from_args(args)
    spec = config.speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max) == ("ngram", 4, 4)
    assert (
        cli.engine_config_from_args(cli.build_parser().parse_args(["serve"])).speculative_config
        is None
    )


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ('{"method": "ngram"', "JSON"),
        ('{"method": "medusa", "num_speculative_tokens": 2}', "method"),
        ('{"method": "ngram", "num_speculative_tokens": -1}', "num_speculative_tokens"),
    ],
)
def test_a_bad_speculative_config_is_reported_naming_the_problem(value, named, capsys):
    assert cli.main(["serve", "--speculative-config", value]) == 2
    err = capsys.readouterr().err
    assert "speculative_config" in err and named in err
