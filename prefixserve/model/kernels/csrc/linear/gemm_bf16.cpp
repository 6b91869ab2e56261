// One bf16 linear for every row count, with one summation order: out[m, n] =
// bf16(sum_k x[m, k] * w[n, k] + bias[n]) (or, into an fp32 out, the same fp32 value unrounded:
// the LM head's logits), each output accumulated in one fp32 lane in the
// order gemm_bf16_tiles.h defines (pairs of k ascending, k + 1 before k), whatever the number of
// rows, the register tile, the thread or the family of tiles that computes it. So a row's result
// is the same alone, in a decode batch, in a speculative verification or in a prefill chunk, on
// the AVX-512 FMA tiles, the bf16 dot-product tiles or the AVX2 tiles: the engine takes this
// kernel at every row count (tests/model/test_batch_invariance.py, test_native_gemm.py).
//
// Which family runs (`gemm_bf16_select`): one for decode-sized calls (up to kComputeBoundRows
// rows, which stream the weight) and one for larger ones (arithmetic-bound), chosen by a
// measurement on the host (model/kernels/calibration.py): on Intel Xeons without AMX a
// VDPBF16PS retires at about a quarter of an fp32 FMA's rate (60-66 against 118-136 GFLOP/s a
// core), on AMD Zen 4/5 at the FMA's rate with twice its products. The weight stays bf16 in
// memory (half the bytes of an fp32 copy, which decode streams).
//
// Layout (`pack_bf16_gemm`): the weight [N, K] is cut into panels of 32 output columns; a panel
// holds, for each pair of k, the 32 columns' two bf16 side by side: [N/32][K/2][32][2], zero
// padded to whole panels and an even K. One 64-byte load is 16 columns at k and k + 1: the dot
// product's operand as it is, or the FMA tiles' 16 floats of k (a shift) and of k + 1 (a mask).
//
// Gated MLPs (`linear_bf16_packed_gated`): gate_up's weight [2I, K] packed as is; a tile takes
// the gate panel j and the up panel j + I/32 together (two panels I/32 panels apart instead of
// side by side), so each output's sums are the plain GEMM's, and its epilogue writes
// bf16(act(bf16(gate)) * bf16(up)) -- the roundings of the unfused bf16 ops -- for 32 columns of
// [rows, I]: the [rows, 2I] intermediate and two elementwise passes over it are never made.
//
// Register tiles: MR rows x NP panels, MR * NP * 2 accumulators (at most 24). A decode-sized
// batch takes several panels at once (enough independent chains to stream the weight at memory
// speed); a prefill-sized one takes 12 rows on one panel (the AVX-512 FMA tiles), 2 on one (AVX2's)
// or 6 on two (the dot products'). Neither changes any output's order of summation.
#include "torch_lite.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "gemm_bf16_tiles.h"
#include "kernels.h"
#include "stream_pool.h"

