// Rotary embedding of the q and k heads of a fused qkv projection, in place, and the new K/V
// written to their cache slots: one call per layer instead of ~12 PyTorch ops (views, a roll made
// of two copies and a cat, two products, a sum, two index copies).
//
// Per head row x of head_dim D, with the sign-folded tables of RotaryEmbedding.cos_sin
// (cos = [c, c], sin = [-s, s]): x' = x * cos + roll(x, D/2) * sin, rounded as PyTorch rounds
// `x * cos + x.roll(D // 2, -1) * sin` in the tensors' dtype (in bf16 each product is rounded to
// bf16, then their sum; fp32 rounds each operation too, without fusing them).
//
// Bit for bit what PyTorch computes: a product and a sum, never fused into one FMA (a prompt's
// K computed here in one run and by PyTorch's ops in another must agree exactly in fp32). Set
// before the includes, so that the headers' inline functions share the option and inline.
#pragma GCC optimize("fp-contract=off")

#include "torch_lite.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512BF16__)
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
// Round to bf16 (nearest even, as PyTorch) and back to fp32.
inline __m512 round16(__m512 v) { return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(v)); }
inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}

// One bf16 head row, 16 lanes at a time (D a multiple of 32): the same roundings as the scalar
// loop below.
inline void rotate_head16(c10::BFloat16* head, const c10::BFloat16* c, const c10::BFloat16* s,
                          int64_t half) {
  for (int64_t i = 0; i < half; i += 16) {
    const __m512 xl = load16(head + i), xh = load16(head + half + i);
    const __m512 lo = _mm512_add_ps(round16(_mm512_mul_ps(xl, load16(c + i))),
                                    round16(_mm512_mul_ps(xh, load16(s + i))));
    const __m512 hi = _mm512_add_ps(round16(_mm512_mul_ps(xh, load16(c + half + i))),
                                    round16(_mm512_mul_ps(xl, load16(s + half + i))));
    store16(head + i, lo);
    store16(head + half + i, hi);
  }
}
#endif

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline void store(float* dst, float x) { *dst = x; }
// x is already a bf16 value (rounded): its high half is the bf16.
inline void store(c10::BFloat16* dst, float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  dst->x = static_cast<uint16_t>(bits >> 16);
}
// x rounded to the storage type and back (bf16: round to nearest even, as PyTorch's ops do).
inline float rounded(float x, float*) { return x; }
inline float rounded(float x, c10::BFloat16*) {
  // Round to nearest even, as c10::BFloat16(float) does; a NaN stays a NaN (its payload may
  // differ from c10's canonical one).
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  if (x != x) bits = 0x7fc00000u;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

// An 8-bit row's scale: its largest magnitude over the format's largest code, or 1 for a row of
// zeros (quantize_rows' rule).
template <typename scalar_t>
float row_scale_of(const scalar_t* x, int64_t D, float max_code) {
  float amax = 0.0f;
  for (int64_t i = 0; i < D; ++i) amax = std::max(amax, std::fabs(to_float(x[i])));
  return amax > 0.0f ? amax / max_code : 1.0f;
}

// One KV head's row as an int8 cache row (model/quant/kv_cache.py quantize_rows, bit for bit):
// scale = amax / 127 (1 for a row of zeros), code = x / scale rounded half to even, clamped to
// [-127, 127]; D codes, then the scale's 4 bytes.
template <typename scalar_t>
void quantize_row_int8(const scalar_t* x, int64_t D, int8_t* dst) {
  const float scale = row_scale_of(x, D, 127.0f);
  for (int64_t i = 0; i < D; ++i) {
    const float code = std::nearbyint(to_float(x[i]) / scale);
    dst[i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, code)));
  }
  std::memcpy(dst + D, &scale, sizeof scale);
}

