"""The eviction simulator (prefixserve.bench.eviction_sim, which benchmarks/bench_eviction.py
runs) on a crafted burst: longest-prefix admission beats FCFS on hits, and its aging bounds how
often and how long a passed-over request waits."""

from __future__ import annotations

from prefixserve.bench.eviction_sim import simulate
from prefixserve.bench.workloads import BenchRequest

AGE_LIMIT = 16  # promote_longest_prefix's default
STEPS_PER_REQUEST = 2  # an 80-token prompt fits one step; 2 output tokens


def _request(name: str, i: int) -> BenchRequest:
    """A 64-token prefix (4 blocks) `name` with its own 16-token suffix and 2 output tokens: the
    request holds 6 blocks, so a 6-block pool caches one prefix at a time."""
    prefix = [1000 + 1000 * (ord(name) - ord("A")) + k for k in range(64)]
    suffix = [5000 + 16 * (2 * i + (name == "B")) + k for k in range(16)]
    return BenchRequest(f"{name}{i}", prefix + suffix, 2)


def _alternating(n: int) -> list[BenchRequest]:
    """A0, B0, A1, B1, ...: in arrival order every request evicts the prefix the next one needs."""
    return [_request(name, i) for i in range(n) for name in "AB"]


def test_longest_prefix_beats_fcfs_with_bounded_waits():
    requests = _alternating(24)
    fcfs = simulate(requests, "lru", 6, 1, "fcfs", "burst")
    longest = simulate(requests, "lru", 6, 1, "longest_prefix", "burst")
    assert fcfs["hit_rate"] == 0.0  # the crafted thrash: each request evicts the next one's prefix
    assert longest["hit_rate"] > 0.5
    assert longest["computed"] < fcfs["computed"]
    assert fcfs["max_passed_over"] == 0
    # Bounded: nobody is passed over more than age_limit times, nor starts more than about
    # age_limit admissions (STEPS_PER_REQUEST steps each at one running request) later than in
    # arrival order. Here the 16-request window alone bounds it (once it holds only B requests,
    # B0 goes first); the next test needs the aging.
    assert 0 < longest["max_passed_over"] <= AGE_LIMIT
    extra = max(longest["waits"][i] - fcfs["waits"][i] for i in fcfs["waits"])
    assert 0 < extra <= (AGE_LIMIT + 1) * STEPS_PER_REQUEST
    # Every request ran to the end; with equal service times the order only permutes the waits.
    assert longest["steps"] == fcfs["steps"] == len(requests) * STEPS_PER_REQUEST
    assert sorted(longest["waits"].values()) == sorted(fcfs["waits"].values())


def test_aging_admits_a_passed_over_request_after_age_limit_passes():
    """A0, B0, A1..A31: with A cached, every A in the window beats B0, so only aging admits it
    before the A requests run out (without it B0 would be passed over 31 times)."""
    requests = [_request("A", 0), _request("B", 0)] + [_request("A", i) for i in range(1, 32)]
    fcfs = simulate(requests, "lru", 6, 1, "fcfs", "burst")
    longest = simulate(requests, "lru", 6, 1, "longest_prefix", "burst")
    assert longest["max_passed_over"] == AGE_LIMIT
    assert longest["hit_rate"] >= fcfs["hit_rate"]
    extra = longest["waits"]["B0"] - fcfs["waits"]["B0"]
    assert extra == AGE_LIMIT * STEPS_PER_REQUEST


def test_closed_loop_default_is_unchanged():
    """Closed arrival with fcfs is the simulator as it was: nobody waits in a 1-request loop."""
    r = simulate(_alternating(4), "lru", 6, 1)
    assert r["hit_rate"] == 0.0 and r["wait_max"] == 0 and r["max_passed_over"] == 0