namespace {

using namespace prefixserve::gemm;

// Bytes of weight a job of the stream pool covers at least (whole panels): large enough that
// the pool's per-job cost is small, small enough that two threads share a linear evenly.
constexpr int64_t kJobBytes = 48 * 1024;
// Batches of more rows than this are arithmetic-bound (decode-sized ones stream the weight): the
// stream pool keeps its helpers for them however often they stall (stream_pool.h).
constexpr int64_t kComputeBoundRows = 24;
// Panels every row tile of a decode-sized job runs before the next few (schedule): a multiple
// of every family's panels a tile (1, 2 or 4).
constexpr int64_t kPanelRun = 4;
// Arithmetic a job of a large batch covers at most (~50-100 us on one core).
constexpr int64_t kJobFlops = 6 * 1000 * 1000;

struct Problem {
  const float* x;        // [rows, ldx] fp32, zero past K (the FMA families)
  const uint16_t* xb;    // [rows, ldx] bf16 bits, zero past K (the dot-product family)
  int64_t ldx;
  const uint16_t* w;     // packed
  int64_t pairs;         // K / 2, rounded up
  int64_t rows, N;       // N: out's columns (a gated call's I)
  const float* bias;     // [N] or null (gated: [2I])
  uint16_t* out;         // [rows, N] bf16 bits (null where out_f32 is set)
  int64_t act = kNone;   // gated: the activation
  const uint16_t* res = nullptr;  // [rows, N] bf16 bits added to the output, or null
  float* out_f32 = nullptr;       // [rows, N] fp32: the unrounded outputs (a plain call only)
};

// The rows of x family T reads: fp32, or bf16 pairs.
template <class T>
const typename T::X* rows_of(const Problem& pb) {
  if constexpr (std::is_same_v<typename T::X, float>) {
    return pb.x;
  } else {
    return pb.xb;
  }
}

template <class T, int MR, int NP>
void run_tile(const Problem& pb, int64_t m0, int64_t panel0) {
  const int64_t stride = pb.pairs * 2 * kPanel, n0 = panel0 * kPanel;
  const TileOut out{pb.out ? pb.out + m0 * pb.N + n0 : nullptr,
                    pb.N,
                    std::min(pb.N - n0, NP * kPanel),
                    pb.bias ? pb.bias + n0 : nullptr,
                    kNone,
                    nullptr,
                    pb.res ? pb.res + m0 * pb.N + n0 : nullptr,
                    pb.out_f32 ? pb.out_f32 + m0 * pb.N + n0 : nullptr};
  T::template tile<MR, NP>(rows_of<T>(pb) + m0 * pb.ldx, pb.ldx, pb.w + panel0 * stride,
                           stride, pb.pairs, out);
}

template <class T, int MR, int NP>
void run_rows_of(const Problem& pb, int64_t m0, int64_t panel0, int64_t panel1) {
  int64_t j = panel0;
  for (; j + NP <= panel1; j += NP) run_tile<T, MR, NP>(pb, m0, j);
  for (; j < panel1; ++j) run_tile<T, MR, 1>(pb, m0, j);
}

// Whether a lone row takes 2 panels a tile on family T (g_one_row_panels).
template <class T>
bool one_row_narrow() {
  return T::kOneRowChoice && g_one_row_panels.load(std::memory_order_relaxed) == 2;
}

template <class T, int MR>
void run_rows(const Problem& pb, int64_t m0, int64_t panel0, int64_t panel1) {
  if constexpr (MR == 1 && T::kOneRowChoice) {
    if (one_row_narrow<T>()) return run_rows_of<T, 1, 2>(pb, m0, panel0, panel1);
  }
  run_rows_of<T, MR, T::panels_for(MR)>(pb, m0, panel0, panel1);
}

// Rows [m0, m0 + mr) (mr <= T::kMaxRows) over panels [panel0, panel1), on T's tile of mr rows.
template <class T, int MR = 1>
void run_block(const Problem& pb, int64_t m0, int64_t mr, int64_t panel0, int64_t panel1) {
  if constexpr (MR < T::kMaxRows) {
    if (mr > MR) {
      run_block<T, MR + 1>(pb, m0, mr, panel0, panel1);
      return;
    }
  }
  run_rows<T, MR>(pb, m0, panel0, panel1);
}

template <class T, int MR>
void run_gated(const Problem& pb, int64_t m0, int64_t panel0, int64_t panel1) {
  const int64_t size = pb.pairs * 2 * kPanel, half = pb.N / kPanel;
  for (int64_t j = panel0; j < panel1; ++j) {
    const int64_t n0 = j * kPanel;
    const TileOut out{pb.out + m0 * pb.N + n0, pb.N, 2 * kPanel,
                      pb.bias ? pb.bias + n0 : nullptr, pb.act,
                      pb.bias ? pb.bias + pb.N + n0 : nullptr};
    T::template tile<MR, 2>(rows_of<T>(pb) + m0 * pb.ldx, pb.ldx, pb.w + j * size, half * size,
                            pb.pairs, out);
  }
}

// A gated call's rows [m0, m0 + mr) (mr <= T::kMaxGatedRows) on T's gated tile of mr rows.
template <class T, int MR = 1>
void run_gated_block(const Problem& pb, int64_t m0, int64_t mr, int64_t panel0, int64_t panel1) {
  if constexpr (MR < T::kMaxGatedRows) {
    if (mr > MR) {
      run_gated_block<T, MR + 1>(pb, m0, mr, panel0, panel1);
      return;
    }
  }
  run_gated<T, MR>(pb, m0, panel0, panel1);
}

// Runs block(m0, rows, panel0, panel1) over every tile of `rows` x `panels` on the stream pool.
// Small batches: jobs of ~kJobBytes of weight (`np` panels a tile, `weight_panels` panels of
// weight read per panel index), row ranges outermost; large ones: one tile's panels a job, and a
// range of rows so that a job stays well under the pool's stall limit (a helper still on a long
// job reads as a helper without a core), panels outermost: a core keeps the panels in its L2
// while the row ranges pass them, x's rows coming from L3. (Rows outermost, each row range swept
// every panel: a gated call's 64 MB weight came from memory once for every 6 rows, and its tile
// ran at 300-320 GFLOP/s on two Zen 4 cores against 420 panels outermost; BENCHMARKS.md §47.)
template <typename Block>
void schedule(int64_t rows, int64_t panels, int64_t pairs, int64_t tile_rows, int64_t np,
              int64_t weight_panels, int64_t threads, const Block& block) {
  const int64_t panel_bytes = weight_panels * pairs * 2 * kPanel * 2;
  // Decode-sized calls stream the weight once, in jobs of ~kJobBytes, with every row in the job
  // (a family with short tiles, AVX2's, runs its row tiles over each few panels in turn, so a
  // panel is read from memory once and from cache by the other row tiles).
  const bool few_rows = rows <= std::max(tile_rows, kComputeBoundRows);
  int64_t per_job = np;
  if (few_rows) {  // whole tiles of np panels
    per_job = std::max<int64_t>(np, kJobBytes / std::max<int64_t>(1, panel_bytes));
    per_job = (per_job + np - 1) / np * np;
  }
  per_job = std::min(per_job, std::max<int64_t>(1, (panels + threads - 1) / threads));
  const int64_t panel_jobs = (panels + per_job - 1) / per_job;
  const int64_t tile_flops = 2 * tile_rows * per_job * weight_panels * kPanel * 2 * pairs;
  const int64_t row_span =
      few_rows ? rows : tile_rows * std::max<int64_t>(1, kJobFlops / tile_flops);
  const int64_t row_jobs = (rows + row_span - 1) / row_span;
  prefixserve::stream_pool().run(
      row_jobs * panel_jobs, threads,
      [&](int64_t job) {
        const FlushDenormals flush;  // every family's rule (gemm_bf16_tiles.h)
        const int64_t pj = few_rows ? job % panel_jobs : job / row_jobs;
        const int64_t rj = few_rows ? job / panel_jobs : job % row_jobs;
        const int64_t p0 = pj * per_job, p1 = std::min(panels, p0 + per_job);
        const int64_t r0 = rj * row_span, r1 = std::min(rows, r0 + row_span);
        // Several row tiles: kPanelRun panels at a time (a multiple of every tile's panels).
        const int64_t run = r1 - r0 > tile_rows ? kPanelRun : p1 - p0;
        for (int64_t q0 = p0; q0 < p1; q0 += run)
          for (int64_t m0 = r0; m0 < r1; m0 += tile_rows)
            block(m0, std::min(tile_rows, r1 - m0), q0, std::min(p1, q0 + run));
      },
      /*compute_bound=*/rows > kComputeBoundRows);
}

// The x rows widened to fp32 with K padded to an even length (the pad is 0).
const float* widen_rows(const uint16_t* x, int64_t rows, int64_t K, int64_t ldx) {
  thread_local std::vector<float> scratch;
  if (static_cast<int64_t>(scratch.size()) < rows * ldx) scratch.resize(rows * ldx);
  for (int64_t m = 0; m < rows; ++m) {
    float* dst = scratch.data() + m * ldx;
    for (int64_t k = 0; k < K; ++k) dst[k] = bf16_bits_to_float(x[m * K + k]);
    for (int64_t k = K; k < ldx; ++k) dst[k] = 0.0f;
  }
  return scratch.data();
}

// The x rows as bf16 with K padded to an even length: x itself where K is even, else a copy.
const uint16_t* pad_rows(const uint16_t* x, int64_t rows, int64_t K, int64_t ldx) {
  if (K == ldx) return x;
  thread_local std::vector<uint16_t> scratch;
  if (static_cast<int64_t>(scratch.size()) < rows * ldx) scratch.resize(rows * ldx);
  for (int64_t m = 0; m < rows; ++m) {
    std::memcpy(scratch.data() + m * ldx, x + m * K, K * sizeof(uint16_t));
    scratch[m * ldx + K] = 0;
  }
  return scratch.data();
}

void check_packed(const torch::Tensor& packed, int64_t N, int64_t K) {
  const int64_t panels = (N + kPanel - 1) / kPanel, pairs = (K + 1) / 2;
  TORCH_CHECK(packed.scalar_type() == torch::kBFloat16 && packed.is_contiguous() &&
                  packed.dim() == 1 && packed.numel() == panels * pairs * 2 * kPanel,
              "linear_bf16_packed: the weight must come from pack_bf16_gemm for [", N, ", ", K,
              "]");
}

// The tile families (gemm_bf16_tiles.h), by the names Python knows them.
enum class Family : int { kAvx512 = 0, kDot = 1, kAvx2 = 2, kPortable = 3 };
constexpr const char* kFamilyNames[] = {"avx512", "avx512_bf16", "avx2", "portable"};

bool family_runs_here(Family f) {
  switch (f) {
    case Family::kAvx512:
#if defined(PREFIXSERVE_GEMM_AVX512)
      return true;
#else
      return false;
#endif
    case Family::kDot:
#if defined(PREFIXSERVE_GEMM_DOT)
      return __builtin_cpu_supports("avx512bf16");
#else
      return false;
#endif
    case Family::kAvx2:
#if defined(PREFIXSERVE_GEMM_AVX2)
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
      return false;
#endif
    case Family::kPortable:
#if defined(PREFIXSERVE_GEMM_AVX512)
      return false;  // the build's FMA tiles are the AVX-512 ones
#else
      return true;
#endif
  }
  return false;
}

// The fastest FMA family here: the build's AVX-512 tiles, else AVX2's, else the portable loop.
Family default_family() {
  if (family_runs_here(Family::kAvx512)) return Family::kAvx512;
  return family_runs_here(Family::kAvx2) ? Family::kAvx2 : Family::kPortable;
}

Family family_named(const std::string& name) {
  for (int f = 0; f < 4; ++f)
    if (name == kFamilyNames[f]) {
      TORCH_CHECK(family_runs_here(static_cast<Family>(f)), "the GEMM's ", name,
                  " tiles do not run on this CPU or build");
      return static_cast<Family>(f);
    }
  TORCH_CHECK(false, "unknown GEMM tile family '", name,
              "' (avx512, avx512_bf16, avx2 or portable)");
  return Family::kPortable;
}

// The families calls take (gemm_bf16_select): [0] decode-sized calls, [1] larger ones. Any
// choice gives the same bits; -1 is default_family().
std::atomic<int> g_selected[2] = {-1, -1};

Family selected_family(int64_t rows) {
  const int f = g_selected[rows > kComputeBoundRows ? 1 : 0].load(std::memory_order_relaxed);
  return f < 0 ? default_family() : static_cast<Family>(f);
}

}  // namespace