// |y| <= 448 as fp8 e4m3 (float8_e4m3fn) bits, rounded to nearest even as PyTorch converts:
// below 2^-6 a subnormal (y * 2^9 to an integer: 8 is then the smallest normal's code), else
// the mantissa's 8 * [1, 2) to an integer (16 carries into the exponent).
inline uint8_t to_e4m3(float y) {
  const uint8_t sign = std::signbit(y) ? 0x80 : 0;
  const float a = std::fabs(y);
  if (a < 0x1p-6f) return sign | static_cast<uint8_t>(std::nearbyint(a * 0x1p9f));
  int e;
  const float mant = std::frexp(a, &e);  // a = mant * 2^e, mant in [0.5, 1)
  int k = static_cast<int>(std::nearbyint(mant * 16.0f));  // 8 * (2 * mant), in [8, 16]
  int exponent = e - 1;
  if (k == 16) k = 8, ++exponent;
  return sign | static_cast<uint8_t>(((exponent + 7) << 3) | (k - 8));
}

// One KV head's row as an fp8 e4m3 cache row (quantize_rows, bit for bit): scale = amax / 448
// (1 for a row of zeros), code = e4m3(x / scale clamped to [-448, 448]); then the scale.
template <typename scalar_t>
void quantize_row_fp8(const scalar_t* x, int64_t D, uint8_t* dst) {
  const float scale = row_scale_of(x, D, 448.0f);
  for (int64_t i = 0; i < D; ++i) {
    dst[i] = to_e4m3(std::min(448.0f, std::max(-448.0f, to_float(x[i]) / scale)));
  }
  std::memcpy(dst + D, &scale, sizeof scale);
}

// Where the rotated K and V rows go: the caches in qkv's dtype, or 8-bit rows (`k8`, `v8`: D
// codes and a scale each, `pitch` = D + 4 bytes a head; `fp8`: e4m3 codes, else int8).
template <typename scalar_t>
struct KVDest {
  scalar_t* k;
  scalar_t* v;
  int8_t* k8;
  int8_t* v8;
  int64_t pitch;
  bool fp8;
};

template <typename scalar_t>
void rope_rows(scalar_t* qkv, int64_t row_stride, const scalar_t* cos, const scalar_t* sin,
               int64_t tokens, int64_t rot_heads, int64_t D, const KVDest<scalar_t>& dest,
               const int64_t* slots, int64_t kv_heads, int64_t q_heads) {
  const int64_t half = D / 2;
  // ~64 tokens a task: smaller ones cost more to hand out (and wake a thread for) than they save.
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> x(D);
    for (int64_t t = begin; t < end; ++t) {
      scalar_t* row = qkv + t * row_stride;
      const scalar_t* c = cos + t * D;
      const scalar_t* s = sin + t * D;
      for (int64_t h = 0; h < rot_heads; ++h) {
        scalar_t* head = row + h * D;
#if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
          if (half % 16 == 0) {
            rotate_head16(head, c, s, half);
            continue;
          }
        }
#endif
        for (int64_t i = 0; i < D; ++i) x[i] = to_float(head[i]);
        // roll(x, D/2)[i] is x[i + D/2] in the first half and x[i - D/2] in the second.
        for (int64_t i = 0; i < half; ++i) {
          const float a = rounded(x[i] * to_float(c[i]), static_cast<scalar_t*>(nullptr));
          const float b = rounded(x[i + half] * to_float(s[i]), static_cast<scalar_t*>(nullptr));
          store(head + i, rounded(a + b, static_cast<scalar_t*>(nullptr)));
        }
        for (int64_t i = half; i < D; ++i) {
          const float a = rounded(x[i] * to_float(c[i]), static_cast<scalar_t*>(nullptr));
          const float b = rounded(x[i - half] * to_float(s[i]), static_cast<scalar_t*>(nullptr));
          store(head + i, rounded(a + b, static_cast<scalar_t*>(nullptr)));
        }
      }
      if (dest.k8 != nullptr) {
        for (int64_t h = 0; h < kv_heads; ++h) {
          const int64_t off = (slots[t] * kv_heads + h) * dest.pitch;
          const scalar_t* k = row + (q_heads + h) * D;
          const scalar_t* v = row + (q_heads + kv_heads + h) * D;
          if (dest.fp8) {
            quantize_row_fp8(k, D, reinterpret_cast<uint8_t*>(dest.k8 + off));
            quantize_row_fp8(v, D, reinterpret_cast<uint8_t*>(dest.v8 + off));
          } else {
            quantize_row_int8(k, D, dest.k8 + off);
            quantize_row_int8(v, D, dest.v8 + off);
          }
        }
        continue;
      }
      const int64_t kv_bytes = kv_heads * D * static_cast<int64_t>(sizeof(scalar_t));
      std::memcpy(dest.k + slots[t] * kv_heads * D, row + q_heads * D, kv_bytes);
      std::memcpy(dest.v + slots[t] * kv_heads * D, row + (q_heads + kv_heads) * D, kv_bytes);
    }
  });
}

}  // namespace

