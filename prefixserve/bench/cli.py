"""`prefixserve bench ...`: argparse setup, registered into prefixserve/cli.py by `configure`.

    prefixserve bench run --base-url http://127.0.0.1:8000 --workloads W1
    prefixserve bench compare --engines prefixserve,vllm,llama.cpp --workloads W0,W1,W2,W3
    prefixserve bench report --out bench-results

`run` drives one running OpenAI-compatible server with this package's client and workloads;
`report` rebuilds the tables of a results directory. `compare` (start prefixserve's and its
peers' servers one after another) and the figures are the comparison harness in
benchmarks/serving/ of a source checkout: when prefixserve is installed from a checkout
(editable), `compare` hands it every argument after its name and `run` / `report` draw its
figures too; from a plain install `compare` says where to run it and `run` / `report` write
tables only. All of them need the `bench` extra (httpx; matplotlib for the figures).

Also runnable as ``python -m prefixserve.bench ...`` with the same arguments after ``bench``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from prefixserve.bench.workloads import DEFAULT_WORKLOADS

# What the `bench` extra installs; a command missing one of them says how to get it.
EXTRA_MODULES = ("httpx", "matplotlib")
INSTALL_HINT = "pip install 'prefixserve[bench]' (in a checkout: pip install -e '.[bench]')"


class HarnessUnavailable(RuntimeError):
    """The comparison harness (benchmarks/serving/) is not next to the installed package."""


def checkout_root() -> Path | None:
    """The source checkout prefixserve is imported from (an editable install), if it holds the
    comparison harness benchmarks/serving/; None for a plain install."""
    root = Path(__file__).resolve().parents[2]
    harness = root / "benchmarks" / "serving" / "__init__.py"
    return root if harness.is_file() and (root / "pyproject.toml").is_file() else None


def load_harness(module: str) -> ModuleType:
    """Import `benchmarks.serving.<module>` from the checkout prefixserve is imported from.

    Raises HarnessUnavailable, saying what to do, when prefixserve is not installed from a
    checkout."""
    root = checkout_root()
    if root is None:
        raise HarnessUnavailable(
            "this command starts other engines' servers and draws figures: it is not in the "
            "installed package but in benchmarks/serving/ of a prefixserve source checkout. "
            "Clone the repository, install it there with `pip install -e '.[bench]'` (or "
            "`make install`), and run the command from that install (or `python -m "
            "benchmarks.serving ...` in the checkout's root)"
        )
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        mod = importlib.import_module(f"benchmarks.serving.{module}")
    except ModuleNotFoundError as exc:  # another top-level `benchmarks` shadows the checkout's
        if exc.name is None or not exc.name.startswith("benchmarks"):
            raise  # a missing dependency of the harness: the caller names the extra
        why = f"cannot import the checkout's benchmarks.serving ({exc})"
        raise HarnessUnavailable(why) from exc
    if not Path(mod.__file__ or "").resolve().is_relative_to(root):
        raise HarnessUnavailable(f"`benchmarks` is not the checkout's ({mod.__file__})")
    return mod


def csv_list(value: str) -> list[str]:
    """An argparse type: "a, b,c" -> ["a", "b", "c"]."""
    return [v.strip() for v in value.split(",") if v.strip()]


def default_model_dir() -> Path:
    """The packaged default model's HF directory (converted on first use)."""
    from prefixserve.model.loader.default_model import ensure_default_model

    return Path(ensure_default_model())


def add_load_args(p: argparse.ArgumentParser) -> None:
    """The workload and load flags shared by `run` and `compare`."""
    p.add_argument(
        "--workloads",
        type=csv_list,
        default=list(DEFAULT_WORKLOADS),
        help="comma-separated subset of W0-W9 (default: W0,W1,W2,W3; W4 and W5 want a small "
        "KV pool on every engine: compare's --kv-pool-tokens; W6 restarts the server, so only "
        "compare runs it; W7 is copy-heavy, for speculative decoding; W8 is multi-tenant, for "
        "replicas, with --request-rate; W9 is agents: --sessions chats of --turns tool turns)",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=8,
        help="requests in flight (closed loop), or the cap with --request-rate",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="Poisson arrivals at this many requests/s instead of a closed loop",
    )
    p.add_argument(
        "--sessions",
        type=int,
        default=8,
        help="W9: agent sessions run side by side (times --scale; W9 ignores --concurrency and "
        "--request-rate: each session sends its next turn when the previous one finished)",
    )
    p.add_argument("--turns", type=int, default=6, help="W9: tool turns per session")
    p.add_argument(
        "--no-strict-tools",
        dest="strict_tools",
        action="store_false",
        help='W9: send the tools without "strict": true (vLLM then leaves arguments free)',
    )
    p.add_argument("--seed", type=int, default=0, help="workload and arrival seed")
    p.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiply the number of requests of every workload (not their lengths)",
    )
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="HF model dir (default: the packaged default model, bf16)",
    )
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="results directory")


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `bench` command (with compare / run / report) to a CLI's subparsers."""
    bench = subparsers.add_parser("bench", help="serving benchmarks: ours beside vLLM, llama.cpp")
    bench.set_defaults(_run=configure(bench))
    return bench