// Whether this build has the AVX-512 tiles (elsewhere the AVX2 tiles or the portable loop
// compute the same sums, more slowly).
bool gemm_bf16_vectorized() { return family_runs_here(Family::kAvx512); }

// The weight [N, K] (bf16) in the panel layout above, as a flat bf16 tensor.
torch::Tensor pack_bf16_gemm(torch::Tensor w) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kBFloat16 && w.dim() == 2,
              "pack_bf16_gemm needs a 2-D bfloat16 CPU weight");
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t panels = (N + kPanel - 1) / kPanel, pairs = (K + 1) / 2;
  // Zero-pad to whole panels and an even K, then [panel][col][pair][2] -> [panel][pair][col][2]
  // (torch's strided copy: a few hundred ms for Gemma 3's 262,144 x 640 head).
  const auto padded = at::constant_pad_nd(w, {0, 2 * pairs - K, 0, panels * kPanel - N});
  return padded.view({panels, kPanel, pairs, 2}).permute({0, 2, 1, 3}).contiguous().view({-1});
}

namespace {

// The checks and set-up both entry points share: x [rows, K] and bias [N] (N the weight's
// rows) against the packed weight; out [rows, out_cols], bf16 or (the unrounded sums) fp32.
// Returns the Problem (x as `family` reads it, bias in fp32 in `bias_fp32`).
Problem prepare(const char* name, torch::Tensor& out, torch::Tensor& x,
                const torch::Tensor& packed, int64_t N, int64_t out_cols,
                const c10::optional<torch::Tensor>& bias, std::vector<float>& bias_fp32,
                Family family) {
  TORCH_CHECK(x.device().is_cpu() && out.device().is_cpu(), name, " runs on CPU tensors only");
  const bool out_f32 = out.scalar_type() == torch::kFloat;
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 &&
                  (out.scalar_type() == torch::kBFloat16 || out_f32),
              name, " needs bfloat16 x and a bfloat16 (or float32) out");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.is_contiguous() && out.is_contiguous(), name,
              " needs contiguous 2-D x and out");
  const int64_t rows = x.size(0), K = x.size(1);
  TORCH_CHECK(out.size(0) == rows && out.size(1) == out_cols, name, ": out must be [rows, ",
              out_cols, "]");
  check_packed(packed, N, K);
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kBFloat16 && bias->is_contiguous() &&
                    bias->dim() == 1 && bias->size(0) == N,
                name, ": bias must be a contiguous bfloat16 [", N, "]");
    const auto* b = reinterpret_cast<const uint16_t*>(bias->data_ptr<c10::BFloat16>());
    bias_fp32.resize(N);
    for (int64_t n = 0; n < N; ++n) bias_fp32[n] = bf16_bits_to_float(b[n]);
  }
  const int64_t pairs = (K + 1) / 2, ldx = 2 * pairs;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const bool dot = family == Family::kDot;
  return Problem{rows > 0 && !dot ? widen_rows(xp, rows, K, ldx) : nullptr,
                 rows > 0 && dot ? pad_rows(xp, rows, K, ldx) : nullptr,
                 ldx,
                 reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>()),
                 pairs,
                 rows,
                 out_cols,
                 bias_fp32.empty() ? nullptr : bias_fp32.data(),
                 out_f32 ? nullptr : reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()),
                 kNone,
                 nullptr,
                 out_f32 ? out.data_ptr<float>() : nullptr};
}

