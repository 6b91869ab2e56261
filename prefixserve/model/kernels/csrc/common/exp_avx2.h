// exp(x) for x <= 0 on eight fp32 lanes (AVX2 and FMA): exp_avx512.h's exp_nonpositive16 lane for
// lane (the same clamp, reduction and polynomial; p * 2^n is VSCALEFPS's result for the integral
// n in [-126, 0] that x >= -87 gives, one rounding either way; a NaN stays a NaN). The attention
// kernels' AVX2 softmax (attn_lanes_avx2.h) and the GEMM's AVX2 epilogue (gemm_bf16_tiles.h) take
// it. A target attribute, not the build's -march: the GEMM's AVX2 tiles are compiled into every
// x86-64 build.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include "held.h"

namespace prefixserve {

__attribute__((target("avx2,fma"))) inline __m256 exp_nonpositive8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);  // NaN in x stays NaN (max returns operand 2)
  const __m256 n = _mm256_round_ps(held(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f))),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723e-6f), r);
  __m256 p = _mm256_set1_ps(0.00138889f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.00833336823f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.0416666418f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.166666672f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return held(_mm256_mul_ps(p, _mm256_castsi256_ps(e)));  // a NaN p: a NaN whatever e is
}

}  // namespace prefixserve

#endif  // x86-64 GCC
