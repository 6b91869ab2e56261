"""The server's limit flags of `prefixserve serve`, and what they become in build_app's
arguments (`app_limits`, for guard.py) and uvicorn's Config (`uvicorn_limits`).

Every bound a client can push against is a flag with a default: the request body size and the
bytes of bodies in flight across connections (checked by guard.py before the body is parsed),
the time a request's headers may take (slow_clients.py: uvicorn has no such timeout of its own)
and the time its body may take (guard.py), the idle keep-alive time, the number of connections
and requests in flight, and the size of an incomplete HTTP event (headers still arriving).
Together they bound what a slow or idle client can make the server hold, and for how long.
"""

from __future__ import annotations

import argparse
from typing import Any

from prefixserve.entrypoints.chat.history import (
    MAX_ENTRIES_PER_TENANT,
    MAX_TENANTS,
    MAX_TOKENS_PER_TENANT,
    GeneratedHistory,
)
from prefixserve.entrypoints.server.admission import Admission
from prefixserve.entrypoints.server.guard import BODIES_IN_FLIGHT, DEFAULT_TIMEOUT_REQUEST_BODY_S
from prefixserve.entrypoints.server.slow_clients import (
    DEFAULT_TIMEOUT_REQUEST_HEADERS_S,
    header_timeout_protocol,
)

DEFAULT_TIMEOUT_KEEP_ALIVE_S = 5
DEFAULT_LIMIT_CONCURRENCY = 1024
DEFAULT_H11_MAX_INCOMPLETE_EVENT_SIZE = 64 * 1024


def add_server_limit_arguments(group: argparse._ArgumentGroup) -> None:
    """`--admin-api-key-file` and the limit flags, into the serve command's server group."""
    group.add_argument(
        "--admin-api-key-file",
        default=None,
        metavar="PATH",
        help="File of 'KEY NAME' lines (the --api-key-file format): operator keys, the only "
        "keys accepted by GET /kv_events, POST /reset_prefix_cache, GET /metrics and the API "
        "docs (/docs, /redoc, /openapi.json), and accepted nowhere else. With tenant keys but "
        "no operator keys those endpoints answer 403 to everyone. Without any key every "
        "endpoint is open (one trusted user).",
    )
    group.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=None,
        metavar="BYTES",
        help="Largest request body; a larger one gets a 413 before it is parsed. Default: "
        "4 MiB, or max_model_len * 192 bytes when that is more (room for the longest legal "
        "prompt as JSON).",
    )
    group.add_argument(
        "--max-body-bytes-in-flight",
        type=int,
        default=None,
        metavar="BYTES",
        help="Most bytes of request bodies held at once by all requests being served (a "
        "declared Content-Length counts from the start; released when the request's response "
        "ends); beyond it a 503 with Retry-After, though a request is always admitted when no "
        f"other body is in flight. Default: {BODIES_IN_FLIGHT} * --max-request-body-bytes "
        "(0: no limit).",
    )
    group.add_argument(
        "--timeout-request-headers",
        type=float,
        default=DEFAULT_TIMEOUT_REQUEST_HEADERS_S,
        metavar="SECONDS",
        help="Close a connection whose request line and headers are not complete this many "
        "seconds after it opened (or after the request's first byte, on a kept-alive "
        "connection); a partial request gets a 408 first.",
    )
    group.add_argument(
        "--timeout-request-body",
        type=float,
        default=DEFAULT_TIMEOUT_REQUEST_BODY_S,
        metavar="SECONDS",
        help="Answer 408 and close the connection when a request's body has not fully arrived "
        "this many seconds after its headers.",
    )
    group.add_argument(
        "--timeout-keep-alive",
        type=int,
        default=DEFAULT_TIMEOUT_KEEP_ALIVE_S,
        metavar="SECONDS",
        help="Close an idle keep-alive connection after this many seconds.",
    )
    group.add_argument(
        "--limit-concurrency",
        type=int,
        default=DEFAULT_LIMIT_CONCURRENCY,
        metavar="N",
        help="Most connections and requests in flight at once; beyond it new requests get a "
        "503 (0: no limit).",
    )
    group.add_argument(
        "--max-requests",
        type=int,
        default=None,
        metavar="N",
        help="Most requests in the server at once (running or waiting), all tenants; beyond it "
        "a 429 with Retry-After. Default: 4 * --max-num-seqs (0: no limit).",
    )
    group.add_argument(
        "--max-requests-per-tenant",
        type=int,
        default=None,
        metavar="N",
        help="Most requests one tenant has in flight; beyond it a 429. Default: --max-num-seqs "
        "(0: no limit).",
    )
    group.add_argument(
        "--max-tokens-per-tenant",
        type=int,
        default=None,
        metavar="TOKENS",
        help="Most tokens (n * (prompt + max_tokens) per request) one tenant has in flight; "
        "beyond it a 429 (a tenant with nothing in flight is always admitted). Default: half the "
        "KV pool's tokens, so one tenant's flood leaves the other half to the rest (0: no limit).",
    )
    group.add_argument(
        "--max-render-jobs-per-tenant",
        type=int,
        default=None,
        metavar="N",
        help="Most prompts one tenant has waiting for or on the tokenizer thread (chat-template "
        "rendering and tokenizing, /v1/messages/count_tokens included; the thread takes tenants "
        "in turn); beyond it a 429. Default: --max-num-seqs (0: no limit).",
    )
    group.add_argument(
        "--max-history-turns-per-tenant",
        type=int,
        default=MAX_ENTRIES_PER_TENANT,
        metavar="N",
        help="Chat answers whose computed token ids one tenant's next turns may reuse (a "
        "history that stays cached, docs/tools.md); the least recently used out first "
        "(0: no history is kept, every prompt is tokenized from its text).",
    )
    group.add_argument(
        "--max-history-tokens-per-tenant",
        type=int,
        default=MAX_TOKENS_PER_TENANT,
        metavar="TOKENS",
        help="Token ids of remembered chat answers (their prompts' and their own) one tenant "
        "may hold; the least recently used answers out first.",
    )
    group.add_argument(
        "--max-history-tenants",
        type=int,
        default=MAX_TENANTS,
        metavar="N",
        help="Tenants whose chat answers are remembered; the least recently active tenant's "
        "out first.",
    )
    group.add_argument(
        "--h11-max-incomplete-event-size",
        type=int,
        default=DEFAULT_H11_MAX_INCOMPLETE_EVENT_SIZE,
        metavar="BYTES",
        help="Largest request line plus headers a client may send; more closes the connection.",
    )