// qkv [T, >= (q_heads + 2 * kv_heads) * D] with contiguous rows (the fused projection's output);
// cos, sin [T, D] contiguous; caches [blocks, block_size, kv_heads, D] contiguous (qkv's dtype,
// or int8 / fp8 rows of D codes and a scale: [.., D + 4], the 8-bit KV cache); slots [T] int64.
// Rotates the q and k heads of qkv in place, then copies (or quantizes) k and v into their slots.
void rope_write_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t q_heads,
                   int64_t kv_heads, torch::Tensor k_cache, torch::Tensor v_cache,
                   torch::Tensor slots) {
  TORCH_CHECK(qkv.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu() &&
                  k_cache.device().is_cpu() && v_cache.device().is_cpu() &&
                  slots.device().is_cpu(),
              "rope_write_kv runs on CPU tensors only");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == kv_heads,
              "caches must be contiguous [blocks, block_size, kv_heads, D] of one shape");
  // 8-bit rows: int8 (kChar) or fp8 e4m3 (kByte) codes, D + 4 bytes a head.
  const bool fp8 = k_cache.scalar_type() == torch::kByte;
  const bool eight_bit = k_cache.scalar_type() == torch::kChar || fp8;
  const int64_t D = k_cache.size(3) - (eight_bit ? 4 : 0), T = qkv.size(0);
  TORCH_CHECK(D % 2 == 0 && q_heads > 0 && kv_heads > 0, "rope_write_kv: bad head counts");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) >= (q_heads + 2 * kv_heads) * D,
              "qkv must be [T, (q_heads + 2 * kv_heads) * D] with contiguous rows");
  TORCH_CHECK(cos.dim() == 2 && sin.dim() == 2 && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.size(0) == T && sin.size(0) == T && cos.size(1) == D && sin.size(1) == D,
              "cos and sin must be contiguous [T, D]");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.dim() == 1 && slots.size(0) == T &&
                  slots.is_contiguous(),
              "slots must be a contiguous int64 [T]");
  TORCH_CHECK(qkv.scalar_type() == cos.scalar_type() && qkv.scalar_type() == sin.scalar_type() &&
                  (eight_bit || qkv.scalar_type() == k_cache.scalar_type()) &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "qkv, cos, sin and the caches must share a dtype (or the caches be 8-bit rows)");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(0 <= sp[t] && sp[t] < num_slots, "slot ", sp[t], " is not in the cache");
  }
  auto dest = [&](auto* typed) {
    using T_ = std::remove_pointer_t<decltype(typed)>;
    if (eight_bit) {
      return KVDest<T_>{nullptr, nullptr, static_cast<int8_t*>(k_cache.data_ptr()),
                        static_cast<int8_t*>(v_cache.data_ptr()), D + 4, fp8};
    }
    return KVDest<T_>{k_cache.data_ptr<T_>(), v_cache.data_ptr<T_>(), nullptr, nullptr, D, false};
  };
  if (qkv.scalar_type() == torch::kFloat) {
    rope_rows<float>(qkv.data_ptr<float>(), qkv.stride(0), cos.data_ptr<float>(),
                     sin.data_ptr<float>(), T, q_heads + kv_heads, D,
                     dest(static_cast<float*>(nullptr)), sp, kv_heads, q_heads);
  } else if (qkv.scalar_type() == torch::kBFloat16) {
    using bf = c10::BFloat16;
    rope_rows<bf>(qkv.data_ptr<bf>(), qkv.stride(0), cos.data_ptr<bf>(), sin.data_ptr<bf>(), T,
                  q_heads + kv_heads, D, dest(static_cast<bf*>(nullptr)), sp, kv_heads, q_heads);
  } else {
    TORCH_CHECK(false, "rope_write_kv supports float32 and bfloat16, got ", qkv.scalar_type());
  }
}

// Whether this build has the AVX512-BF16 vector loop (bf16 steps of any size are fast).
bool rope_kv_vectorized() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}
