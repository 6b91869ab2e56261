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
def default_model_fp32():
    from prefixserve.model.loader.loading import load_model

    return load_model(None, dtype="float32")


# ---- model loading: the packaged default model, converted once into the cache.
@pytest.fixture(scope="session")
def default_model_dir():
    """The converted SmolLM2-135M-Instruct HF directory (converted on first use)."""
    from prefixserve.model.loader.default_model import ensure_default_model

    return ensure_default_model()


def greedy_generate(loaded, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding through our ModelRunner with a plain argmax loop: one prefill step, then
    one decode step per token, stopping at an eos id. No scheduler, no engine."""
    from prefixserve.core.request import Request
    from prefixserve.core.sched.output import ScheduledRequest, SchedulerOutput
    from prefixserve.sampling_params import SamplingParams
    from prefixserve.worker.model_runner import ModelRunner

    def argmax(logits, requests, generators):
        return [(int(row.argmax()), None) for row in logits]

    block_size = 16
    num_blocks = (len(prompt_ids) + max_new_tokens) // block_size + 2
    runner = ModelRunner(
        loaded.model,
        loaded.config,
        num_blocks=num_blocks + 1,
        block_size=block_size,
        sampler=argmax,
    )
    block_ids = tuple(list(range(1, num_blocks + 1)) for _ in loaded.config.kv_cache_groups())
    request = Request("greedy", prompt_ids, SamplingParams(temperature=0.0))
    computed, new = 0, len(prompt_ids)
    for _ in range(max_new_tokens):
        out = runner.execute(SchedulerOutput([ScheduledRequest(request, computed, new, block_ids)]))
        token = out.sampled_token_ids["greedy"]
        request.append_output_token_ids(token)
        if token in loaded.tokenizer.eos_token_ids:
            break
        computed, new = request.num_tokens - 1, 1
    return request.output_token_ids


@pytest.fixture(scope="session")
def greedy():
    """`greedy(loaded, prompt_ids, max_new_tokens) -> output ids` (see greedy_generate)."""
    return greedy_generate


# ---- `make check`: the inner loop's tier. A test is "full" (left to `make test`) when it starts a
# server, Ray or a model conversion, or loads the packaged model; everything else runs in both.
_FULL_DIRS = ("server", "cluster", "bench", "model")
_FULL_FIXTURES = {"default_model_bf16", "default_model_fp32", "default_model_dir", "greedy"}


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "full: needs a server, Ray, a model conversion or the packaged model"
    )


def pytest_collection_modifyitems(config, items):
    root = config.rootpath / "tests"
    for item in items:
        folder = item.path.relative_to(root).parts[0]
        if folder in _FULL_DIRS or _FULL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.full)
