"""The stream pool (csrc/common/stream_pool.h), the helper threads every native kernel runs its
chunks on, under a stress that slows claims at random: `native/stream_pool_stress.cpp`, built
here with the system's C++ compiler against the kernels' own header. Before the pool kept each
job's function and chunk count in a slot of its generation's parity, the first mode failed
within about 10,000 jobs (a chunk of a finished job ran the next job's function, twice and
uncounted, and the caller returned with a chunk still running: the crash in the paged kernel,
BENCHMARKS.md §52), and the second aborted the process (a helper's exception ended it)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from prefixserve.model.kernels import build

STRESS = Path(__file__).parent / "native" / "stream_pool_stress.cpp"
JOBS = 50_000


@pytest.fixture(scope="module")
def stress(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stress program, built -O2 against the kernels' stream_pool.h."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler here (the kernels cannot be built either)")
    binary = tmp_path_factory.mktemp("stream_pool") / "stream_pool_stress"
    include = build._CSRC / "common"
    subprocess.run(
        [compiler, "-O2", "-std=c++17", "-pthread", f"-I{include}", str(STRESS), "-o", binary],
        check=True,
        timeout=300,
    )
    return binary


def _run(binary: Path, mode: str) -> None:
    done = subprocess.run(
        [binary, mode, str(JOBS)], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)


def test_every_chunk_runs_once_and_none_runs_after_its_job_returned(stress: Path):
    _run(stress, "jobs")


def test_a_chunk_that_throws_reaches_the_caller_after_every_started_chunk_finished(stress: Path):
    _run(stress, "throw")


def test_jobs_run_whole_across_the_generation_counters_wrap(stress: Path):
    """A guard of the 32-bit mask, not a failure seen: the pool before passed it too (the job
    whose generation shifted out of the word was run whole by its helpers)."""
    _run(stress, "wrap")
