// The CPU kernel's sums of squares, over one chunk of the work list (work_list.h): the gradients' for the global
// norm (grad_sum_squares), a LARS tensor's (chunk_lars_sums: of its weights, of its norm term, of their product and
// of its gradient) and another tensor's gradient's where a step reports its norm (chunk_grad_sq_sum), in the opmath type (fp32 but for fp64 params) at the update's vector width, and again in double where a
// chunk's sums leave its exact range. Part of fused_sgd.cpp's translation unit (its anonymous namespace), which
// alone includes it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "elements.h"
#include "sgd_math.h"
#include "slots.h"
#include "work_list.h"

namespace lfsgd {
namespace {

// fp32 sums are exact enough where they are normal numbers; squares of values below about 1e-19 underflow
// and above about 1e19 overflow. A chunk whose sums leave that range (zero, tiny, inf, NaN) is summed again in
// double, as torch's CPU norm sums fp32, so the whole float range works at the cost of fp32 sums everywhere
// else.
inline bool exact_in_opmath(double sum) {
  constexpr double kMinExact = 1e-30;  // far above 16K subnormal squares (16384 x 1.2e-38)
  return sum >= kMinExact && sum <= 1e38;
}

// A chunk's LARS sums: of w^2, of the LARS term (lars_norm_term) squared, of w times it and of the gradient
// (clipped_grad) squared, accumulated in S (the opmath type, or double where the sums leave exact_in_opmath's
// range). The default denominator's term is that gradient: its sum of squares is the term's, from the same adds.
template <typename S, bool kDecayed, bool kClipValue, Weight kWeight, typename P, typename M, typename O>
void lars_partial_sums(const P* w, const M* m, const P* gr, const Chunk& chunk, const Coeffs<O>& c,
                       O weight_decay, double* sums) {
  S sw = 0, st = 0, swt = 0, sg = 0;
#pragma omp simd reduction(+ : sw, st, swt, sg)
  for (int64_t i = chunk.begin; i < chunk.end; ++i) {
    const O wi = load_weight<kWeight>(w, m, i);
    const O gi = load(gr, i);
    const S ti = lars_norm_term<kClipValue, O>(wi, gi, c, weight_decay, kDecayed);
    sw += static_cast<S>(wi) * wi;
    st += ti * ti;
    swt += static_cast<S>(wi) * ti;
    if constexpr (kDecayed) {
      const S raw = clipped_grad<kClipValue, O>(gi, c);
      sg += raw * raw;
    }
  }
  sums[0] = sw;
  sums[1] = st;
  sums[2] = swt;
  sums[kGradSq] = kDecayed ? static_cast<double>(sg) : sums[1];
}

// A chunk's sum of squares of the gradient as clipped_grad leaves it (unscaled, sign-corrected, clipped by value),
// accumulated in S: the grad_sq sum of a tensor without LARS, which a step reporting its gradient norm takes in
// its norm pass.
template <typename S, bool kClipValue, typename P, typename O>
double clipped_grad_sq_sum(const P* gr, const Chunk& chunk, const Coeffs<O>& c) {
  S sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = chunk.begin; i < chunk.end; ++i) {
    const S gi = clipped_grad<kClipValue, O>(static_cast<O>(load(gr, i)), c);
    sum += gi * gi;
  }
  return sum;
}

// A chunk's LARS sums (lars_partial_sums) with coefficients `c` taken before the norm clip: in the opmath type,
// and again in double where they leave its exact range (in range, |sum w t| <= sqrt(sum w^2 sum t^2) is too, by
// Cauchy-Schwarz). The norm pass of the update and the lars_sq_sums op both take them. The CUDA kernel sums in
// double throughout (lars_sums_kernel): two strategies on purpose. Here the norm pass runs between a wave's loads
// and its update, from cache, at the update's vector width, which double accumulators would halve; on a GPU the
// pass is memory-bound and double costs nothing. Both give the trust ratio to well within fp32's rounding.
template <Weight kWeight, typename P, typename M, typename O>
void chunk_lars_sums(const P* w, const M* m, const P* gr, const Chunk& chunk, const Coeffs<O>& c,
                     const GroupHParams& h, double* sums) {
  const bool clip_value = std::isfinite(c.clip_value);
  const auto sum = [&](auto accumulator) {
    using S = decltype(accumulator);
    const auto run = decayed_grad(h) ? (clip_value ? lars_partial_sums<S, true, true, kWeight, P, M, O>
                                                   : lars_partial_sums<S, true, false, kWeight, P, M, O>)
                                     : (clip_value ? lars_partial_sums<S, false, true, kWeight, P, M, O>
                                                   : lars_partial_sums<S, false, false, kWeight, P, M, O>);
    run(w, m, gr, chunk, c, static_cast<O>(h.weight_decay), sums);
  };
  sum(O{});
  if (!exact_in_opmath(sums[0]) || !exact_in_opmath(sums[1])) {
    sum(double{});
  } else if (!exact_in_opmath(sums[kGradSq])) {  // "decayed_grad": the gradient alone again, the ratio's sums kept
    double ratio_sums[kNumLarsSums];
    std::copy(sums, sums + kNumLarsSums, ratio_sums);
    sum(double{});
    std::copy(ratio_sums, ratio_sums + kGradSq, sums);
  }
}

// A chunk's grad_sq sum of a tensor without LARS (clipped_grad_sq_sum) with coefficients `c` taken before the norm
// clip: in the opmath type, and again in double where it leaves that type's exact range.
template <typename P, typename O>
double chunk_grad_sq_sum(const P* gr, const Chunk& chunk, const Coeffs<O>& c) {
  const bool clip_value = std::isfinite(c.clip_value);
  const auto sum = [&](auto accumulator) {
    using S = decltype(accumulator);
    return clip_value ? clipped_grad_sq_sum<S, true>(gr, chunk, c) : clipped_grad_sq_sum<S, false>(gr, chunk, c);
  };
  const double opmath = sum(O{});
  return exact_in_opmath(opmath) ? opmath : sum(double{});
}

// A chunk's sum of squares of the raw gradient (the global norm that clipping takes), in S. kLanes partial
// sums keep several vector adds in flight: one accumulator would make the pass add-latency bound (half the
// memory bandwidth here). The order is fixed, so the sum does not depend on the thread count.
template <typename S, typename P>
double grad_sum_squares(const P* gr, const Chunk& chunk) {
  constexpr int64_t kLanes = 64;
  S lanes[kLanes] = {};
  int64_t i = chunk.begin;
  for (; i + kLanes <= chunk.end; i += kLanes) {
#pragma omp simd
    for (int64_t k = 0; k < kLanes; ++k) {
      const S gi = load(gr, i + k);
      lanes[k] += gi * gi;
    }
  }
  S sum = 0;
  for (; i < chunk.end; ++i) {
    const S gi = load(gr, i);
    sum += gi * gi;
  }
  for (int64_t k = 0; k < kLanes; ++k) sum += lanes[k];
  return sum;
}

}  // namespace
}  // namespace lfsgd
