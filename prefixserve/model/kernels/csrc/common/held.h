// `held(v)`: v as computed, kept in a register: an empty asm that takes and returns it, so the
// compiler can move no arithmetic across it. Two uses: a product the AVX-512 code rounds on its
// own (a `_round` form, VSCALEFPS) is not fused by -ffp-contract into a later add on 256 bits
// (attn_lanes_avx2.h, exp_avx2.h); integer sums are not reassociated into stack temporaries
// (kquant_tiles.h's AVX2 step). For 256-bit vectors, whatever the build's -march (the GEMM's
// AVX2 tiles are compiled into every x86-64 build).
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

namespace prefixserve {

template <class V>
__attribute__((target("avx2,fma"))) inline V held(V v) {
  asm("" : "+x"(v));
  return v;
}

}  // namespace prefixserve

#endif  // x86-64 GCC
