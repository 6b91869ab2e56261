// A stress of StreamPool (prefixserve/model/kernels/csrc/common/stream_pool.h), built and run by
// tests/model/test_stream_pool.py. Claims are slowed at random (the header's test hook) so that
// helpers linger in a finished job's claim while the next job is set up, the window where a
// chunk once ran twice and a caller returned with a chunk still running.
//
//   stream_pool_stress jobs  every chunk of every job runs exactly once, none after run() returns
//   stream_pool_stress throw chunks that throw (on the caller or a helper) reach the caller,
//                            after every started chunk has finished; the pool keeps working
//   stream_pool_stress wrap  jobs across the generation counter's wrap
// Prints what went wrong and exits 1, or exits 0.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <stdexcept>
#include <thread>

namespace {
thread_local uint32_t delay_seed = 0x9e3779b9u;
// One claim in 64 waits 50 us between loading the claim word and reading the chunk count.
void claim_delay() {
  delay_seed = delay_seed * 1103515245u + 12345u;
  if ((delay_seed >> 16) % 64 == 0) std::this_thread::sleep_for(std::chrono::microseconds(50));
}
}  // namespace

#define PREFIXSERVE_STREAM_POOL_CLAIM_DELAY() claim_delay()
#include "stream_pool.h"

namespace {

std::atomic<int64_t> in_flight{0}, executions{0};

// A chunk's work: counted while it runs, a little arithmetic in between.
void chunk_work() {
  in_flight.fetch_add(1);
  for (volatile int i = 0; i < 64; ++i) {
  }
  executions.fetch_add(1);
  in_flight.fetch_sub(1);
}

// `jobs` jobs on `pool`, small and large in turn (a helper done with a small job meets a large
// one); false (after printing) at the first job whose count is off or that left a chunk running.
bool run_jobs(prefixserve::StreamPool& pool, int64_t jobs) {
  std::mt19937 rng(7);
  const std::function<void(int64_t)> fn = [](int64_t) { chunk_work(); };
  for (int64_t j = 0; j < jobs; ++j) {
    const int64_t n = j % 2 ? 2 + rng() % 3 : 8 + rng() % 24;
    executions.store(0);
    pool.run(n, 2, fn, /*compute_bound=*/true);
    const int64_t running = in_flight.load(), ran = executions.load();
    if (running != 0 || ran != n) {
      std::printf("job %lld: %lld chunks, %lld ran, %lld still running at return\n",
                  static_cast<long long>(j), static_cast<long long>(n),
                  static_cast<long long>(ran), static_cast<long long>(running));
      return false;
    }
  }
  return true;
}

// Jobs whose chunks `bad` and `bad` + 8 throw (at times one on the caller, one on a helper):
// the caller gets an exception once every started chunk is done, and the job after it, whose
// chunks do not throw, gets none (no exception is left in the pool for a later job).
bool run_throwing(prefixserve::StreamPool& pool, int64_t jobs) {
  const std::function<void(int64_t)> clean = [](int64_t) { chunk_work(); };
  for (int64_t j = 0; j < jobs; ++j) {
    const int64_t n = 16, bad = j % 8;
    const std::function<void(int64_t)> fn = [bad](int64_t c) {
      chunk_work();
      if (c % 8 == bad) throw std::runtime_error("chunk failed");
    };
    bool caught = false, after = false;
    try {
      pool.run(n, 2, fn, true);
    } catch (const std::runtime_error&) {
      caught = true;
    }
    const int64_t running = in_flight.load();
    try {
      pool.run(n, 2, clean, true);
    } catch (const std::runtime_error&) {
      after = true;
    }
    if (!caught || after || running != 0) {
      std::printf("job %lld: caught %d, %lld still running at return, the next job threw %d\n",
                  static_cast<long long>(j), caught, static_cast<long long>(running), after);
      return false;
    }
  }
  return run_jobs(pool, 1000);  // and the pool still runs jobs whole
}

}  // namespace

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "jobs";
  const int64_t jobs = argc > 2 ? std::atoll(argv[2]) : 100000;
  bool ok = false;
  if (std::strcmp(mode, "jobs") == 0) {
    ok = run_jobs(*new prefixserve::StreamPool(), jobs);  // helpers outlive main: never freed
  } else if (std::strcmp(mode, "throw") == 0) {
    ok = run_throwing(*new prefixserve::StreamPool(), jobs);
  } else if (std::strcmp(mode, "wrap") == 0) {
    ok = run_jobs(*new prefixserve::StreamPool(0xffffffffu - static_cast<uint32_t>(jobs / 2)),
                  jobs);
  } else {
    std::printf("unknown mode %s\n", mode);
  }
  return ok ? 0 : 1;
}
