// Helper threads for a step's heavy work, independent of OpenMP: the linears' memory-bound
// streams and GEMMs (gemv.cpp, linear_int8.cpp, gemm_bf16.cpp) and the attention kernels' work
// items (paged_attention.cpp, paged_lanes.cpp, prefill_attention.cpp), so that no OpenMP thread
// competes with a spinning helper for the cores.
//
// Why not at::parallel_for: prefixserve runs OpenMP with OMP_WAIT_POLICY=PASSIVE (spinning
// workers make everything crawl on a shared CPU), so each parallel region wakes sleeping threads
// through the kernel, which costs ~30 us on the hosts measured; a decode step makes ~120 linears.
// These helpers instead spin for a bounded time (kSpinMicros) after each job, so back-to-back
// jobs of one step find them awake, and sleep once the step is over.
//
// Work is claimed chunk by chunk from one atomic word (job generation in the high 32 bits, next
// chunk in the low 32), so the caller never waits on a helper that is not running: it claims
// whatever is left itself and waits only for chunks a helper has already started. A job's
// function and chunk count sit in one of two slots, by its generation's parity: a helper that
// loaded the word of a finished job and reads the count late reads that job's own count (the
// next job writes the other slot before it is published), so it cannot claim a chunk past the
// finished job's end while the word is still unchanged. With one slot it could: it ran the next
// job's function on a chunk of no job, twice and uncounted, and the caller then returned with a
// chunk still running on its dead frame (a crash in the paged kernel, BENCHMARKS.md §52).
// A chunk that throws ends its job early: the chunks no one started are dropped, the caller
// waits for those running, then rethrows an exception of the job's: its own, else the first
// helper's (both are taken, so none is left for a later job). When the
// helpers show they are not getting a core, the pool runs jobs on the caller alone for a while
// (see kStallMicros). A process
// forked after the helpers started has none: its caller does every chunk.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include <unistd.h>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace prefixserve {

class StreamPool {
 public:
  // A pool whose first job has generation `generation` + 1 (tests start near the wrap).
  explicit StreamPool(uint32_t generation = 0) : next_(uint64_t{generation} << 32) {}

  // How many times the pool has stepped back to the caller alone (for tests and benchmarks).
  int64_t backoffs() const { return backoffs_.load(std::memory_order_relaxed); }

