"""Fixtures of the cluster tests: a tiny random-weight model with the default model's tokenizer
(tests.helpers.models.tiny_llama_dir), served by replicas on a local Ray runtime."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.models import tiny_llama_dir


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama"))