// A decode-sized call's epilogue: the stream pool's helpers prefetch the next linear's packed
// weight (`prefetch`) while the caller is back in Python between the two calls, when the memory
// bus would idle (decode at batch 1: 1.04-1.14x in five same-process A/B runs; batch 8 level).
// Larger batches reuse each weight enough that it makes no difference.
void prefetch_next(int64_t rows, const c10::optional<torch::Tensor>& prefetch) {
  if (rows <= kMaxTileRows && prefetch.has_value() && prefetch->defined()) {
    prefixserve::stream_pool().prefetch(prefetch->data_ptr(),
                                        prefetch->numel() * prefetch->element_size());
  }
}

// prepare() for a plain linear, with its optional residual [rows, N] checked.
Problem prepare_linear(const char* name, torch::Tensor& out, torch::Tensor& x,
                       const torch::Tensor& packed, int64_t N,
                       const c10::optional<torch::Tensor>& bias,
                       const c10::optional<torch::Tensor>& residual,
                       std::vector<float>& bias_fp32, Family family) {
  Problem pb = prepare(name, out, x, packed, N, N, bias, bias_fp32, family);
  if (residual.has_value() && residual->defined()) {
    TORCH_CHECK(!pb.out_f32, name, ": a residual goes with a bfloat16 out");
    TORCH_CHECK(residual->device().is_cpu() && residual->scalar_type() == torch::kBFloat16 &&
                    residual->is_contiguous() && residual->dim() == 2 &&
                    residual->size(0) == pb.rows && residual->size(1) == N,
                name, ": residual must be a contiguous bfloat16 [", pb.rows, ", ", N, "]");
    pb.res = reinterpret_cast<const uint16_t*>(residual->data_ptr<c10::BFloat16>());
  }
  return pb;
}