def configure(bench: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    """Add compare / run / report to the `bench` parser; return the function that runs them
    (what prefixserve/cli.py's `@subcommand` hook expects). Imports nothing beyond the
    workloads' names: `prefixserve serve` builds this parser too."""
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND", required=True)

    # The harness parses its own flags (and --help): no prefix characters here, so every
    # argument after `compare`, `--engines ...` included, is collected as it is.
    cmp_ = sub.add_parser(
        "compare",
        help="run engines one after another on the same workloads (from a checkout)",
        add_help=False,
        prefix_chars="\0",
    )
    cmp_.add_argument("argv", nargs=argparse.REMAINDER)
    cmp_.set_defaults(func=_cmd_compare)

    run = sub.add_parser("run", help="drive one running OpenAI-compatible server")
    run.add_argument("--base-url", required=True)
    run.add_argument("--served-model", default=None, help="model name (default: /v1/models)")
    run.add_argument("--prompt-format", choices=["tokens", "text"], default="tokens")
    run.add_argument("--name", default="server", help="engine name in the results")
    run.add_argument(
        "--extra-body",
        type=_json_object,
        default={},
        help="JSON object merged into every request body, e.g. '{\"cache_report\": true}'",
    )
    add_load_args(run)
    run.set_defaults(func=_cmd_run)

    rep = sub.add_parser("report", help="rebuild tables and figures from a results directory")
    rep.add_argument("--out", type=Path, default=Path("bench-results"))
    rep.add_argument("--workloads", type=csv_list, default=list(DEFAULT_WORKLOADS))
    rep.set_defaults(func=_cmd_report)
    return _dispatch


def _dispatch(args: argparse.Namespace) -> int:
    try:
        return int(args.func(args))
    except ModuleNotFoundError as exc:
        if exc.name not in EXTRA_MODULES:
            raise
        print(
            f"prefixserve bench {args.bench_command}: {exc.name} is not installed "
            f"(a server install leaves it out); {INSTALL_HINT}",
            file=sys.stderr,
        )
        return 2


def _cmd_compare(args: argparse.Namespace) -> int:
    try:
        harness = load_harness("cli")
    except HarnessUnavailable as exc:
        print(f"prefixserve bench compare: {exc}", file=sys.stderr)
        return 2
    return int(harness.main(args.argv, prog="prefixserve bench compare"))


def _report(out: Path, workloads: list[str]) -> str:
    """Write the tables (and summary.json) of every result under `out`, and print them; the
    figures too where the checkout's harness is there to draw them."""
    try:
        compare = load_harness("compare")
    except HarnessUnavailable:
        why = "they are drawn by benchmarks/serving/ of a source checkout"
    except ModuleNotFoundError as exc:
        if exc.name not in EXTRA_MODULES:
            raise
        why = f"{exc.name} is not installed; {INSTALL_HINT}"
    else:
        return compare.report(out, workloads)
    from prefixserve.bench.results import report

    print(f"(no figures: {why})", file=sys.stderr)
    return report(out, workloads)


def _cmd_run(args: argparse.Namespace) -> int:
    import httpx
    from tqdm import tqdm

    from prefixserve.bench.agent_workload import AGENT_WORKLOADS
    from prefixserve.bench.client import EndpointConfig, run_workload
    from prefixserve.bench.results import result_path
    from prefixserve.bench.server_counters import scrape_spec_decode, spec_decode_delta
    from prefixserve.bench.summary import summarize
    from prefixserve.bench.workloads import (
        RESTART_WORKLOADS,
        TEXT_WORKLOADS,
        load_text_encoder,
        load_token_pool,
        make_workload,
        prepend_tokens,
    )

    agents = [w.upper() for w in args.workloads if w.upper() in AGENT_WORKLOADS]
    args.workloads = [w for w in args.workloads if w.upper() not in AGENT_WORKLOADS]
    restarts = [w for w in args.workloads if w.upper() in RESTART_WORKLOADS]
    if restarts:
        print(
            f"prefixserve bench run: {', '.join(restarts)} restarts the server between passes; "
            "run it with `prefixserve bench compare`",
            file=sys.stderr,
        )
        return 2
    served = args.served_model
    if served is None:
        served = httpx.get(args.base_url.rstrip("/") + "/v1/models", timeout=10).json()["data"][0][
            "id"
        ]
    if agents:
        _run_agents(args, served)
    if not args.workloads:
        print(_report(args.out, agents))
        return 0
    model_dir = args.model or default_model_dir()
    pool, decode, special_prefix = load_token_pool(model_dir)
    wants_text = any(w.upper() in TEXT_WORKLOADS for w in args.workloads)
    text = load_text_encoder(model_dir) if wants_text else None
    endpoint = EndpointConfig(
        base_url=args.base_url,
        model=served,
        prompt_format=args.prompt_format,
        extra_body={"ignore_eos": True, **args.extra_body},
    )
    for name in args.workloads:
        workload = make_workload(
            name, pool, seed=args.seed, scale=args.scale, decode=decode, text=text
        )
        prepend_tokens(workload.requests, special_prefix)
        # the server's speculative-decoding counters over the run, where it exports them
        before = scrape_spec_decode(args.base_url)
        with tqdm(total=len(workload.requests), desc=f"{args.name}: {workload.name}") as bar:
            result = asyncio.run(
                run_workload(
                    workload.requests,
                    endpoint,
                    concurrency=args.concurrency,
                    request_rate=args.request_rate,
                    seed=args.seed,
                    on_done=lambda _: bar.update(1),
                )
            )
        spec_decode = spec_decode_delta(before, scrape_spec_decode(args.base_url))
        summary = summarize(result.records, result.duration).with_spec_decode(spec_decode)
        path = result_path(args.out, workload.name, args.name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            json.dumps(
                {
                    "engine": args.name,
                    "workload": workload.name,
                    "description": workload.description,
                    "seed": args.seed,
                    "scale": args.scale,
                    "base_url": args.base_url,
                    "spec_decode": spec_decode,
                    "summary": summary.to_dict(),
                    "run": result.to_dict(),
                },
                indent=1,
            )
        )
    print(_report(args.out, [*agents, *(w.upper() for w in args.workloads)]))
    return 0


def _run_agents(args: argparse.Namespace, served: str) -> None:
    """W9 against the server `args.base_url`: write `<out>/W9/<name>.json`."""
    import httpx
    from tqdm import tqdm

    from prefixserve.bench.agent_summary import result_payload
    from prefixserve.bench.agent_workload import AgentConfig, run_agent_workload
    from prefixserve.bench.results import result_path
    from prefixserve.bench.server_counters import scrape_spec_decode, spec_decode_delta
    from prefixserve.bench.workload_types import scaled

    config = AgentConfig(
        sessions=scaled(args.sessions, args.scale),
        turns=args.turns,
        seed=args.seed,
        strict=args.strict_tools,
    )
    before = scrape_spec_decode(args.base_url)
    with tqdm(total=config.num_requests, desc=f"{args.name}: W9") as bar:
        run = asyncio.run(
            run_agent_workload(
                args.base_url,
                served,
                config,
                extra_body=args.extra_body,
                on_done=lambda _: bar.update(1),
            )
        )
    try:
        alive = httpx.get(args.base_url.rstrip("/") + "/v1/models", timeout=10).status_code == 200
    except httpx.HTTPError:
        alive = False
    path = result_path(args.out, "W9", args.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    spec_decode = spec_decode_delta(before, scrape_spec_decode(args.base_url))
    payload = result_payload(
        args.name, config, run, alive, base_url=args.base_url, spec_decode=spec_decode
    )
    path.write_text(json.dumps(payload, indent=1))


def _cmd_report(args: argparse.Namespace) -> int:
    print(_report(args.out, [w.upper() for w in args.workloads]))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m prefixserve.bench ...`: the `bench` command on its own."""
    parser = argparse.ArgumentParser(prog="python -m prefixserve.bench")
    subparsers = parser.add_subparsers(dest="command", required=True)
    register(subparsers)
    args = parser.parse_args(["bench", *(argv if argv is not None else sys.argv[1:])])
    return int(args._run(args))


def _json_object(text: str) -> dict:
    """A command-line JSON object (argparse turns the ValueError into a usage error)."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {text!r}")
    return value
