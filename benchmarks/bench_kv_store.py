"""The prefix cache's disk tier under pressure and across a restart, offline (`LLM` API).

W4 (12 documents, 4 rounds round-robin; pool for ~4 documents) and W5 (64 system prompts with
Zipf(1.1) popularity; pool for ~16) run twice in one process on the same weights: with the RAM
pool only (LRU, what vLLM's prefix caching does) and with the disk tier on an empty store. Requests
go in closed-loop batches of `--concurrency`. Prints requests/s, the hit rate split by tier, and
the store's per-block load time against the time to compute a block.

W0-W3 run the same way with the default pool (no pressure): the disk tier should cost nothing
there. W6 (restart) runs W1 one request at a time with max_tokens=1 (so each request's time is
its time to first token): a cold pass on an empty store, then a new engine on the same store (a
restart: empty RAM pool), then the same engine again (warm RAM). Prints TTFT p50 of each pass.

`--json PATH` also writes every request's record (finish time, prompt tokens, tokens hit in RAM
and on disk; W6: its TTFT per pass), which `benchmarks/plot_kv_store.py` draws.

    .venv/bin/python benchmarks/bench_kv_store.py --workloads W4,W5,W6 [--scale 1.0] [--json F]
        [--kv-cache-dtypes int8,fp8_e4m3]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from prefixserve import LLM, SamplingParams  # noqa: E402
from prefixserve.bench.workloads import load_token_pool, make_workload  # noqa: E402
from prefixserve.model.loader.default_model import ensure_default_model  # noqa: E402
from prefixserve.model.loader.loading import load_model  # noqa: E402
from prefixserve.model.quant.kv_cache import kv_format  # noqa: E402

# KV blocks of the RAM pool per workload: W4 ~4 documents (4 x 1,532 tokens), W5 ~16 prompts.
POOL_BLOCKS = {"W4": 4 * 96 + 16, "W5": 16 * 68 + 16}


def _llm(loaded, num_blocks: int | None, store: str | None, args, kv: str = "auto") -> LLM:
    return LLM(
        dtype=args.dtype,
        kv_cache_dtype=kv,
        eviction_policy=args.eviction_policy,
        loaded_model=loaded,
        num_kv_blocks=num_blocks,
        max_num_seqs=args.concurrency,
        enable_kv_store=store is not None,
        kv_store_dir=store,
        kv_store_gb=args.store_gb if store is not None else None,
    )


def run_pressure(
    loaded, workload, num_blocks: int | None, store: str | None, args, kv: str = "auto"
) -> dict:
    llm = _llm(loaded, num_blocks, store, args, kv)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    requests = workload.requests
    start = time.perf_counter()
    outputs, records = [], []
    for i in range(0, len(requests), args.concurrency):
        batch = requests[i : i + args.concurrency]
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in batch]
        done = llm.generate(prompts, params, use_tqdm=False)
        outputs += done
        records += [_record(o, time.perf_counter() - start) for o in done]
    wall = time.perf_counter() - start
    llm.llm_engine.close()
    metrics = llm.llm_engine.get_metrics()
    prompt_tokens = sum(r.num_prompt_tokens for r in requests)
    disk = metrics.get("kv_store_hit_tokens", 0)
    cached = sum(o.num_cached_tokens for o in outputs)
    loaded_blocks = metrics.get("kv_store_loaded_blocks", 0)
    return {
        "req_s": len(requests) / wall,
        "wall": wall,
        "hit": cached / prompt_tokens,
        "ram_hit": (cached - disk) / prompt_tokens,
        "disk_hit": disk / prompt_tokens,
        "load_ms_per_block": (
            1000 * metrics["kv_store_load_seconds"] / loaded_blocks if loaded_blocks else None
        ),
        "computed": metrics["computed_prompt_tokens"],
        "outputs": [list(o.outputs[0].token_ids) for o in outputs],
        "requests": records,
    }


def _record(output, seconds: float) -> dict:
    return {
        "seconds": round(seconds, 4),
        "prompt_tokens": len(output.prompt_token_ids),
        "ram_hit_tokens": output.num_cached_tokens - output.num_disk_cached_tokens,
        "disk_hit_tokens": output.num_disk_cached_tokens,
    }


def run_restart(loaded, workload, args) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=1)
    store = tempfile.mkdtemp(prefix="kvstore-w6-")
    # The first request of each W1 prefix misses in a cold cache; the others hit in RAM anyway.
    firsts = {r.group: i for i, r in reversed(list(enumerate(workload.requests)))}

    def one_pass(llm: LLM) -> dict:
        ttfts, records = [], []
        for r in workload.requests:
            start = time.perf_counter()
            [out] = llm.generate([{"prompt_token_ids": r.prompt_token_ids}], params, use_tqdm=False)
            ttfts.append(time.perf_counter() - start)
            records.append(_record(out, ttfts[-1]))
        return {
            "p50": statistics.median(ttfts),
            "first": statistics.mean(ttfts[i] for i in firsts.values()),
            "requests": records,
        }

    first = _llm(loaded, None, store, args)
    cold = one_pass(first)
    first.llm_engine.close()
    del first
    restarted = _llm(loaded, None, store, args)
    after_restart = one_pass(restarted)
    hits = restarted.llm_engine.get_metrics()
    warm = one_pass(restarted)
    restarted.llm_engine.close()
    no_cache = one_pass(
        LLM(
            dtype=args.dtype,
            loaded_model=loaded,
            enable_prefix_caching=False,
            enable_kv_store=False,
        )
    )
    tokens = sum(r.num_prompt_tokens for r in workload.requests)
    return {
        "cold": cold,
        "restart": after_restart,
        "warm": warm,
        "no_cache": no_cache,
        "restart_disk_hit": hits["kv_store_hit_tokens"] / tokens,
        "restart_ram_hit": hits["prefix_cache_hits"] / tokens,
    }


def run_same_bytes(loaded, workload, name, blocks, kv, ram, disk, args) -> None:
    """`name` with the KV cache in `kv` and a pool of the same bytes as `blocks` in the model's
    dtype, RAM only and with the disk tier; printed beside the runs in the model's dtype."""
    if blocks is None:
        return
    config = loaded.config
    wide = kv_format("auto", config.torch_dtype).row_bytes(config.head_dim)
    same_bytes = blocks * wide // kv_format(kv, config.torch_dtype).row_bytes(config.head_dim)
    for label, store, base in (
        (f"RAM pool only ({args.eviction_policy})", None, ram),
        ("RAM + disk tier", tempfile.mkdtemp(prefix="kvstore-"), disk),
    ):
        r = run_pressure(loaded, workload, same_bytes, store, args, kv)
        print(
            f"{name} KV {kv}, pool {same_bytes} blocks (the bytes of {blocks}), {label}: "
            f"{r['req_s']:.3f} req/s ({r['wall']:.1f} s), hit {r['hit']:.1%} (RAM "
            f"{r['ram_hit']:.1%}, disk {r['disk_hit']:.1%}); {r['req_s'] / base['req_s']:.2f}x "
            f"the {args.dtype} KV cache's req/s, hit {base['hit']:.1%} there",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="W4,W5,W6")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies the requests")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--store-gb", type=float, default=4.0)
    parser.add_argument("--json", help="write every request's record here")
    parser.add_argument("--eviction-policy", default="lru", help="the pool's (lru, slru, cost)")
    parser.add_argument(
        "--kv-cache-dtypes",
        default="",
        help="W4/W5 also with the KV cache in these 8-bit dtypes (int8, fp8_e4m3), the pool "
        "given the same bytes (more blocks), RAM only and with the disk tier, same run",
    )
    args = parser.parse_args()
    results: dict = {}
    cpuinfo = open("/proc/cpuinfo").read()
    flags = " ".join(f for f in ("avx512f", "avx512_bf16", "amx_bf16", "avx2") if f in cpuinfo)
    print(f"# {platform.processor() or platform.machine()}, flags: {flags}, dtype {args.dtype}")
    loaded = load_model(None, dtype=args.dtype)
    pool, _, special = load_token_pool(ensure_default_model())
    for name in args.workloads.split(","):
        if name == "W6":
            workload = make_workload("W1", pool, scale=args.scale)
            for r in workload.requests:
                r.prompt_token_ids = [*special, *r.prompt_token_ids]
            result = run_restart(loaded, workload, args)
            results[name] = {
                p: result[p]["requests"] for p in ("cold", "restart", "warm", "no_cache")
            }
            for key in ("p50", "first"):
                label = "TTFT p50" if key == "p50" else "TTFT of each prefix's first request"
                r = {name: result[name][key] for name in ("cold", "restart", "warm", "no_cache")}
                print(
                    f"W6 {label}: first pass on an empty store {r['cold']:.3f} s, after a "
                    f"restart {r['restart']:.3f} s, warm {r['warm']:.3f} s, no prefix cache "
                    f"{r['no_cache']:.3f} s; restart/warm {r['restart'] / r['warm']:.2f}x, "
                    f"restart/no-cache {r['restart'] / r['no_cache']:.2f}x, restart/first pass "
                    f"{r['restart'] / r['cold']:.2f}x",
                    flush=True,
                )
            print(
                f"W6 after the restart: disk hit {result['restart_disk_hit']:.1%}, RAM hit "
                f"{result['restart_ram_hit']:.1%}",
                flush=True,
            )
            continue
        workload = make_workload(name, pool, scale=args.scale)
        for r in workload.requests:
            r.prompt_token_ids = [*special, *r.prompt_token_ids]
        blocks = POOL_BLOCKS.get(name)  # W0-W3: the default pool (no pressure)
        ram = run_pressure(loaded, workload, blocks, None, args)
        disk = run_pressure(loaded, workload, blocks, tempfile.mkdtemp(prefix="kvstore-"), args)
        results[name] = {"ram_only": ram["requests"], "ram_and_disk": disk["requests"]}
        assert ram["outputs"] == disk["outputs"] or args.dtype != "float32"
        same = sum(a == b for a, b in zip(ram["outputs"], disk["outputs"], strict=True))
        for label, r in (
            (f"RAM pool only ({args.eviction_policy})", ram),
            ("RAM + disk tier", disk),
        ):
            load = r["load_ms_per_block"]
            print(
                f"{name} {len(workload.requests)} req, pool {blocks or 'default'} blocks, {label}: "
                f"{r['req_s']:.3f} req/s ({r['wall']:.1f} s), hit {r['hit']:.1%} "
                f"(RAM {r['ram_hit']:.1%}, disk {r['disk_hit']:.1%}), computed prompt tokens "
                f"{r['computed']}" + (f", load {load:.2f} ms/block" if load else ""),
                flush=True,
            )
        for kv in filter(None, args.kv_cache_dtypes.split(",")):
            run_same_bytes(loaded, workload, name, blocks, kv, ram, disk, args)
        compute_ms_per_block = 1000 * ram["wall"] / max(1, ram["computed"]) * 16
        print(
            f"{name}: disk tier / RAM only = {disk['req_s'] / ram['req_s']:.2f}x req/s; "
            f"outputs identical for {same}/{len(workload.requests)}; "
            f"RAM-only wall time per computed block ~{compute_ms_per_block:.1f} ms",
            flush=True,
        )

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu_flags": flags, "dtype": args.dtype, "workloads": results}, f)
        print(f"# per-request records: {args.json}")


if __name__ == "__main__":
    main()
