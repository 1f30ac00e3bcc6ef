// elements.h's loads and stores for a block of 16-bit params on ATen's vectors, for the CPU library's AVX2 and
// AVX-512 builds: the elements of one at::vec::Vectorized<P> (16 or 32), in opmath as two float vectors. The same
// bits as element by element: bf16 rounded to nearest even with NaN as kBf16NanBits, fp16 by F16C, which
// c10::Half takes in these builds too.
//
// A bf16 block is read as 32-bit lanes of two elements each: its even elements are the lanes shifted up by 16
// bits, its odd ones the lanes' high halves (an instruction each, where a conversion in order takes two and a
// shuffle), and fp32 state is de-interleaved to match. The roundings work on the lanes' bits, and packing them
// back is a shift and an or. An fp16 block takes ATen's conversions (F16C), in order.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cstdint>
#include <type_traits>

#include "elements.h"
#include "rounding.h"
#include "sgd_math.h"

namespace lfsgd {

template <typename P>
constexpr int64_t kBlockElems = at::vec::Vectorized<P>::size();

template <typename P>
constexpr bool kEvenOdd = std::is_same_v<P, c10::BFloat16>;

// A block in opmath: its first and second halves, or (bf16 params) its even and odd elements.
struct FloatPair {
  FloatVec low;
  FloatVec high;
};

LFSGD_ELEMENT IntVec bits_of(const FloatVec& v) { return at::vec::cast<int32_t>(v); }
LFSGD_ELEMENT FloatVec float_of(const IntVec& bits) { return at::vec::cast<float>(bits); }

// The bf16 values whose bits are the high halves of the lanes' bits (the low halves dropped).
LFSGD_ELEMENT FloatVec bf16_value(const IntVec& bits) { return float_of(bits & IntVec(kHighHalf)); }

// The block at i of a tensor of T that belongs to params of P.
template <typename P, typename T>
LFSGD_ELEMENT FloatPair load_block(const T* p, int64_t i) {
  if constexpr (std::is_same_v<T, float>) {
    const FloatVec first = FloatVec::loadu(p + i);
    const FloatVec second = FloatVec::loadu(p + i + FloatVec::size());
    if constexpr (kEvenOdd<P>) {
      const auto [even, odd] = at::vec::deinterleave2(first, second);
      return {even, odd};
    } else {
      return {first, second};
    }
  } else if constexpr (kEvenOdd<P>) {
    const IntVec lanes = IntVec::loadu(p + i);
    return {float_of(shift_left<16>(lanes)), bf16_value(lanes)};
  } else {
    const auto [low, high] = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(p + i));
    return {low, high};
  }
}

// bf16 bits in the high halves of `v`'s lanes where v is not NaN, else kBf16NanBits.
LFSGD_ELEMENT IntVec nan_as_bf16_nan(const IntVec& bits, const FloatVec& v) {
  return bits_of(where_nan(v, FloatVec(bits_float(uint32_t{kBf16NanBits} << 16)), float_of(bits)));
}

// Each lane rounded to nearest even bf16 (rounded_bits), in the high half of its bits.
LFSGD_ELEMENT IntVec nearest_bf16_bits(const FloatVec& v) {
  return nan_as_bf16_nan(nearest_even_high_bits(bits_of(v)), v);
}

// Each lane rounded stochastically with its 16 random bits (stochastic_bf16_bits), in the high half of its bits.
LFSGD_ELEMENT IntVec stochastic_bf16_bits(const FloatVec& v, const IntVec& random16) {
  return nan_as_bf16_nan(stochastic_high_bits(bits_of(v), random16), v);
}

// The bf16 bits in the high halves of the even and odd lanes, packed back into elements and stored at i.
LFSGD_ELEMENT void store_bf16_bits(c10::BFloat16* p, int64_t i, const IntVec& even, const IntVec& odd) {
  (shift_right_logical<16>(even) | (odd & IntVec(kHighHalf))).store(p + i);
}

// The block, rounded to nearest in T, stored at i of a tensor of T that belongs to params of P.
template <typename P, typename T>
LFSGD_ELEMENT void store_block(T* p, int64_t i, const FloatPair& v) {
  if constexpr (std::is_same_v<T, float>) {
    FloatPair out = v;
    if constexpr (kEvenOdd<P>) std::tie(out.low, out.high) = at::vec::interleave2(v.low, v.high);
    out.low.store(p + i);
    out.high.store(p + i + FloatVec::size());
  } else if constexpr (kEvenOdd<P>) {
    store_bf16_bits(p, i, nearest_bf16_bits(v.low), nearest_bf16_bits(v.high));
  } else {
    at::vec::convert_from_float<T>(v.low, v.high).store(p + i);
  }
}

// The block rounded to nearest in P, as floats.
template <typename P>
LFSGD_ELEMENT FloatPair rounded_block(const FloatPair& v) {
  if constexpr (kEvenOdd<P>) {
    return {bf16_value(nearest_bf16_bits(v.low)), bf16_value(nearest_bf16_bits(v.high))};
  } else {
    const auto [low, high] = at::vec::convert_to_float<P>(at::vec::convert_from_float<P>(v.low, v.high));
    return {low, high};
  }
}

