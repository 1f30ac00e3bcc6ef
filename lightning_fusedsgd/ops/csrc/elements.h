// One element's memory, written once for the CPU kernel and (under nvcc) the CUDA kernel: what a bucket's
// master_params hold, loads into opmath and stores back, the weight an element steps from (load_weight), and the
// rounding of its update into the param, buffer, master or compensation (store_update). The bf16 conversions are
// integer work the CPU compiler vectorizes (round to nearest even, NaN kept quiet), and give c10::BFloat16's bits.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "sgd_math.h"

namespace lfsgd {

// What a bucket's master_params hold: nothing; fp32 master weights of bf16/fp16 params, which hold their
// rounding; or bf16 Kahan compensations of bf16 params, the weight being param + compensation (sgd_math.h).
enum class Masters { kNone, kFp32, kCompensation };

// The element type of a bucket's master_params.
template <Masters kMasters>
using MasterType = std::conditional_t<kMasters == Masters::kCompensation, c10::BFloat16, float>;

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

// The high half of fp32 bits rounded to nearest even, NaN not treated apart (the callers decide).
LFSGD_ELEMENT uint32_t nearest_even_high_bits(uint32_t bits) { return (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16; }

// The bits of v rounded to bf16. Integer operations only (the NaN test too): a float comparison in the loop keeps
// the compiler from vectorizing the bf16 loops.
LFSGD_ELEMENT uint16_t rounded_bits(float v) {
  const uint32_t bits = float_bits(v);
  return static_cast<uint16_t>(nan_bits(bits) ? 0x7FC0u : nearest_even_high_bits(bits));
}

// The bits a 16-bit element holds.
template <typename P>
LFSGD_ELEMENT uint16_t bits16(const P* p, int64_t i) {
  return reinterpret_cast<const uint16_t*>(p)[i];
}

LFSGD_ELEMENT float load(const float* p, int64_t i) { return p[i]; }
LFSGD_ELEMENT double load(const double* p, int64_t i) { return p[i]; }
LFSGD_ELEMENT float load(const c10::Half* p, int64_t i) { return static_cast<float>(p[i]); }
LFSGD_ELEMENT float load(const c10::BFloat16* p, int64_t i) { return bits_float(uint32_t{bits16(p, i)} << 16); }

LFSGD_ELEMENT void store(float* p, int64_t i, float v) { p[i] = v; }
LFSGD_ELEMENT void store(double* p, int64_t i, double v) { p[i] = v; }
LFSGD_ELEMENT void store(c10::Half* p, int64_t i, float v) { p[i] = c10::Half(v); }
LFSGD_ELEMENT void store(c10::BFloat16* p, int64_t i, float v) { reinterpret_cast<uint16_t*>(p)[i] = rounded_bits(v); }

// The weight of element i in opmath: the param, its fp32 master re-synced with the param (synced_master), or the
// param plus its Kahan compensation. The bf16 comparison is integer work the compiler vectorizes (a NaN master may
// compare unequal and take the param's NaN: NaN either way).
template <Masters kMasters, typename P, typename M>
LFSGD_ELEMENT typename OpMath<P>::type load_weight(const P* w, const M* m, int64_t i) {
  if constexpr (kMasters == Masters::kNone) {
    return load(w, i);
  } else if constexpr (kMasters == Masters::kCompensation) {
    return load(w, i) + load(m, i);
  } else if constexpr (std::is_same_v<P, c10::BFloat16>) {
    const uint32_t master = float_bits(m[i]);
    const uint32_t rounded = nearest_even_high_bits(master) & 0xFFFFu;
    const uint32_t param = bits16(w, i);
    return bits_float(synced_master(master, rounded, param, param << 16));
  } else {
    return synced_master(m[i], c10::Half(m[i]).x, bits16(w, i), load(w, i));
  }
}

// Stores element i's update: the weight `wi` into the fp32 master and its rounding into the param, or rounded to
// nearest into the param and what that dropped into the Kahan compensation, or rounded stochastically with the
// element's random bits (`key`: rounding_key; bf16 params without masters only), or rounded to nearest; and the
// momentum buffer `bi` where there is one, rounded the same way as the param.
template <Masters kMasters, typename P, typename B, typename M, typename O>
LFSGD_ELEMENT void store_update(P* w, B* b, M* m, int64_t i, O wi, O bi, bool momentum, bool stochastic,
                                uint32_t key) {
  if constexpr (kMasters == Masters::kFp32) m[i] = static_cast<float>(wi);
  if constexpr (kMasters == Masters::kCompensation) {
    const uint16_t rounded = rounded_bits(wi);
    reinterpret_cast<uint16_t*>(w)[i] = rounded;
    store(m, i, kahan_compensation(wi, bits_float(uint32_t{rounded} << 16)));
    if (momentum) store(b, i, bi);
    return;
  }
  if constexpr (std::is_same_v<P, c10::BFloat16> && kMasters == Masters::kNone) {
    if (stochastic) {
      const uint32_t random = element_random_bits(key, i);
      reinterpret_cast<uint16_t*>(w)[i] = stochastic_bf16_bits(float_bits(wi), random >> 16);
      if (momentum) reinterpret_cast<uint16_t*>(b)[i] = stochastic_bf16_bits(float_bits(bi), random & 0xFFFFu);
      return;
    }
  }
  store(w, i, wi);
  if (momentum) store(b, i, bi);
}

}  // namespace lfsgd
