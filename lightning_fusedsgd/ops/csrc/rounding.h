// How an update is rounded into bf16, bit by bit, written once for the CPU's scalar and vector loops (vec_math.h
// gives the vector forms of the few operations a lane does otherwise) and CUDA: to nearest even, a NaN as
// kBf16NanBits (store, store_update in elements.h); with a Kahan compensation (update_rounding="kahan"); and
// stochastically, with 32 random bits per element drawn from (seed, count, tensor, index) (update_rounding=
// "stochastic"). ops/reference.py mirrors them. Integer operations on a float's bits, which the compiler
// vectorizes where the CPU kernel has no vector code.
#pragma once

#include <cstdint>
#include <cstring>

#include "sgd_math.h"

namespace lfsgd {

// A float's bits and back (memcpy: the defined way, compiled to nothing).
LFSGD_ELEMENT uint32_t float_bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return bits;
}
LFSGD_ELEMENT float bits_float(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// x shifted right by kBits, logically. `U`, here and below: uint32_t, or a vector of int32 lanes (vec_math.h),
// whose multiplies wrap alike.
template <int kBits, typename U>
LFSGD_ELEMENT U shift_right_logical(U x) {
  return x >> kBits;
}

// The bits a bf16 NaN is stored as, whatever the NaN: ATen's vector conversions' (all ones), which the CPU
// kernel's vector loops take, so its scalar tail, and the CUDA kernel, take them too.
constexpr uint16_t kBf16NanBits = 0xFFFFu;

// Whether fp32 bits are a NaN, in integer operations.
LFSGD_ELEMENT bool nan_bits(uint32_t bits) { return (bits & 0x7FFFFFFFu) > 0x7F800000u; }

// The high half of fp32 bits: where a bf16 value's bits sit.
constexpr uint32_t kHighHalf = 0xFFFF0000u;

// fp32 bits rounded to nearest even bf16, in their high half (the low half is what rounding drops), NaN not
// treated apart (the callers keep it).
template <typename U>
LFSGD_ELEMENT U nearest_even_high_bits(U bits) {
  return bits + U(0x7FFFu) + (shift_right_logical<16>(bits) & U(1u));
}

// The bits of v rounded to nearest even bf16, a NaN as kBf16NanBits. Integer operations only (the NaN test too),
// which the compiler vectorizes where the CPU kernel has no vector code.
LFSGD_ELEMENT uint16_t rounded_bits(float v) {
  const uint32_t bits = float_bits(v);
  return nan_bits(bits) ? kBf16NanBits : static_cast<uint16_t>(nearest_even_high_bits(bits) >> 16);
}

// x where it is finite, else 0, in float operations: x - x is 0 exactly where x is finite.
template <typename V>
LFSGD_ELEMENT V finite_or_zero(V x) {
  return x - x == V(0) ? x : V(0);
}

// Kahan-compensated bf16 weights (update_rounding="kahan", bf16 params without masters): the weight is param +
// compensation, added in fp32. After the update the param takes the fp32 result rounded to nearest, and the
// compensation what that rounding dropped (the difference is exact in fp32), itself rounded to nearest bf16:
// an update below half an ulp of the param accumulates there until it moves the param. The compensation of a
// param rounded to inf or NaN is 0 (inf - inf would make the next weight NaN).
template <typename V>
LFSGD_ELEMENT V kahan_compensation(V weight, V rounded) {
  return finite_or_zero(weight - rounded);
}

// Stochastic rounding of the update to bf16 (update_rounding="stochastic", bf16 params without masters): the
// fp32 result rounds up with probability (the dropped 16 bits) / 2^16, so E[rounded] is the fp32 value and small
// updates are not lost. Each element draws 32 random bits, a pure function of (seed, the param's count of
// stochastic steps, tensor, element index), the same on any thread count and device: the high 16 round the
// weight, the low 16 the aux stream (momentum buffer, z). The draw is murmur3's 32-bit finalizer over a per-tensor
// key plus the index times the golden ratio (one finalizer an element, which keeps the step near the memory floor:
// its two integer multiplies, and the index's, which the vector loops replace by an addition: draw_counter).
template <typename U>
LFSGD_ELEMENT U mix32(U x) {
  x = x ^ shift_right_logical<16>(x);
  x = x * U(0x85EBCA6Bu);
  x = x ^ shift_right_logical<13>(x);
  x = x * U(0xC2B2AE35u);
  return x ^ shift_right_logical<16>(x);
}

// The key of one tensor's draws at its count of stochastic steps: tensor is its index in the bucket.
LFSGD_HOST_DEVICE inline uint32_t rounding_key(double rounding_seed, int64_t count, int64_t tensor) {
  const uint64_t seed = static_cast<uint64_t>(rounding_seed);
  const uint64_t step = static_cast<uint64_t>(count);
  uint32_t key = mix32(static_cast<uint32_t>(seed) ^ 0x9E3779B9u);
  key = mix32(key ^ static_cast<uint32_t>(seed >> 32));
  key = mix32(key ^ static_cast<uint32_t>(step));
  key = mix32(key ^ static_cast<uint32_t>(step >> 32));
  return mix32(key ^ static_cast<uint32_t>(tensor));
}

// 2^32 over the golden ratio: consecutive indices times it spread over the 32 bits before the finalizer.
constexpr uint32_t kGoldenStep = 0x9E3779B9u;

// What the finalizer mixes into the 32 random bits of the element with index (index_high << 32) + index_low of
// the tensor with this key. It wraps, so the element n places on has this plus n * kGoldenStep: the vector loops
// add that to one element's counter instead of multiplying each lane's index.
LFSGD_ELEMENT uint32_t draw_counter(uint32_t key, uint32_t index_low, uint32_t index_high) {
  return key + index_low * kGoldenStep + index_high;
}

LFSGD_ELEMENT uint32_t element_random_bits(uint32_t key, int64_t i) {
  const uint64_t index = static_cast<uint64_t>(i);
  return mix32(draw_counter(key, static_cast<uint32_t>(index), static_cast<uint32_t>(index >> 32)));
}

// The fp32 bits rounded stochastically to their high half with 16 random bits: added below the kept bits, then
// the sum is truncated (+-inf stays +-inf; a NaN's sum means nothing, the callers keep the NaN).
template <typename U>
LFSGD_ELEMENT U stochastic_high_bits(U bits, U random16) {
  return (bits + random16) & U(kHighHalf);
}

// The bf16 bits of the fp32 value with these bits, rounded stochastically (stochastic_high_bits).
LFSGD_ELEMENT uint16_t stochastic_bf16_bits(uint32_t bits, uint32_t random16) {
  return nan_bits(bits) ? kBf16NanBits : static_cast<uint16_t>(stochastic_high_bits(bits, random16) >> 16);
}

}  // namespace lfsgd