template <class T>
void run_linear_on(const Problem& pb, int64_t threads) {
  const int64_t panels = (pb.N + kPanel - 1) / kPanel;
  const int mr = static_cast<int>(std::min(pb.rows, T::kMaxRows));
  const int np = mr == 1 && one_row_narrow<T>() ? 2 : T::panels_for(mr);
  schedule(pb.rows, panels, pb.pairs, T::kMaxRows, np, 1, threads,
           [&](int64_t m0, int64_t mr, int64_t p0, int64_t p1) {
             run_block<T>(pb, m0, mr, p0, p1);
           });
}

void run_linear(const Problem& pb, int64_t threads, Family family) {
  if (pb.rows == 0 || pb.N == 0) return;
#if defined(PREFIXSERVE_GEMM_DOT)
  if (family == Family::kDot) return run_linear_on<dot::Tiles>(pb, threads);
#endif
#if defined(PREFIXSERVE_GEMM_AVX2)
  if (family == Family::kAvx2) return run_linear_on<avx2::Tiles>(pb, threads);
#endif
  run_linear_on<BuildTiles>(pb, threads);
}

template <class T>
void run_gated_on(const Problem& pb, int64_t threads) {
  schedule(pb.rows, pb.N / kPanel, pb.pairs, T::kMaxGatedRows, 1, 2, threads,
           [&](int64_t m0, int64_t mr, int64_t p0, int64_t p1) {
             run_gated_block<T>(pb, m0, mr, p0, p1);
           });
}

