// Causal attention of one long bf16 chunk (a prompt, or a chunk over a cached prefix) whose K/V
// are contiguous rows, as the SDPA path of model/attention.py hands them over:
//
//   prefill_attention(out, q, k, v, scale):
//     q [n, H, D], k and v [L, Hkv, D] (L >= n; the chunk is the last n of the L positions),
//     out [n, H * D]; query i attends to keys [0, L - n + i]. GQA: query head h reads KV head
//     h / (H / Hkv).
//
// Why native: PyTorch's flash SDPA on this CPU runs a 2,048-token prompt at ~120 GFLOP/s in fp32
// (its bf16 path is slower), so a long prompt spent more time in attention than in the linears.
// Here the scores are VDPBF16PS dot products of the bf16 q and k (exact products, fp32 sums:
// what converting both to fp32 gives, without the conversion), the softmax is online in fp32
// (running max and sum per query row, as the paged kernel), and P @ V is in fp32 FMAs over V
// converted once per call. K is packed once per call in pairs of dimensions ("VNNI": a zmm load
// is 16 keys x 2 dims), so 4 query rows share every K load of a 64-key tile, and the tile of
// scores stays in registers. Work items are (query head, 32 positions), taken longest first
// from a shared counter, so the causal triangle's uneven rows spread over the threads.
//
// Each call packs K and converts V to fp32 for the whole length L (a chunk of 32 over a long
// prefix pays for the prefix: 3 x L x D x 6 bytes for SmolLM2), which the measured cases absorb.
//
// Built only where the compiler targets AVX512-BF16 (-march=native); `prefill_attention_ready`
// says whether this build has it (model/attention.py keeps SDPA otherwise).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "exp_avx512.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

#if defined(__AVX512BF16__)

constexpr int64_t kRows = 4;       // query rows per micro-tile (share each K load)
constexpr int64_t kKeys = 64;      // keys per tile (4 zmm of scores per row)
constexpr int64_t kItemRows = 32;  // query positions per work item

using prefixserve::exp_nonpositive16;

inline float exp1(float x) {
  return _mm512_cvtss_f32(exp_nonpositive16(_mm512_set1_ps(x)));
}

// Lanes j of a 16-key vector starting at key `first` that row limit `lim` (inclusive) can see.
inline __mmask16 visible(int64_t first, int64_t lim) {
  const int64_t n = lim - first + 1;
  if (n >= 16) return static_cast<__mmask16>(0xFFFF);
  if (n <= 0) return 0;
  return static_cast<__mmask16>((1u << n) - 1u);
}