  // Runs fn(chunk) for every chunk in [0, num_chunks) on the caller and up to `workers - 1`
  // helpers; returns when all are done. A second caller while one runs (two engines on two
  // threads) does its job alone. A `compute_bound` job (a prefill-sized GEMM: its chunks are
  // arithmetic, not a memory stream) neither backs off nor counts toward backing off: alone it
  // would take twice as long, while a helper descheduled now and then costs it only that wait.
  void run(int64_t num_chunks, int64_t workers, const std::function<void(int64_t)>& fn,
           bool compute_bound = false) {
    if (num_chunks <= 0) return;
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    const bool back_off = backoff_ > 0 && !compute_bound;
    if (workers <= 1 || num_chunks == 1 || !busy.owns_lock() || back_off) {
      if (busy.owns_lock() && back_off) --backoff_;
      for (int64_t c = 0; c < num_chunks; ++c) fn(c);
      return;
    }
    ensure_helpers(workers - 1);
    const uint64_t gen = ((next_.load(std::memory_order_relaxed) >> 32) + 1) & kGenMask;
    fn_[gen & 1].store(&fn, std::memory_order_relaxed);
    num_chunks_[gen & 1].store(num_chunks, std::memory_order_release);
    max_helpers_.store(workers - 1, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    next_.store(gen << 32, std::memory_order_seq_cst);  // publishes the fields above
    if (sleeping_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      cv_.notify_all();
    }
    std::exception_ptr error;
    const int64_t mine = run_claimed(gen, &error);
    done_.fetch_add(mine, std::memory_order_acq_rel);
    // Only chunks a helper has claimed remain: it is running them, unless it was descheduled.
    bool stalled = false;
    if (done_.load(std::memory_order_acquire) < num_chunks) {
      const auto start = std::chrono::steady_clock::now();
      for (int spins = 0; done_.load(std::memory_order_acquire) < num_chunks; ++spins) {
        if (spins < 4096) {
          pause();
        } else {
          std::this_thread::yield();
        }
      }
      stalled = std::chrono::steady_clock::now() - start >
                std::chrono::microseconds(kStallMicros);
    }
    if (!compute_bound) note_job(num_chunks, num_chunks - mine, stalled);
    // A helper's exception is taken whether or not the caller's own chunk threw (left in the
    // pool, a later job would throw it); the caller's is thrown first.
    const std::exception_ptr helper_error = take_helper_error();
    if (error) std::rethrow_exception(error);
    if (helper_error) std::rethrow_exception(helper_error);
  }

  // Asks the helpers to bring [p, p + bytes) toward their caches while they wait for the next
  // job (the next linear's weight, read while the caller runs Python between two linears). A
  // hint: prefetches never fault, so a region freed meanwhile costs nothing but the reads.
  void prefetch(const void* p, int64_t bytes) {
    pf_bytes_.store(std::min<int64_t>(bytes, kPrefetchMaxBytes), std::memory_order_relaxed);
    pf_next_.store(0, std::memory_order_relaxed);
    pf_ptr_.store(static_cast<const char*>(p), std::memory_order_release);
  }

 private:
  static constexpr int64_t kPrefetchPiece = 16 * 1024;
  static constexpr int64_t kPrefetchMaxBytes = 1536 * 1024;

  // One piece of the pending prefetch, if any is left; false when none.
  bool prefetch_piece() {
    const char* base = pf_ptr_.load(std::memory_order_acquire);
    if (base == nullptr) return false;
    const int64_t bytes = pf_bytes_.load(std::memory_order_relaxed);
    const int64_t off = pf_next_.fetch_add(kPrefetchPiece, std::memory_order_relaxed);
    if (off >= bytes) {
      pf_ptr_.compare_exchange_strong(base, nullptr, std::memory_order_relaxed);
      return false;
    }
#if defined(__SSE2__)
    for (int64_t b = off; b < std::min(bytes, off + kPrefetchPiece); b += 64)
      _mm_prefetch(base + b, _MM_HINT_T1);
#endif
    return true;
  }

  static constexpr int64_t kSpinMicros = 200;
  // Signs that the helpers are not getting a core (other processes on this CPU): the caller
  // waited this long for a helper's chunk kStallsToBackOff times within the last kWindowJobs
  // jobs, or the helpers ran under 1/8 of their chunks. Then the next kBackoffJobs jobs (a few
  // decode steps) run on the caller alone, and the helpers go to sleep: with one busy process
  // beside a two-thread engine, decode batch 1 ran 20.2 ms with the helpers against 16.2
  // without them. One stall is not enough: on a virtual machine whose host takes a core away now
  // and then, backing off at the first stall left decode on one thread most of the time (a
  // decode step of the default model 32.6 ms against 18.1 with the helpers kept).
  static constexpr int64_t kStallMicros = 300;
  static constexpr int64_t kStallsToBackOff = 8;
  static constexpr int64_t kWindowJobs = 256;
  static constexpr int64_t kBackoffJobs = 1024;

  // Caller-side bookkeeping of the contention signs above (under busy_).
  void note_job(int64_t chunks, int64_t helper_chunks, bool stalled) {
    window_chunks_ += chunks;
    window_helper_chunks_ += helper_chunks;
    window_stalls_ += stalled ? 1 : 0;
    const bool starved = ++window_jobs_ >= kWindowJobs && 8 * window_helper_chunks_ < window_chunks_;
    const bool stalling = window_stalls_ >= kStallsToBackOff;
    if (window_jobs_ >= kWindowJobs) window_jobs_ = window_chunks_ = window_helper_chunks_ = 0;
    if (window_jobs_ == 0) window_stalls_ = 0;
    if (stalling || starved) {
      backoffs_.fetch_add(1, std::memory_order_relaxed);
      backoff_ = kBackoffJobs;
      window_jobs_ = window_chunks_ = window_helper_chunks_ = window_stalls_ = 0;
    }
  }

  static void pause() {
#if defined(__SSE2__)
    _mm_pause();
#endif
  }

  // The next unclaimed chunk of job `gen`, or -1 when none is left (or the job is over).
  int64_t claim(uint64_t gen) {
    uint64_t v = next_.load(std::memory_order_acquire);
#ifdef PREFIXSERVE_STREAM_POOL_CLAIM_DELAY
    PREFIXSERVE_STREAM_POOL_CLAIM_DELAY();  // tests widen the window between the two loads
#endif
    // (acquire: the count of the job two generations on was written after the job between was
    // published, so a claim that read it sees the word changed and its exchange fails)
    while ((v >> 32) == gen && static_cast<int64_t>(v & 0xffffffffu) <
                                   num_chunks_[gen & 1].load(std::memory_order_acquire)) {
      if (next_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel)) {
        return static_cast<int64_t>(v & 0xffffffffu);
      }
    }
    return -1;
  }