void run_gated_family(const Problem& pb, int64_t threads, Family family) {
#if defined(PREFIXSERVE_GEMM_DOT)
  if (family == Family::kDot) return run_gated_on<dot::Tiles>(pb, threads);
#endif
#if defined(PREFIXSERVE_GEMM_AVX2)
  if (family == Family::kAvx2) return run_gated_on<avx2::Tiles>(pb, threads);
#endif
  run_gated_on<BuildTiles>(pb, threads);
}


}  // namespace

// out [rows, N] = x [rows, K] @ w.T (+ bias) (+ residual, after the output's rounding), w
// packed by pack_bf16_gemm; an fp32 `out` takes the fp32 sums + bias unrounded (no residual); on the caller and up to `threads - 1` helpers of the stream pool,
// on the family selected for this many rows; then, for a decode-sized call, `prefetch` (the
// next linear's packed weight) toward the helpers' caches. `residual` may be `out` itself (each
// element is read before it is written).
void linear_bf16_packed(torch::Tensor out, torch::Tensor x, torch::Tensor packed, int64_t N,
                        c10::optional<torch::Tensor> bias, int64_t threads,
                        c10::optional<torch::Tensor> prefetch,
                        c10::optional<torch::Tensor> residual) {
  std::vector<float> bias_fp32;
  const Family family = selected_family(x.dim() == 2 ? x.size(0) : 0);
  const Problem pb = prepare_linear("linear_bf16_packed", out, x, packed, N, bias, residual,
                                    bias_fp32, family);
  run_linear(pb, threads, family);
  prefetch_next(pb.rows, prefetch);
}

