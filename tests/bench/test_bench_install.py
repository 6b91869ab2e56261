"""What a server install needs: no plotting library nor HTTP client on import, `serve` without the
`bench` extra, and `prefixserve bench` naming what is missing instead of a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from prefixserve.bench import cli as bench_cli
from prefixserve.bench.cli import main as bench_main


def _python(code: str, cwd) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def test_the_server_and_the_cli_import_neither_matplotlib_nor_httpx(tmp_path):
    code = (
        "import sys, prefixserve, prefixserve.entrypoints.api_server, prefixserve.cli\n"
        "prefixserve.cli.build_parser()\n"
        "extra = ('matplotlib', 'httpx', 'benchmarks')\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in extra)\n"
        "assert not loaded, loaded\n"
    )
    done = _python(code, tmp_path)
    assert done.returncode == 0, done.stderr


def test_without_the_bench_extra_serve_parses_and_bench_run_names_the_extra(tmp_path):
    code = (
        "import sys\n"
        "sys.modules['httpx'] = sys.modules['matplotlib'] = None  # not installed\n"
        "from prefixserve.cli import build_parser, main\n"
        "build_parser().parse_args(['serve', '--port', '9000'])\n"
        "sys.exit(main(['bench', 'run', '--base-url', 'http://127.0.0.1:9']))\n"
    )
    done = _python(code, tmp_path)
    assert done.returncode == 2, done.stderr
    assert "httpx is not installed" in done.stderr
    assert "pip install 'prefixserve[bench]'" in done.stderr


def test_compare_hands_every_argument_to_the_checkouts_harness(capsys):
    assert bench_cli.checkout_root() is not None  # these tests run in a checkout
    with pytest.raises(SystemExit) as exit_:
        bench_main(["compare", "--engines", "vllm", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: prefixserve bench compare") and "--figures-dir" in out
    with pytest.raises(SystemExit) as exit_:
        bench_main(["compare", "--no-such-flag"])
    assert exit_.value.code == 2


def test_compare_from_a_plain_install_says_where_it_lives(monkeypatch, capsys):
    monkeypatch.setattr(bench_cli, "checkout_root", lambda: None)
    assert bench_main(["compare", "--engines", "vllm"]) == 2
    err = capsys.readouterr().err
    assert "benchmarks/serving/" in err and "pip install -e '.[bench]'" in err
