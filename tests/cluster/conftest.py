"""Fixtures of the cluster tests: a tiny random-weight model with the default model's tokenizer
(tests.helpers.models.tiny_llama_dir), served by replicas on one local Ray runtime
(tests.helpers.cluster.start_ray), which ends with the last test of this folder."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.helpers.models import tiny_llama_dir


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama"))


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Shut the tests' Ray runtime down once the next test is not in this folder."""
    here = Path(__file__).parent
    if nextitem is not None and here in nextitem.path.parents:
        return
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