// linear_bf16_packed on the named family whatever the selection (tests compare the families
// bit for bit; the calibration times them).
void linear_bf16_packed_on(torch::Tensor out, torch::Tensor x, torch::Tensor packed, int64_t N,
                           c10::optional<torch::Tensor> bias, int64_t threads,
                           const std::string& tiles, c10::optional<torch::Tensor> residual) {
  const Family family = family_named(tiles);
  std::vector<float> bias_fp32;
  const Problem pb = prepare_linear("linear_bf16_packed_on", out, x, packed, N, bias, residual,
                                    bias_fp32, family);
  run_linear(pb, threads, family);
}

// A gated MLP's first half: out [rows, I] = act(x @ gate.T) * (x @ up.T), the weight [2I, K]
// (gate rows then up rows, as GatedMLP fuses them) packed by pack_bf16_gemm, I a multiple of 32;
// `act` 1 for SiLU, 2 for GELU's tanh approximation. Each gate and up sum is the plain call's,
// and every family's epilogue writes the same bits; on the family selected for this many rows.
void linear_bf16_packed_gated(torch::Tensor out, torch::Tensor x, torch::Tensor packed,
                              int64_t N, c10::optional<torch::Tensor> bias, int64_t act,
                              int64_t threads, c10::optional<torch::Tensor> prefetch) {
  TORCH_CHECK(act == kSilu || act == kGeluTanh, "linear_bf16_packed_gated: act 1 or 2");
  TORCH_CHECK(N % (2 * kPanel) == 0, "linear_bf16_packed_gated: 2I must be a multiple of ",
              2 * kPanel);
  const Family family = selected_family(x.dim() == 2 ? x.size(0) : 0);
  std::vector<float> bias_fp32;
  Problem pb =
      prepare("linear_bf16_packed_gated", out, x, packed, N, N / 2, bias, bias_fp32, family);
  TORCH_CHECK(!pb.out_f32, "linear_bf16_packed_gated needs a bfloat16 out");
  pb.act = act;
  if (pb.rows == 0 || N == 0) return;
  run_gated_family(pb, threads, family);
  prefetch_next(pb.rows, prefetch);
}

// The build's FMA family: "avx512", "avx2" or "portable" (what runs with no selection).
std::string gemm_bf16_tiles() { return kFamilyNames[static_cast<int>(default_family())]; }

// Every family that runs here, the build's FMA family first.
std::vector<std::string> gemm_bf16_families() {
  std::vector<std::string> names{gemm_bf16_tiles()};
  for (int f = 0; f < 4; ++f)
    if (family_runs_here(static_cast<Family>(f)) && names[0] != kFamilyNames[f])
      names.push_back(kFamilyNames[f]);
  return names;
}

// The families decode-sized calls (up to kComputeBoundRows rows) and larger ones take from now
// on ("" keeps a class's choice), whether decode-sized tiles prefetch in software and the panels
// a lone row's tile takes (2 or 4; -1 keeps either); every family and setting gives the same
// bits, so this changes only speed.
void gemm_bf16_select(const std::string& decode, const std::string& prefill, int64_t prefetch,
                      int64_t one_row_panels) {
  TORCH_CHECK(one_row_panels == -1 || one_row_panels == 2 || one_row_panels == 4,
              "gemm_bf16_select: one_row_panels is 2 or 4 (or -1 to keep it)");
  const int d = decode.empty() ? -2 : static_cast<int>(family_named(decode));
  const int p = prefill.empty() ? -2 : static_cast<int>(family_named(prefill));
  if (d != -2) g_selected[0].store(d);
  if (p != -2) g_selected[1].store(p);
  if (prefetch >= 0) g_tile_prefetch.store(prefetch != 0);
  if (one_row_panels > 0) g_one_row_panels.store(static_cast<int>(one_row_panels));
}

// (decode family, prefill family, the largest decode-sized row count, prefetch, the panels of a
// lone row's tile) as selected now.
std::tuple<std::string, std::string, int64_t, bool, int64_t> gemm_bf16_selected() {
  return {kFamilyNames[static_cast<int>(selected_family(1))],
          kFamilyNames[static_cast<int>(selected_family(kComputeBoundRows + 1))],
          kComputeBoundRows, g_tile_prefetch.load(), g_one_row_panels.load()};
}
