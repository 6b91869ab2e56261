// exp(x) for x <= 0 in 16 fp32 lanes (AVX-512): range reduction to [-ln2/2, ln2/2] and a degree-6
// polynomial, ~2 ulp; the attention kernels' softmax (paged_attention.cpp, prefill_attention.cpp).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace prefixserve {

inline __m512 exp_nonpositive16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);  // NaN in x stays NaN (max returns operand 2)
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723e-6f), r);
  __m512 p = _mm512_set1_ps(0.00138889f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.00833336823f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.0416666418f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.166666672f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

}  // namespace prefixserve

#endif  // __AVX512F__