def check_limit_arguments(args: argparse.Namespace) -> None:
    """ValueError naming the flag when a limit is not positive."""
    for flag, value in (
        ("--max-request-body-bytes", args.max_request_body_bytes),
        ("--timeout-keep-alive", args.timeout_keep_alive),
        ("--h11-max-incomplete-event-size", args.h11_max_incomplete_event_size),
    ):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    for flag, value in (
        ("--max-history-turns-per-tenant", args.max_history_turns_per_tenant),
        ("--max-history-tokens-per-tenant", args.max_history_tokens_per_tenant),
        ("--max-history-tenants", args.max_history_tenants),
    ):
        if value < 0:
            raise ValueError(f"{flag} must be >= 0, got {value}")
    for flag, value in (
        ("--max-requests", args.max_requests),
        ("--max-requests-per-tenant", args.max_requests_per_tenant),
        ("--max-tokens-per-tenant", args.max_tokens_per_tenant),
        ("--max-render-jobs-per-tenant", args.max_render_jobs_per_tenant),
    ):
        if value is not None and value < 0:
            raise ValueError(f"{flag} must be >= 0 (0: no limit), got {value}")
    if args.max_body_bytes_in_flight is not None and args.max_body_bytes_in_flight < 0:
        raise ValueError(
            f"--max-body-bytes-in-flight must be >= 0 (0: no limit), got "
            f"{args.max_body_bytes_in_flight}"
        )
    for flag, seconds in (
        ("--timeout-request-headers", args.timeout_request_headers),
        ("--timeout-request-body", args.timeout_request_body),
    ):
        if not 0 < seconds < float("inf"):
            raise ValueError(f"{flag} must be a number of seconds > 0, got {seconds}")
    if args.limit_concurrency < 0:
        raise ValueError(f"--limit-concurrency must be >= 0, got {args.limit_concurrency}")
    stall = getattr(args, "stream_stall_timeout", 0.0)
    if not (stall >= 0 and stall != float("inf")):
        raise ValueError(f"--stream-stall-timeout must be a number of seconds >= 0, got {stall}")


def app_limits(args: argparse.Namespace) -> dict[str, Any]:
    """app.build_app keyword arguments of the limit flags the request guard enforces."""
    return {
        "max_request_body_bytes": args.max_request_body_bytes,
        "timeout_request_body_s": args.timeout_request_body,
        "max_body_bytes_in_flight": args.max_body_bytes_in_flight,
    }


def uvicorn_limits(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn.Config keyword arguments of the limit flags. The HTTP implementation is pinned to
    h11, the one that honours the incomplete-event size (httptools, when installed, would not),
    with the header timeout of slow_clients.py."""
    return {
        "http": header_timeout_protocol(args.timeout_request_headers),
        "timeout_keep_alive": args.timeout_keep_alive,
        "limit_concurrency": args.limit_concurrency or None,
        "h11_max_incomplete_event_size": args.h11_max_incomplete_event_size,
    }


def admission_from_args(
    args: argparse.Namespace, max_num_seqs: int, kv_pool_tokens: int
) -> Admission:
    """The admission bounds of the flags, with their defaults; 0 means no bound."""

    def bound(value: int | None, default: int) -> int | None:
        value = default if value is None else value
        return value or None

    return Admission(
        max_requests=bound(args.max_requests, 4 * max_num_seqs),
        max_requests_per_tenant=bound(args.max_requests_per_tenant, max_num_seqs),
        max_tokens_per_tenant=bound(args.max_tokens_per_tenant, max(1, kv_pool_tokens // 2)),
        max_render_jobs_per_tenant=bound(args.max_render_jobs_per_tenant, max_num_seqs),
    )


def history_from_args(args: argparse.Namespace) -> GeneratedHistory:
    """The chat history's bounds of the flags (0 turns or tokens or tenants: none kept)."""
    return GeneratedHistory(
        max_entries_per_tenant=args.max_history_turns_per_tenant,
        max_tokens_per_tenant=args.max_history_tokens_per_tenant,
        max_tenants=args.max_history_tenants,
    )
