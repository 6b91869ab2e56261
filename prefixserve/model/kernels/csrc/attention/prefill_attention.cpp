// Causal attention of one long bf16 chunk (a prompt, or a chunk over a cached prefix) whose K/V
// are contiguous rows, as the SDPA path of model/attention.py hands them over:
//
//   prefill_attention(out, q, k, v, scale, threads):
//     q [n, H, D], k and v [L, Hkv, D] (L >= n; the chunk is the last n of the L positions),
//     out [n, H * D]; query i attends to keys [0, L - n + i]. GQA: query head h reads KV head
//     h / (H / Hkv).
//
// Why native: PyTorch's flash SDPA on this CPU runs a 2,048-token prompt at ~120 GFLOP/s in fp32
// (its bf16 path is slower), so a long prompt spent more time in attention than in the linears.
// The arithmetic of a tile is attn_lanes_bf16_avx512.h's, shared with the paged kernel's bf16 path:
// VDPBF16PS scores with keys in lanes (exact products, fp32 sums), the online softmax in fp32
// per 64-key tile, P @ V in fp32 FMAs over V converted once per call. So a query's output is the
// paged kernel's, bit for bit, whatever chunk it came in. K is packed once per call in pairs of
// dimensions ("VNNI": a zmm load is 16 keys x 2 dims), so 4 query rows share every K load of a
// tile. Work items are (query head, 32 positions), taken longest first from the stream pool's
// counter (stream_pool.h: the caller and up to `threads - 1` helpers, which the step's linears
// use too, so no OpenMP thread competes with them for the cores), so the causal triangle's uneven
// rows spread over the threads.
//
// Each call packs K and converts V to fp32 for the whole length L (a chunk of 32 over a long
// prefix pays for the prefix: 3 x L x D x 6 bytes for SmolLM2), which the measured cases absorb.
//
// Built only where the compiler targets AVX512-BF16 (-march=native); `prefill_attention_ready`
// says whether this build has it (model/attention.py keeps SDPA otherwise).

#include "torch_lite.h"
#include <ATen/Parallel.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "attn_lanes_bf16_avx512.h"
#include "kernels.h"
#include "stream_pool.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

#if defined(__AVX512BF16__)
namespace lanes = prefixserve::lanes;

constexpr int64_t kRows = 4;       // query rows per micro-tile (share each K load)
constexpr int64_t kItemRows = 32;  // query positions per work item
using lanes::kTileKeys;

