"""docs/grafana/prefixserve-dashboard.json: valid Grafana shape, and every query names a metric the
real server exports on GET /metrics (issue 29, item 5).

The metric names are taken from each PromQL expression by a small tokenizer (identifiers outside
string literals, label matchers and Grafana `$variables`), then looked up in what a live server
exports after one completion (so the histograms have samples). `prefixserve_replica_<key>` gauges
exist only with replicas: for those the key must be a numeric entry of `LLMEngine.get_metrics()`,
which each replica exports under that prefix.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.server import KEY_ADMIN, MODEL_NAME

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "prefixserve-dashboard.json"
DS_UID = "${DS_PROMETHEUS}"
PREFIX = "prefixserve_"
REPLICA_PREFIX = "prefixserve_replica_"

# PromQL pieces that cannot hold a metric name: string literals (label values, regexes) and
# label-matcher / grouping lists are dropped before identifiers are read.
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_BRACES = re.compile(r"\{[^{}]*\}")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENT = re.compile(r"(?<![\w$:])[A-Za-z_:][A-Za-z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """The `prefixserve_*` metric names a PromQL expression selects."""
    text = _STRING.sub('""', expr)
    text = _BRACES.sub("{}", text)
    text = _GROUPING.sub("", text)
    return {name for name in _IDENT.findall(text) if name.startswith(PREFIX)}


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, with those nested in (collapsed) rows."""
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels") or [])


def datasources(node: Any) -> Iterator[dict[str, Any]]:
    """Every `datasource` object in the JSON."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "datasource":
                yield value
            else:
                yield from datasources(value)
    elif isinstance(node, list):
        for item in node:
            yield from datasources(item)


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    queries = []
    for panel in all_panels(dashboard["panels"]):
        for target in panel.get("targets") or []:
            queries.append((f"panel {panel['title']!r} target {target['refId']}", target["expr"]))
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]
            query = query["query"] if isinstance(query, dict) else query
            queries.append((f"variable {var['name']!r}", query))
    return queries


def exported_names(text: str) -> set[str]:
    """Series names a Prometheus server stores from this exposition: each sample's name, and
    what each family's type gives even before it has a sample (a labelled counter nobody has
    incremented yet): counters `_total`, histograms `_bucket`/`_sum`/`_count`."""
    names = set()
    for family in text_string_to_metric_families(text):
        names.update(sample.name for sample in family.samples)
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names.update(family.name + s for s in ("_bucket", "_sum", "_count"))
        else:
            names.add(family.name)
    return names


# ---- the tokenizer ----


def test_metric_names_skip_strings_labels_functions_and_variables():
    expr = (
        "histogram_quantile(0.99, sum by (le, prefixserve_not_a_label) (rate("
        'prefixserve_time_to_first_token_seconds_bucket{instance=~"$instance", '
        'code!="prefixserve_in_a_string"}[$__rate_interval]))) / on (instance) '
        "sum(prefixserve_num_requests_running) + label_replace(prefixserve_x:rule, 'a', 'b', "
        "'c', 'prefixserve_quoted')"
    )
    assert metric_names(expr) == {
        "prefixserve_time_to_first_token_seconds_bucket",
        "prefixserve_num_requests_running",
        "prefixserve_x:rule",
    }
    assert metric_names("sum(rate(other_metric_total[5m]))") == set()


# ---- the JSON's shape ----


def test_dashboard_is_valid_grafana_shape():
    dashboard = load_dashboard()
    assert dashboard["title"] and dashboard["uid"]
    assert dashboard["schemaVersion"] >= 36
    variables = {var["name"]: var for var in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert variables["instance"]["type"] == "query"
    assert variables["instance"]["datasource"]["uid"] == DS_UID

    panels = list(all_panels(dashboard["panels"]))
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        assert panel.get("title"), panel["id"]
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"}, panel["title"]
        assert 0 <= panel["gridPos"]["x"] and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        if panel["type"] == "row":
            assert not panel.get("targets"), panel["title"]
            if not panel["collapsed"]:
                assert panel["panels"] == [], f"an open row's panels follow it: {panel['title']}"
            continue
        assert panel.get("description"), panel["title"]
        assert panel["fieldConfig"]["defaults"].get("unit"), panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": DS_UID}, panel["title"]
        targets = panel["targets"]
        assert targets, panel["title"]
        ref_ids = [target["refId"] for target in targets]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in targets:
            assert target["datasource"]["uid"] == DS_UID, panel["title"]
            assert target["expr"].strip(), panel["title"]
    # No datasource anywhere is pinned to one Grafana's uid (the built-in annotations aside).
    sources = list(datasources(dashboard))
    assert sources
    for source in sources:
        assert source == {"type": "prometheus", "uid": DS_UID} or source["type"] == "grafana"


def test_every_query_names_a_prefixserve_metric():
    for where, expr in dashboard_queries(load_dashboard()):
        assert metric_names(expr), f"{where} names no prefixserve_ metric: {expr}"


# ---- against the real server ----


def test_every_query_names_a_metric_the_server_exports(server):
    client = server.client()
    client.completions.create(
        model=MODEL_NAME,
        prompt="The dashboard needs a sample in every histogram, so here is one request.",
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    server.wait_idle()
    with server.http(KEY_ADMIN) as http:
        response = http.get("/metrics")
    assert response.status_code == 200, response.text
    exported = exported_names(response.text)
    engine_keys = {
        key
        for key, value in server.metrics().items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }

    missing = {}
    for where, expr in dashboard_queries(load_dashboard()):
        for name in sorted(metric_names(expr)):
            if name.startswith(REPLICA_PREFIX):
                ok = name.removeprefix(REPLICA_PREFIX) in engine_keys
            else:
                ok = name in exported
            if not ok:
                missing.setdefault(name, where)
    assert not missing, "the dashboard queries metrics the server does not export: " + ", ".join(
        f"{name} ({where})" for name, where in sorted(missing.items())
    )
