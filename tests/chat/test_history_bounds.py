"""The generated history's bounds (entrypoints/chat/history.py): turns and token ids per tenant,
tenants in all, each the least recently used out first; 0 keeps nothing; the serve flags set
them and refuse a negative bound."""

from __future__ import annotations

import pytest

from prefixserve import cli
from prefixserve.entrypoints.chat.history import GeneratedHistory
from prefixserve.entrypoints.server.options import check_limit_arguments, history_from_args


def _encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def _reused(history: GeneratedHistory, tenant: str, text: str) -> int:
    return history.tokenize(tenant, text, _encode).reused_tokens


def test_the_least_recently_used_turn_leaves_first():
    history = GeneratedHistory(max_entries_per_tenant=2)
    for text in ("a", "b", "c"):
        history.record("t", text, [1, 2], text, 1)
    assert _reused(history, "t", "a!") == 0
    assert _reused(history, "t", "b!") == 2
    history.record("t", "d", [3], "d", 1)  # "b" was used last: "c" leaves
    assert _reused(history, "t", "c!") == 0
    assert _reused(history, "t", "b!") == 2


def test_a_tenants_token_bound_holds_and_a_longer_answer_is_not_kept():
    history = GeneratedHistory(max_tokens_per_tenant=5)
    history.record("t", "a", [1, 2, 3], "a", 1)
    history.record("t", "b", [1, 2, 3], "b", 1)  # 6 ids: "a" leaves
    assert (_reused(history, "t", "a"), _reused(history, "t", "b")) == (0, 3)
    history.record("t", "c", list(range(6)), "c", 1)
    assert _reused(history, "t", "c") == 0


def test_the_least_recently_active_tenant_leaves_first():
    history = GeneratedHistory(max_tenants=2)
    for tenant in ("x", "y", "z"):
        history.record(tenant, "p", [7], "p", 1)
    assert [_reused(history, t, "p") for t in ("x", "y", "z")] == [0, 1, 1]


@pytest.mark.parametrize("bound", ["turns-per-tenant", "tokens-per-tenant", "tenants"])
def test_a_zero_bound_keeps_no_history(bound):
    args = cli.build_parser().parse_args(["serve", f"--max-history-{bound}", "0"])
    check_limit_arguments(args)
    history = history_from_args(args)
    history.record("t", "p", [1], "p", 1)
    assert _reused(history, "t", "p!") == 0


def test_the_history_flags_reach_the_history_and_are_checked():
    argv = ["serve", "--max-history-turns-per-tenant", "3", "--max-history-tokens-per-tenant"]
    history = history_from_args(
        cli.build_parser().parse_args([*argv, "99", "--max-history-tenants", "4"])
    )
    assert (history.max_entries_per_tenant, history.max_tokens_per_tenant) == (3, 99)
    assert history.max_tenants == 4
    with pytest.raises(ValueError, match="--max-history-tenants"):
        check_limit_arguments(
            cli.build_parser().parse_args(["serve", "--max-history-tenants", "-1"])
        )