template <int D>
void run(uint16_t* out, const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t n,
         int64_t L, int64_t H, int64_t Hkv, int64_t q_row, int64_t q_head, int64_t k_row,
         int64_t k_head, int64_t v_row, int64_t v_head, float scale, int64_t threads) {
  constexpr int P = D / 2;  // dimension pairs
  const int64_t group = H / Hkv;
  const int64_t off = L - n;
  const int64_t Lp = (L + kTileKeys - 1) / kTileKeys * kTileKeys;
  // kp[h][pair][key] = (k[key, h, 2 pair], k[key, h, 2 pair + 1]); vf[h][key][d] in fp32.
  std::vector<uint32_t> kp(static_cast<size_t>(Hkv * P * Lp), 0u);
  std::vector<float> vf(static_cast<size_t>(Hkv * Lp * D), 0.0f);
  auto& pool = prefixserve::stream_pool();
  constexpr int64_t kPackRows = 256;  // (head, key) rows packed per job chunk
  pool.run((Hkv * L + kPackRows - 1) / kPackRows, threads, [&](int64_t chunk) {
    for (int64_t x = chunk * kPackRows; x < std::min(Hkv * L, (chunk + 1) * kPackRows); ++x) {
      const int64_t h = x / L, j = x % L;
      const uint16_t* kr = k + j * k_row + h * k_head;
      const uint16_t* vr = v + j * v_row + h * v_head;
      uint32_t* kd = kp.data() + h * P * Lp + j;
      for (int64_t p = 0; p < P; ++p) {
        kd[p * Lp] = static_cast<uint32_t>(kr[2 * p]) | (static_cast<uint32_t>(kr[2 * p + 1]) << 16);
      }
      float* vd = vf.data() + (h * Lp + j) * D;
      for (int64_t d = 0; d < D; ++d) {
        const uint32_t bits = static_cast<uint32_t>(vr[d]) << 16;
        std::memcpy(vd + d, &bits, sizeof(float));
      }
    }
  }, true);

  // Items claimed in order from the pool's counter: longest first (the last position blocks see
  // the most keys).
  const int64_t blocks = (n + kItemRows - 1) / kItemRows;
  const int64_t num_items = blocks * H;
  pool.run(num_items, threads, [&](int64_t item) {
    alignas(64) float acc[kRows][D];
    alignas(64) float pbuf[kRows * kTileKeys];
    const int64_t block = blocks - 1 - item / H;
    const int64_t head = item % H;
    const int64_t kvh = head / group;
    const uint32_t* kh = kp.data() + kvh * P * Lp;
    const float* vh = vf.data() + kvh * Lp * D;
    const int64_t i_end = std::min(n, (block + 1) * kItemRows);
    for (int64_t i0 = block * kItemRows; i0 < i_end; i0 += kRows) {
      const int64_t nr = std::min<int64_t>(kRows, i_end - i0);
      const uint16_t* qr[kRows];
      float m[kRows], l[kRows];
      for (int64_t r = 0; r < nr; ++r) {
        qr[r] = q + (i0 + r) * q_row + head * q_head;
        m[r] = -std::numeric_limits<float>::infinity();
        l[r] = 0.0f;
        std::memset(acc[r], 0, sizeof(acc[r]));
      }
      // Row r sees keys [0, off + i0 + r]: the tiles up to the last row's.
      const int64_t keys = off + i0 + nr;
      for (int64_t t0 = 0; t0 < keys; t0 += kTileKeys) {
        const uint16_t* tq[kRows];
        int64_t lo[kRows], hi[kRows];
        float *tm[kRows], *tl[kRows], *ta[kRows];
        int64_t nt = 0;
        for (int64_t r = 0; r < nr; ++r) {
          const int64_t h = std::min<int64_t>(kTileKeys, off + i0 + r + 1 - t0);
          if (h <= 0) continue;
          tq[nt] = qr[r], lo[nt] = 0, hi[nt] = h;
          tm[nt] = m + r, tl[nt] = l + r, ta[nt] = acc[r];
          ++nt;
        }
        lanes::attend_tile<D>(nt, tq, lo, hi, kh + t0, Lp, vh + t0 * D, scale, tm, tl, ta,
                              pbuf);
      }
      for (int64_t r = 0; r < nr; ++r) {
        lanes::finish<D>(acc[r], l[r], out + (i0 + r) * H * D + head * D);
      }
    }
  }, true);
}

#endif  // __AVX512BF16__

}  // namespace

bool prefill_attention_ready() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

void prefill_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k, torch::Tensor v,
                       double scale, int64_t threads) {
#if defined(__AVX512BF16__)
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 && k.scalar_type() == torch::kBFloat16 &&
                  v.scalar_type() == torch::kBFloat16 && out.scalar_type() == torch::kBFloat16,
              "prefill_attention runs on bfloat16 tensors");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.dim() == 2,
              "prefill_attention needs q [n, H, D], k and v [L, Hkv, D], out [n, H * D]");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t L = k.size(0), Hkv = k.size(1);
  TORCH_CHECK(L >= n && n > 0 && Hkv > 0 && H % Hkv == 0 && k.size(2) == D &&
                  v.sizes() == k.sizes(),
              "prefill_attention: shapes do not match (L >= n, H a multiple of Hkv, k and v alike)");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && out.is_contiguous() &&
                  out.size(0) == n && out.size(1) == H * D,
              "prefill_attention needs unit-stride head dims and a contiguous out");
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  const float s = static_cast<float>(scale);
  threads = threads > 0 ? threads : static_cast<int64_t>(at::get_num_threads());
  switch (D) {
    case 64:
      return run<64>(o, qp, kp, vp, n, L, H, Hkv, q.stride(0), q.stride(1), k.stride(0),
                     k.stride(1), v.stride(0), v.stride(1), s, threads);
    case 128:
      return run<128>(o, qp, kp, vp, n, L, H, Hkv, q.stride(0), q.stride(1), k.stride(0),
                      k.stride(1), v.stride(0), v.stride(1), s, threads);
    case 256:
      return run<256>(o, qp, kp, vp, n, L, H, Hkv, q.stride(0), q.stride(1), k.stride(0),
                      k.stride(1), v.stride(0), v.stride(1), s, threads);
    default:
      TORCH_CHECK(false, "prefill_attention supports head dims 64, 128 and 256, got ", D);
  }
#else
  (void)out, (void)q, (void)k, (void)v, (void)scale, (void)threads;
  TORCH_CHECK(false, "prefill_attention needs a build with AVX512-BF16");
#endif
}