// load_weight, for the block at i.
template <Weight kWeight, typename P, typename M>
LFSGD_ELEMENT FloatPair load_weight_block(const P* w, const M* m, int64_t i) {
  const FloatPair param = load_block<P>(w, i);
  if constexpr (kWeight == Weight::kParam) {
    return param;
  } else if constexpr (kWeight == Weight::kKahan) {
    const FloatPair compensation = load_block<P>(m, i);
    return {param.low + compensation.low, param.high + compensation.high};
  } else {
    const FloatPair master = load_block<P>(m, i);
    const FloatPair rounded = rounded_block<P>(master);
    return {synced_master(master.low, bits_of(rounded.low), bits_of(param.low), param.low),
            synced_master(master.high, bits_of(rounded.high), bits_of(param.high), param.high)};
  }
}

// store_update's operations (elements.h) for a block at i: its bf16 bits as the high halves of its even and odd
// lanes, its elements' random bits (element_random_bits over the block's indices, which share their high 32 bits: a
// chunk holds whole blocks, and 2^32 whole chunks), its stores.
struct BitsPair {
  IntVec low;
  IntVec high;
};

LFSGD_ELEMENT BitsPair nearest_bf16(const FloatPair& v) { return {nearest_bf16_bits(v.low), nearest_bf16_bits(v.high)}; }
LFSGD_ELEMENT FloatPair bf16_value(const BitsPair& bits) { return {bf16_value(bits.low), bf16_value(bits.high)}; }
LFSGD_ELEMENT void store_bf16(c10::BFloat16* p, int64_t i, const BitsPair& bits) {
  store_bf16_bits(p, i, bits.low, bits.high);
}
LFSGD_ELEMENT FloatPair kahan_compensation(const FloatPair& weight, const FloatPair& rounded) {
  return {kahan_compensation(weight.low, rounded.low), kahan_compensation(weight.high, rounded.high)};
}

// The even and odd lanes' counters: the first element's plus n * kGoldenStep for the element n places on (vector
// adds wrap as uint32_t does; the steps are constants).
LFSGD_ELEMENT BitsPair random_bits(uint32_t key, int64_t i, const FloatPair& /*like*/) {
  const uint64_t index = static_cast<uint64_t>(i);
  const IntVec first(
      static_cast<int32_t>(draw_counter(key, static_cast<uint32_t>(index), static_cast<uint32_t>(index >> 32))));
  const IntVec golden(static_cast<int32_t>(kGoldenStep));
  return {mix32(first + IntVec::arange(0, 2) * golden), mix32(first + IntVec::arange(1, 2) * golden)};
}
LFSGD_ELEMENT BitsPair stochastic_bf16(const FloatPair& v, const BitsPair& random16) {
  return {stochastic_bf16_bits(v.low, random16.low), stochastic_bf16_bits(v.high, random16.high)};
}
LFSGD_ELEMENT BitsPair high_half(const BitsPair& random) {
  return {shift_right_logical<16>(random.low), shift_right_logical<16>(random.high)};
}
LFSGD_ELEMENT BitsPair low_half(const BitsPair& random) {
  const IntVec low16(0xFFFF);
  return {random.low & low16, random.high & low16};
}
template <typename P, typename T>
LFSGD_ELEMENT void store_value(T* p, int64_t i, const FloatPair& v) {
  store_block<P>(p, i, v);
}
template <typename P, typename T>
LFSGD_ELEMENT FloatPair load_value(const T* p, int64_t i, const FloatPair& /*like*/) {
  return load_block<P>(p, i);
}
template <typename S>
LFSGD_ELEMENT FloatPair averaged(const FloatPair& average, const FloatPair& w, const AverageCoeffs<S>& a) {
  return {averaged(average.low, w.low, a), averaged(average.high, w.high, a)};
}

// The update's operations (elements.h: load_operands, update_at) for a block.
template <Weight kWeight, typename P, typename M>
LFSGD_ELEMENT FloatPair load_weight_value(const P* w, const M* m, int64_t i, const FloatPair& /*like*/) {
  return load_weight_block<kWeight>(w, m, i);
}
LFSGD_ELEMENT FloatPair zero_like(const FloatPair& /*like*/) { return {FloatVec(0.0f), FloatVec(0.0f)}; }
// A block's update: each half's operands on their own.
template <bool kScheduleFree, bool kClipValue, typename S>
LFSGD_ELEMENT void update_element(Operands<FloatPair>& o, const Coeffs<S>& c) {
  Operands<FloatVec> low, high;
  zip_operands([](const FloatPair& pair, FloatVec& l, FloatVec& h) {
    l = pair.low;
    h = pair.high;
  }, o, low, high);
  update_element<kScheduleFree, kClipValue>(low, c);
  update_element<kScheduleFree, kClipValue>(high, c);
  zip_operands([](FloatPair& pair, const FloatVec& l, const FloatVec& h) { pair = {l, h}; }, o, low, high);
}

}  // namespace lfsgd
