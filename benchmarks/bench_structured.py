"""Structured outputs on our engine: validity, compile times, mask overhead, jump-forward.

    .venv/bin/python benchmarks/bench_structured.py [--parts validity,compile,mask,jump]
        [--repeats 5] [--out results.json]

- validity: every schema of `benchmarks/structured/schemas.py` (SCHEMAS, the kinds agents send)
  as a chat request (greedy, max_tokens 200): how many answers finish, and how many of those
  validate with `jsonschema`; each UNSUPPORTED schema must be refused, and how long that takes.
- compile: per schema, the compile on a warm backend (the tokenizer's ~0.3 s once per engine is
  left out: `first compile` says it) and a cached lookup: p50 and p99.
- mask: decode step time at batch 8 with a JSON Schema (a free-text string field: a mask every
  step, nothing forced) against the same 8 prompts without one, alternating engines repeat by
  repeat; the ratio's median and spread (the issue's bound: within 3%).
- jump: output tokens/s on a JSON-heavy workload (8 concurrent requests of field-rich schemas)
  with and without jump-forward, alternating; the outputs must be identical.
Run it alone: the machine's two cores are the engine's.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jsonschema  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repo root
from benchmarks.structured.schemas import PROMPTS, SCHEMAS, UNSUPPORTED  # noqa: E402
from prefixserve import LLM, SamplingParams  # noqa: E402
from prefixserve.model.kernels.cpu_paths import describe_cpu  # noqa: E402
from prefixserve.model.loader.loading import load_model  # noqa: E402
from prefixserve.sampling_params import StructuredOutputsParams  # noqa: E402
from prefixserve.structured_output.backend import LLGuidanceBackend  # noqa: E402
from prefixserve.structured_output.compiler import GrammarCompiler  # noqa: E402
from prefixserve.structured_output.errors import GrammarError  # noqa: E402

SYSTEM = "You answer with one JSON object and nothing else."
# A free-text field too long to finish within the measured steps: a mask every step.
STORY = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 400}},
    "required": ["story"],
}
# Field-rich answers: many forced keys and brackets (the jump-forward workload).
RECORD = {
    "type": "object",
    "properties": {
        "first_name": {"type": "string", "maxLength": 12},
        "last_name": {"type": "string", "maxLength": 12},
        "department": {"enum": ["engineering", "marketing", "finance", "operations"]},
        "employment_status": {"enum": ["full_time", "part_time", "contractor"]},
        "office_location": {"enum": ["headquarters", "regional_office", "remote"]},
        "contact": {
            "type": "object",
            "properties": {
                "work_email_address": {"type": "string", "maxLength": 24},
                "preferred_contact_method": {"enum": ["email", "telephone", "messaging"]},
            },
            "required": ["work_email_address", "preferred_contact_method"],
            "additionalProperties": False,
        },
        "is_manager": {"type": "boolean"},
        "years_of_experience": {"type": "integer", "minimum": 0, "maximum": 50},
    },
    "required": [
        "first_name",
        "last_name",
        "department",
        "employment_status",
        "office_location",
        "contact",
        "is_manager",
        "years_of_experience",
    ],
    "additionalProperties": False,
}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def chat(user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def validity(llm: LLM) -> dict:
    conversations = [chat(PROMPTS[name]) for name, _ in SCHEMAS]
    params = [
        SamplingParams(
            max_tokens=200, temperature=0.0, structured_outputs=StructuredOutputsParams(json=s)
        )
        for _, s in SCHEMAS
    ]
    started = time.perf_counter()
    outputs = llm.chat(conversations, params, use_tqdm=True)
    wall = time.perf_counter() - started
    finished = valid = 0
    failures = []
    for (name, schema), out in zip(SCHEMAS, outputs, strict=True):
        completion = out.outputs[0]
        if completion.finish_reason != "stop":
            continue
        finished += 1
        try:
            jsonschema.validate(json.loads(completion.text), schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError) as exc:
            failures.append((name, str(exc)[:200], completion.text[:200]))
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    refused = []
    for name, schema, expected in UNSUPPORTED:
        started_refusal = time.perf_counter()
        try:
            llm.generate(
                ["x"], SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))
            )
            refused.append((name, False, 0.0, "accepted"))
        except (GrammarError, ValueError) as exc:
            took = time.perf_counter() - started_refusal
            refused.append((name, expected in str(exc).lower(), took, str(exc)[:120]))
    return {
        "schemas": len(SCHEMAS),
        "finished": finished,
        "valid": valid,
        "failures": failures,
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "refused": refused,
    }


def compile_times(llm: LLM) -> dict:
    engine = llm.llm_engine
    backend = LLGuidanceBackend(
        engine.tokenizer.hf_tokenizer, engine.tokenizer.vocab_size, engine.scheduler.eos_token_ids
    )
    started = time.perf_counter()
    backend.compile(StructuredOutputsParams(json={"type": "integer"}))
    first = time.perf_counter() - started
    compiler = GrammarCompiler(backend)
    cold, cached = [], []
    for _, schema in SCHEMAS:
        params = StructuredOutputsParams(json=schema)
        started = time.perf_counter()
        compiler.get(params, "t").result()
        cold.append(time.perf_counter() - started)
        started = time.perf_counter()
        compiler.get(params, "t").result()
        cached.append(time.perf_counter() - started)
    compiler.close()
    ms = 1000.0
    return {
        "first_compile_ms": first * ms,
        "cold_p50_ms": percentile(cold, 0.5) * ms,
        "cold_p99_ms": percentile(cold, 0.99) * ms,
        "cold_max_ms": max(cold) * ms,
        "cached_p50_ms": percentile(cached, 0.5) * ms,
        "cached_p99_ms": percentile(cached, 0.99) * ms,
    }


def decode_step_times(llm: LLM, params: SamplingParams, prompts: list[list[int]]) -> list[float]:
    """Wall time of each step in which all 8 requests decode one token."""
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"m{time.monotonic_ns()}-{i}", prompt, params)
    times = []
    while engine.has_unfinished_requests():
        decoding = len(engine.scheduler.running) == len(prompts) and all(
            r.num_tokens - r.num_computed_tokens == 1 for r in engine.scheduler.running
        )
        started = time.perf_counter()
        engine.step()
        if decoding:
            times.append(time.perf_counter() - started)
    return times


def mask_overhead(model, repeats: int) -> dict:
    llm = LLM(dtype=model.config.dtype, loaded_model=model)
    tok = llm.llm_engine.tokenizer
    prompts = [tok.encode(f"Story number {i}: a JSON object with a story. ") for i in range(8)]
    masked = SamplingParams(
        max_tokens=64,
        temperature=0.0,
        structured_outputs=StructuredOutputsParams(json=STORY, whitespace_pattern=r"[ ]?"),
    )
    plain = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    decode_step_times(llm, masked, prompts)  # warm: the compile, the kernels
    ratios, with_ms, without_ms = [], [], []
    for _ in range(repeats):
        a = statistics.median(decode_step_times(llm, masked, prompts))
        b = statistics.median(decode_step_times(llm, plain, prompts))
        with_ms.append(a * 1000)
        without_ms.append(b * 1000)
        ratios.append(a / b)
    return {
        "step_ms_with": statistics.median(with_ms),
        "step_ms_without": statistics.median(without_ms),
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
    }


def jump_forward(model, repeats: int) -> dict:
    engines = {
        jf: LLM(dtype=model.config.dtype, loaded_model=model, structured_outputs_jump_forward=jf)
        for jf in (True, False)
    }
    conversations = [chat(f"Employee record number {i} as JSON.") for i in range(8)]
    params = SamplingParams(
        max_tokens=200, temperature=0.0, structured_outputs=StructuredOutputsParams(json=RECORD)
    )
    rates: dict[bool, list[float]] = {True: [], False: []}
    tokens_of: dict[bool, list] = {}
    for llm in engines.values():
        llm.chat(conversations[:1], params, use_tqdm=False)  # warm
    for _ in range(repeats):
        for jf, llm in engines.items():
            started = time.perf_counter()
            outputs = llm.chat(conversations, params, use_tqdm=False)
            wall = time.perf_counter() - started
            tokens_of[jf] = [list(o.outputs[0].token_ids) for o in outputs]
            rates[jf].append(sum(len(t) for t in tokens_of[jf]) / wall)
    speedups = [a / b for a, b in zip(rates[True], rates[False], strict=True)]
    return {
        "tok_s_with": statistics.median(rates[True]),
        "tok_s_without": statistics.median(rates[False]),
        "speedup_median": statistics.median(speedups),
        "speedup_min": min(speedups),
        "speedup_max": max(speedups),
        "identical": tokens_of[True] == tokens_of[False],
        "tokens": sum(len(t) for t in tokens_of[True]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="validity,compile,mask,jump")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    print(describe_cpu())
    model = load_model(None, dtype="bfloat16")
    llm = LLM(dtype="bfloat16", loaded_model=model)
    results: dict = {"cpu": describe_cpu()}
    if "validity" in parts:
        results["validity"] = r = validity(llm)
        print(
            f"validity: {r['valid']}/{r['finished']} finished answers valid "
            f"({r['finished']}/{r['schemas']} finished), {r['tokens_per_s']:.1f} tok/s"
        )
        for name, ok, took, message in r["refused"]:
            verdict = "ok" if ok else "UNEXPECTED"
            print(f"  refused {name}: {verdict} in {took * 1000:.1f} ms: {message}")
        for failure in r["failures"]:
            print("  invalid:", failure)
    if "compile" in parts:
        results["compile"] = r = compile_times(llm)
        print("compile (ms):", {k: round(v, 3) for k, v in r.items()})
    if "mask" in parts:
        results["mask"] = r = mask_overhead(model, args.repeats)
        print("mask overhead:", {k: round(v, 4) for k, v in r.items()})
    if "jump" in parts:
        results["jump"] = r = jump_forward(model, args.repeats)
        print("jump-forward:", r)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