template <int D>
void run(uint16_t* out, const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t n,
         int64_t L, int64_t H, int64_t Hkv, int64_t q_row, int64_t q_head, int64_t k_row,
         int64_t k_head, int64_t v_row, int64_t v_head, float scale) {
  constexpr int C = D / 16;  // zmm per head vector
  constexpr int P = D / 2;   // dimension pairs
  const int64_t group = H / Hkv;
  const int64_t off = L - n;
  const int64_t Lp = (L + kKeys - 1) / kKeys * kKeys;
  // kp[h][pair][key] = (k[key, h, 2 pair], k[key, h, 2 pair + 1]); vf[h][key][d] in fp32.
  std::vector<uint32_t> kp(static_cast<size_t>(Hkv * P * Lp), 0u);
  std::vector<float> vf(static_cast<size_t>(Hkv * Lp * D), 0.0f);
  at::parallel_for(0, Hkv * L, 256, [&](int64_t begin, int64_t end) {
    for (int64_t x = begin; x < end; ++x) {
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
  });

  const int64_t blocks = (n + kItemRows - 1) / kItemRows;
  const int64_t num_items = blocks * H;
  std::atomic<int64_t> next{0};
  const int threads = at::get_num_threads();
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    alignas(64) float acc[kRows][D];
    alignas(64) float pbuf[kRows][kKeys];
    for (;;) {
      const int64_t item = next.fetch_add(1);
      if (item >= num_items) break;
      // Longest first: the last position blocks see the most keys.
      const int64_t block = blocks - 1 - item / H;
      const int64_t head = item % H;
      const int64_t kvh = head / group;
      const uint32_t* kh = kp.data() + kvh * P * Lp;
      const float* vh = vf.data() + kvh * Lp * D;
      const int64_t i_end = std::min(n, (block + 1) * kItemRows);
      for (int64_t i0 = block * kItemRows; i0 < i_end; i0 += kRows) {
        const int64_t nr = std::min<int64_t>(kRows, i_end - i0);
        const uint16_t* qr[kRows];
        int64_t lim[kRows];
        float m[kRows], l[kRows];
        for (int64_t r = 0; r < kRows; ++r) {
          const int64_t i = i0 + std::min(r, nr - 1);  // short tiles repeat their last row
          qr[r] = q + i * q_row + head * q_head;
          lim[r] = off + i;
          m[r] = -std::numeric_limits<float>::infinity();
          l[r] = 0.0f;
          std::memset(acc[r], 0, sizeof(acc[r]));
        }
        const int64_t keys = lim[kRows - 1] + 1;
        for (int64_t t0 = 0; t0 < keys; t0 += kKeys) {
          __m512 s[kRows][4];
          for (int r = 0; r < kRows; ++r)
            for (int c = 0; c < 4; ++c) s[r][c] = _mm512_setzero_ps();
          for (int p = 0; p < P; ++p) {
            const uint32_t* kt = kh + p * Lp + t0;
            __m512bh kv4[4];
            for (int c = 0; c < 4; ++c) kv4[c] = (__m512bh)_mm512_loadu_si512(kt + 16 * c);
            for (int r = 0; r < kRows; ++r) {
              int32_t pair;  // q's dims 2p and 2p + 1 (a memcpy: bf16 data, no aliasing)
              std::memcpy(&pair, qr[r] + 2 * p, sizeof pair);
              const __m512bh qb = (__m512bh)_mm512_set1_epi32(pair);
              for (int c = 0; c < 4; ++c) s[r][c] = _mm512_dpbf16_ps(s[r][c], qb, kv4[c]);
            }
          }
          const int64_t tile_keys = std::min<int64_t>(kKeys, keys - t0);
          float corr[kRows];
          for (int r = 0; r < kRows; ++r) {
            __mmask16 mk[4];
            __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
            for (int c = 0; c < 4; ++c) {
              mk[c] = visible(t0 + 16 * c, lim[r]);
              s[r][c] = _mm512_mul_ps(s[r][c], _mm512_set1_ps(scale));
              vmax = _mm512_mask_max_ps(vmax, mk[c], vmax, s[r][c]);
            }
            const float m_new = std::max(m[r], _mm512_reduce_max_ps(vmax));
            corr[r] = m[r] == -std::numeric_limits<float>::infinity() ? 0.0f : exp1(m[r] - m_new);
            const __m512 mv = _mm512_set1_ps(m_new);
            __m512 vsum = _mm512_setzero_ps();
            for (int c = 0; c < 4; ++c) {
              const __m512 e =
                  _mm512_maskz_mov_ps(mk[c], exp_nonpositive16(_mm512_sub_ps(s[r][c], mv)));
              _mm512_store_ps(pbuf[r] + 16 * c, e);
              vsum = _mm512_add_ps(vsum, e);
            }
            l[r] = l[r] * corr[r] + _mm512_reduce_add_ps(vsum);
            m[r] = m_new;
          }
          // acc[r] = acc[r] * corr[r] + P[r] @ V[tile], C vectors per row in registers.
          __m512 o[kRows][C];
          for (int r = 0; r < kRows; ++r) {
            const __m512 cr = _mm512_set1_ps(corr[r]);
            for (int c = 0; c < C; ++c) o[r][c] = _mm512_mul_ps(_mm512_load_ps(acc[r] + 16 * c), cr);
          }
          const float* vt = vh + t0 * D;
          for (int64_t j = 0; j < tile_keys; ++j) {
            __m512 vv[C];
            for (int c = 0; c < C; ++c) vv[c] = _mm512_loadu_ps(vt + j * D + 16 * c);
            for (int r = 0; r < kRows; ++r) {
              const __m512 pj = _mm512_set1_ps(pbuf[r][j]);
              for (int c = 0; c < C; ++c) o[r][c] = _mm512_fmadd_ps(pj, vv[c], o[r][c]);
            }
          }
          for (int r = 0; r < kRows; ++r)
            for (int c = 0; c < C; ++c) _mm512_store_ps(acc[r] + 16 * c, o[r][c]);
        }
        for (int64_t r = 0; r < nr; ++r) {
          const float inv = 1.0f / l[r];
          uint16_t* orow = out + (i0 + r) * H * D + head * D;
          for (int64_t d = 0; d < D; ++d) {
            orow[d] = c10::BFloat16(acc[r][d] * inv).x;
          }
        }
      }
    }
  });
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
                       double scale) {
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
  switch (D) {
    case 64:
      return run<64>(o, qp, kp, vp, n, L, H, Hkv, q.stride(0), q.stride(1), k.stride(0),
                     k.stride(1), v.stride(0), v.stride(1), s);
    case 128:
      return run<128>(o, qp, kp, vp, n, L, H, Hkv, q.stride(0), q.stride(1), k.stride(0),
                      k.stride(1), v.stride(0), v.stride(1), s);
    default:
      TORCH_CHECK(false, "prefill_attention supports head dims 64 and 128, got ", D);
  }
#else
  (void)out, (void)q, (void)k, (void)v, (void)scale;
  TORCH_CHECK(false, "prefill_attention needs a build with AVX512-BF16");
#endif
}
