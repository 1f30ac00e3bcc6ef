// One element's memory, written once for the CPU kernel and (under nvcc) the CUDA kernel: loads into opmath and
// stores back, the weight an element steps from (load_weight), the rounding of its update into the param, aux
// stream, master or compensation (store_update), and a tensor's streams (Streams, from its slots) with the update's loads
// (load_operands) and its math and stores (update_at), which both kernels' loops call. The CPU kernel's AVX2 and
// AVX-512 builds run the same on ATen's vectors for 16-bit params (vec_elements.h), which give the same bits.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

#include "rounding.h"
#include "sgd_math.h"
#include "slots.h"

namespace lfsgd {

// The bits of v rounded to nearest in the 16-bit type P.
template <typename P>
LFSGD_ELEMENT uint16_t nearest_bits(float v) {
  if constexpr (std::is_same_v<P, c10::BFloat16>) {
    return rounded_bits(v);
  } else {
    return c10::Half(v).x;
  }
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
// param plus its Kahan compensation (`m`: the companion).
template <Weight kWeight, typename P, typename M>
LFSGD_ELEMENT typename OpMath<P>::type load_weight(const P* w, const M* m, int64_t i) {
  if constexpr (kWeight == Weight::kParam) {
    return load(w, i);
  } else if constexpr (kWeight == Weight::kKahan) {
    return load(w, i) + load(m, i);
  } else {
    return synced_master(m[i], nearest_bits<P>(m[i]), bits16(w, i), load(w, i));
  }
}

// What the store of an update does to one element, written for a value of the opmath type (here) and for a
// vector block of 16-bit params (vec_elements.h), so that store_update below is written once for both: the bf16
// bits of a value rounded to nearest (nan as kBf16NanBits), the value those bits hold, their store, the
// element's 32 random bits (element_random_bits; `like` picks the overload), a value rounded stochastically
// with 16 of them, and a value stored rounded to nearest in the element type of p (params of P).
LFSGD_ELEMENT uint16_t nearest_bf16(float v) { return rounded_bits(v); }
LFSGD_ELEMENT float bf16_value(uint16_t bits) { return bits_float(uint32_t{bits} << 16); }
LFSGD_ELEMENT void store_bf16(c10::BFloat16* p, int64_t i, uint16_t bits) { reinterpret_cast<uint16_t*>(p)[i] = bits; }
LFSGD_ELEMENT uint32_t random_bits(uint32_t key, int64_t i, float /*like*/) { return element_random_bits(key, i); }
LFSGD_ELEMENT uint16_t stochastic_bf16(float v, uint32_t random16) { return stochastic_bf16_bits(float_bits(v), random16); }
LFSGD_ELEMENT uint32_t high_half(uint32_t random) { return random >> 16; }
LFSGD_ELEMENT uint32_t low_half(uint32_t random) { return random & 0xFFFFu; }
template <typename P, typename T, typename V>
LFSGD_ELEMENT void store_value(T* p, int64_t i, V v) {
  store(p, i, v);
}
template <typename P, typename T, typename V>
LFSGD_ELEMENT V load_value(const T* p, int64_t i, const V& /*like*/) {
  return static_cast<V>(load(p, i));
}

// Stores an update at i, an element (V: the opmath type) or a vector block of 16-bit params (V: FloatPair,
// vec_elements.h): the weight `wi` into the fp32 master and its rounding into the param, or rounded to nearest into
// the param and what that dropped into the Kahan compensation (`m`: the companion), or rounded stochastically with
// the element's random bits (`key`: rounding_key; bf16 params alone only), or rounded to nearest; and the aux
// stream's `ai` where it stores one (`stores_aux`), rounded the same way as the param.
template <Weight kWeight, typename P, typename A, typename M, typename V>
LFSGD_ELEMENT void store_update(P* w, A* aux, M* m, int64_t i, const V& wi, const V& ai, bool stores_aux,
                                bool stochastic, uint32_t key) {
  if constexpr (kWeight == Weight::kMaster) store_value<P>(m, i, wi);
  if constexpr (kWeight == Weight::kKahan) {
    const auto rounded = nearest_bf16(wi);
    store_bf16(w, i, rounded);
    store_value<P>(m, i, kahan_compensation(wi, bf16_value(rounded)));
    if (stores_aux) store_value<P>(aux, i, ai);
    return;
  }
  if constexpr (std::is_same_v<P, c10::BFloat16> && kWeight == Weight::kParam) {
    if (stochastic) {
      const auto random = random_bits(key, i, wi);
      store_bf16(w, i, stochastic_bf16(wi, high_half(random)));
      if (stores_aux) store_bf16(aux, i, stochastic_bf16(ai, low_half(random)));
      return;
    }
  }
  store_value<P>(w, i, wi);
  if (stores_aux) store_value<P>(aux, i, ai);
}

// Updates the average of the weights at i (an element or a block, as store_update) from the new weight `wi`.
template <typename P, typename E, typename V, typename S>
LFSGD_ELEMENT void store_average(E* e, int64_t i, const V& wi, const AverageCoeffs<S>& a) {
  store_value<P>(e, i, averaged(load_value<P>(e, i, wi), wi, a));
}

// load_weight for an element (V: the opmath type) or a block (V: FloatPair, vec_elements.h); `like` picks it.
template <Weight kWeight, typename P, typename M, typename V>
LFSGD_ELEMENT V load_weight_value(const P* w, const M* m, int64_t i, const V& /*like*/) {
  return load_weight<kWeight>(w, m, i);
}
template <typename V>
LFSGD_ELEMENT V zero_like(const V& /*like*/) {
  return V(0);
}

// One tensor's streams as the update reads and writes them, typed for its bucket (params of P, an aux stream of A,
// weights stored as kWeight): the param, its gradient, the aux stream (momentum buffer or z), the companion (master
// or compensation) and the average of the weights, each null where it has none.
template <typename P, typename A, Weight kWeight>
struct Streams {
  using O = typename OpMath<P>::type;
  P* w;
  const P* g;
  A* aux;
  Companion<kWeight>* m;
  O* e;

  // Calls f(stream, written) for each stream an update reads (`written`: std::integral_constant<int, 1> where it
  // writes it too), with an aux stream (kAux) and an average (kAverage) or without: the CPU loop asks for their
  // lines ahead.
  template <bool kAux, bool kAverage, typename F>
  void each(F&& f) const {
    using Read = std::integral_constant<int, 0>;
    using Written = std::integral_constant<int, 1>;
    f(w, Written{});
    f(g, Read{});
    if constexpr (kAux) f(aux, Written{});
    if constexpr (kWeight != Weight::kParam) f(m, Written{});
    if constexpr (kAverage) f(e, Written{});
  }
};

// A tensor's streams from its param, gradient and slots.
template <typename P, typename A, Weight kWeight>
LFSGD_HOST_DEVICE inline Streams<P, A, kWeight> streams_of(void* param, const void* grad, const SlotPointers& slots,
                                                           bool schedule_free) {
  using O = typename OpMath<P>::type;
  return {static_cast<P*>(param), static_cast<const P*>(grad), static_cast<A*>(slots.aux(schedule_free)),
          static_cast<Companion<kWeight>*>(slots.companion(kWeight)), static_cast<O*>(slots.of[kEma])};
}

// The operands at i (Operands, sgd_math.h; V: the opmath type for an element, FloatPair for a block; `like` picks
// it). `reads_aux`: the aux stream holds a value (it exists, and the kernel does not seed it this step), else it
// reads as 0.
template <typename P, typename A, Weight kWeight, typename V>
LFSGD_ELEMENT Operands<V> load_operands(const Streams<P, A, kWeight>& s, int64_t i, bool reads_aux, const V& like) {
  return {load_weight_value<kWeight>(s.w, s.m, i, like), load_value<P>(s.g, i, like),
          reads_aux ? load_value<P>(s.aux, i, like) : zero_like(like)};
}

// The update of the operands at i (update_element) and its stores: the weight and the aux stream (`stores_aux`:
// there is one), rounded stochastically with `key` (`stochastic`) or to nearest (store_update), and where `average`, the
// average of the weights (store_average, with `a`).
template <bool kScheduleFree, bool kClipValue, typename P, typename A, Weight kWeight, typename V, typename S>
LFSGD_ELEMENT void update_at(const Streams<P, A, kWeight>& s, int64_t i, Operands<V>& o, const Coeffs<S>& c,
                             bool stores_aux, bool stochastic, uint32_t key, bool average, const AverageCoeffs<S>& a) {
  update_element<kScheduleFree, kClipValue>(o, c);
  store_update<kWeight>(s.w, s.aux, s.m, i, o.w, o.aux, stores_aux, stochastic, key);
  if (average) store_average<P>(s.e, i, o.w, a);
}

}  // namespace lfsgd
