// The element functions' operations that a vector of floats (ATen's at::vec::Vectorized<float>) does otherwise
// than a float: for the CPU library's AVX2 and AVX-512 builds, whose 16-bit loops run on vectors (sgd_math.h
// includes this file ahead of its templates and rounding.h's, whose lookup needs these overloads declared first).
// Where at::vec has no single instruction for one (a logical shift by a constant, a select by a comparison, which
// it takes through a mask vector), the capability's intrinsic.
#pragma once

#include <ATen/cpu/vec/vec.h>

#include <cstdint>

#if !defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
#error "vec_math.h is for the CPU library's AVX2 and AVX-512 builds"
#endif

namespace lfsgd {

using FloatVec = at::vec::Vectorized<float>;
using IntVec = at::vec::Vectorized<int32_t>;

// These builds have FMA: one rounding, as mul_add's scalar form.
LFSGD_ELEMENT FloatVec mul_add(const FloatVec& a, const FloatVec& b, const FloatVec& c) {
  return at::vec::fmadd(a, b, c);
}

// max then min, each of which returns its second operand where one is NaN: a NaN stays NaN.
LFSGD_ELEMENT FloatVec clamp_keep_nan(const FloatVec& g, float bound) {
  return at::vec::clamp(g, FloatVec(-bound), FloatVec(bound));
}

template <int kBits>
LFSGD_ELEMENT IntVec shift_right_logical(const IntVec& x) {
#ifdef CPU_CAPABILITY_AVX512
  return _mm512_srli_epi32(x, kBits);
#else
  return _mm256_srli_epi32(x, kBits);
#endif
}

template <int kBits>
LFSGD_ELEMENT IntVec shift_left(const IntVec& x) {
#ifdef CPU_CAPABILITY_AVX512
  return _mm512_slli_epi32(x, kBits);
#else
  return _mm256_slli_epi32(x, kBits);
#endif
}

// a where `condition` (one value for every lane: a coefficient's test), else b: a blend, where a select on
// vectors would branch in every block.
LFSGD_ELEMENT FloatVec pick(bool condition, const FloatVec& a, const FloatVec& b) {
#ifdef CPU_CAPABILITY_AVX512
  return _mm512_mask_blend_ps(condition ? 0xFFFF : 0, b, a);
#else
  return _mm256_blendv_ps(b, a, _mm256_castsi256_ps(_mm256_set1_epi32(condition ? -1 : 0)));
#endif
}

// if_nan where `test` is NaN, else otherwise.
LFSGD_ELEMENT FloatVec where_nan(const FloatVec& test, const FloatVec& if_nan, const FloatVec& otherwise) {
#ifdef CPU_CAPABILITY_AVX512
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(test, test, _CMP_UNORD_Q), otherwise, if_nan);
#else
  return _mm256_blendv_ps(otherwise, if_nan, _mm256_cmp_ps(test, test, _CMP_UNORD_Q));
#endif
}

// x - x is 0 exactly where x is finite.
LFSGD_ELEMENT FloatVec finite_or_zero(const FloatVec& x) {
  const FloatVec difference = x - x;
#ifdef CPU_CAPABILITY_AVX512
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(difference, _mm512_setzero_ps(), _CMP_EQ_OQ), x);
#else
  return _mm256_and_ps(x, _mm256_cmp_ps(difference, _mm256_setzero_ps(), _CMP_EQ_OQ));
#endif
}

// The master where its rounding (as float bits: the 16-bit widening is exact) equals the param's, else the param.
LFSGD_ELEMENT FloatVec synced_master(const FloatVec& master, const IntVec& master_rounded, const IntVec& param_bits,
                                     const FloatVec& param) {
#ifdef CPU_CAPABILITY_AVX512
  return _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask(master_rounded, param_bits), param, master);
#else
  return _mm256_blendv_ps(param, master, _mm256_castsi256_ps(_mm256_cmpeq_epi32(master_rounded, param_bits)));
#endif
}

}  // namespace lfsgd