  // Claims and runs chunks of job `gen` until none is left; returns how many it claimed. The
  // function is read from the job's slot after a claim: the claim's acquire saw the job's
  // publication, and the slot keeps this job's function until the job is done (the job after
  // the next rewrites it). The first exception a chunk throws goes to *error; the chunks left
  // are claimed and not run.
  int64_t run_claimed(uint64_t gen, std::exception_ptr* error) {
    int64_t mine = 0;
    for (int64_t c; (c = claim(gen)) >= 0; ++mine) {
      if (*error) continue;
      try {
        (*fn_[gen & 1].load(std::memory_order_relaxed))(c);
      } catch (...) {
        *error = std::current_exception();
      }
    }
    return mine;
  }

  // A helper's exception, kept for its job's caller (the first one).
  void keep_helper_error(std::exception_ptr error) {
    std::lock_guard<std::mutex> lock(error_mu_);
    if (!helper_error_) helper_error_ = std::move(error);
    helper_failed_.store(true, std::memory_order_release);
  }
  std::exception_ptr take_helper_error() {  // (the flag spares a job without one the lock)
    if (!helper_failed_.load(std::memory_order_acquire)) return nullptr;
    std::lock_guard<std::mutex> lock(error_mu_);
    helper_failed_.store(false, std::memory_order_relaxed);
    return std::exchange(helper_error_, nullptr);
  }

  void ensure_helpers(int64_t count) {
    while (static_cast<int64_t>(helpers_.size()) < count) {
      const int64_t index = static_cast<int64_t>(helpers_.size());
      helpers_.emplace_back([this, index] { helper_loop(index); });
      helpers_.back().detach();
    }
  }

  void helper_loop(int64_t index) {
    uint64_t seen = next_.load(std::memory_order_acquire) >> 32;
    for (;;) {
      uint64_t gen = wait_for_job(seen);
      seen = gen;
      if (index >= max_helpers_.load(std::memory_order_relaxed)) continue;
      std::exception_ptr error;
      const int64_t mine = run_claimed(gen, &error);
      if (error) keep_helper_error(error);
      if (mine) done_.fetch_add(mine, std::memory_order_acq_rel);
    }
  }

  // Spins up to kSpinMicros for a job newer than `seen`, then sleeps until one comes.
  uint64_t wait_for_job(uint64_t seen) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicros);
    for (int i = 0;; ++i) {
      const uint64_t gen = next_.load(std::memory_order_acquire) >> 32;
      if (gen != seen) return gen;
      if (prefetch_piece()) continue;
      pause();
      if ((i & 255) == 255 && std::chrono::steady_clock::now() > until) break;
    }
    std::unique_lock<std::mutex> lock(mu_);
    sleeping_.fetch_add(1, std::memory_order_seq_cst);
    cv_.wait(lock, [&] { return (next_.load(std::memory_order_seq_cst) >> 32) != seen; });
    sleeping_.fetch_sub(1, std::memory_order_relaxed);
    return next_.load(std::memory_order_acquire) >> 32;
  }

  std::atomic<uint64_t> next_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<const char*> pf_ptr_{nullptr};
  std::atomic<int64_t> pf_bytes_{0};
  std::atomic<int64_t> pf_next_{0};
  std::atomic<int> sleeping_{0};
  // The job's fields, written before its generation is published (release) and read after a
  // helper saw it (acquire); atomics so that a stale read racing the next job is defined. The
  // function and the chunk count in the slot of the generation's parity (see the top).
  static constexpr uint64_t kGenMask = 0xffffffffu;  // generations wrap within the high half
  std::atomic<const std::function<void(int64_t)>*> fn_[2] = {nullptr, nullptr};
  std::atomic<int64_t> num_chunks_[2] = {0, 0};
  std::atomic<int64_t> max_helpers_{0};
  std::mutex busy_;
  // Under busy_: jobs left to run alone, and the current window's counts.
  int64_t backoff_ = 0;
  std::atomic<int64_t> backoffs_{0};
  int64_t window_jobs_ = 0;
  int64_t window_chunks_ = 0;
  int64_t window_helper_chunks_ = 0;
  int64_t window_stalls_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  std::mutex error_mu_;
  std::exception_ptr helper_error_;  // under error_mu_
  std::atomic<bool> helper_failed_{false};
  std::vector<std::thread> helpers_;
};

// The process's pool, never destroyed (its helpers are detached and run until exit). Threads do
// not survive fork, and a lock held at the fork would stay held: a forked child gets a new pool
// (the parent's copy is leaked).
inline StreamPool& stream_pool() {
  static StreamPool* pool = nullptr;
  static pid_t owner = 0;
  if (pool == nullptr || owner != getpid()) {
    pool = new StreamPool();
    owner = getpid();
  }
  return *pool;
}

}  // namespace prefixserve
