// One bucket's step on the CPU (CpuUpdate): each tensor's coefficients, then one OpenMP region over the work list
// (work_list.h) in waves, a wave's norms (cpu_sums.h: LARS tensors', and every tensor's gradient's where the step
// reports its gradient norm) before its update; and the update's loops, whose
// switches (a momentum buffer, the first step, Nesterov, the rounding, the average) are template constants, so
// that the compiler sees loops without branches and vectorizes them. The loops run in blocks (block_elems, which
// the schedule-free switch's loop takes too): of 16-bit params on ATen's vectors where the build has them
// (LFSGD_CPU_VECTORS, which fused_sgd.cpp sets; vec_elements.h), else a cache line. Part of fused_sgd.cpp's
// translation unit (its anonymous namespace), which alone includes it.
#pragma once

#include <ATen/ATen.h>

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "bucket.h"
#include "cpu_sums.h"
#include "elements.h"
#include "rounding.h"
#include "sgd_math.h"
#include "slots.h"
#include "work_list.h"
#ifdef LFSGD_CPU_VECTORS
#include "vec_elements.h"
#endif

namespace lfsgd {
namespace {

// Whether the build steps P (16-bit) params on ATen's vectors, and the loops' block: one such vector, else a cache
// line of params.
template <typename P>
constexpr bool kVectorBlocks =
#ifdef LFSGD_CPU_VECTORS
    !std::is_same_v<P, typename OpMath<P>::type>;
#else
    false;
#endif

template <typename P>
constexpr int64_t block_elems() {
#ifdef LFSGD_CPU_VECTORS
  if constexpr (kVectorBlocks<P>) return kBlockElems<P>;
#endif
  return 64 / static_cast<int64_t>(sizeof(P));
}

// One bucket's step on the CPU: each tensor's pointers and coefficients, the work list, and the partial sums
// that the norm pass writes and the update reads (LARS tensors') or the step reports (every grad_sq).
template <typename P, typename A, Weight kWeight>
class CpuUpdate {
 public:
  using O = typename OpMath<P>::type;
  using M = Companion<kWeight>;

  // `groups`: the bucket's, with the step's lrs; `clip`: the step's clip_grad_norm_ coefficient.
  CpuUpdate(const Bucket& bucket, const std::vector<GroupHParams>& groups, double inv_scale, double clip)
      : groups_(groups),
        tensor_group_(bucket.tensor_group),
        slots_(bucket.slots),
        reported_(bucket.row.unscaled_grad_sq_sum),
        clip_(clip),
        schedule_free_(bucket.schedule_free) {
    const at::TensorList params = bucket.params;
    const size_t n = params.size();
    const double* lars_sums = bucket.row.lars_sq_sums;
    w_ptr_.resize(n);
    g_ptr_.resize(n);
    average_.assign(n, AverageCoeffs<O>{});
    coeffs_.resize(n);
    lars_.resize(n);
    norms_.resize(n);
    for (size_t t = 0; t < n; ++t) {
      const GroupHParams& h = groups_[tensor_group_[t]];
      w_ptr_[t] = params[t].data_ptr<P>();
      g_ptr_[t] = bucket.grads[t].data_ptr<P>();
      if (averages(h)) {
        average_[t] = average_coeffs<O>(h, *slots_[t].count(kEmaStep), *slots_[t].count(kEmaUpdates));
      }
      coeffs_[t] = make_coeffs<O>(h, inv_scale, clip, bucket.first_step[t]);
      if (schedule_free_) apply_schedule_free(coeffs_[t], h, bucket.row.ckp1[tensor_group_[t]]);
      // Given sums (sharded params, reduced across shards) replace the norm pass: the ratio is set here.
      lars_[t] = lars_adapts(h) && lars_sums == nullptr;
      if (lars_adapts(h) && lars_sums != nullptr) {
        const double* row = lars_sums + kNumLarsSums * t;
        apply_lars(coeffs_[t], row[0], clipped_term_sq_sum(row[0], row[1], row[2], clip, h), h);
      }
      norms_[t] = lars_[t] || reported_ != nullptr;
    }
    work_ = make_work_list(params, norms_);
    sums_.resize(kNumLarsSums * work_.chunks.size());
  }

  // One parallel region over the waves: a wave's norms, then its update; then each stochastically rounded tensor
  // counts the step (after the region: every chunk of it read the count first), and the step's gradient norm is
  // reported where asked: the grad_sq sums of every chunk, added in a fixed order.
  void run() {
    update();
    if (reported_ != nullptr) {
      double total = 0;
      for (size_t c = 0; c < work_.chunks.size(); ++c) total += sums_[kNumLarsSums * c + kGradSq];
      *reported_ += total;
    }
    for (size_t t = 0; t < slots_.size(); ++t) {
      if (int64_t* count = slots_[t].count(kRoundingStep)) ++*count;
      if (int64_t* steps = slots_[t].count(kEmaStep)) {
        ++*steps;
        if (average_[t].update) ++*slots_[t].count(kEmaUpdates);
      }
    }
  }

 private:
  void update() {
#pragma omp parallel num_threads(num_threads_for(work_))
    {
      int32_t lars_tensor = -1;
      Coeffs<O> lars_c{};
      for (const Wave& wave : work_.waves) {
        if (wave.needs_norms) {
#pragma omp for schedule(static)
          for (int64_t c = wave.chunk_begin; c < wave.chunk_end; ++c) {
            if (norms_[work_.chunks[c].tensor]) norm_chunk(work_.chunks[c], c);
          }
        }
#pragma omp for schedule(static)
        for (int64_t c = wave.chunk_begin; c < wave.chunk_end; ++c) {
          update_chunk(work_.chunks[c], lars_tensor, lars_c);
        }
      }
    }
  }

  // A chunk's sums, taken before the norm clip (as lars_sq_sums takes them): a LARS tensor's, which lars_coeffs
  // applies, or another tensor's grad_sq alone, which run reports.
  void norm_chunk(const Chunk& chunk, int64_t c) {
    const int32_t t = chunk.tensor;
    Coeffs<O> unclipped = coeffs_[t];
    unclipped.clip_coef = O(1);
    if (lars_[t]) {
      chunk_lars_sums<kWeight>(w_ptr_[t], companion(t), g_ptr_[t], chunk, unclipped, groups_[tensor_group_[t]],
                                &sums_[kNumLarsSums * c]);
    } else {
      sums_[kNumLarsSums * c + kGradSq] = chunk_grad_sq_sum(g_ptr_[t], chunk, unclipped);
    }
  }

  // The coefficients of a LARS tensor: its chunks' sums added in a fixed order (the ratio does not depend on the
  // thread count), clipped (clipped_term_sq_sum), then apply_lars. Each thread computes them for the tensors its
  // chunks belong to (update_chunk keeps the last one), which saves a barrier per wave.
  Coeffs<O> lars_coeffs(int32_t t) const {
    double row[kNumLarsSums] = {0, 0, 0};
    for (int64_t c = work_.tensor_first_chunk[t]; c < work_.tensor_first_chunk[t + 1]; ++c) {
      for (int k = 0; k < kNumLarsSums; ++k) row[k] += sums_[kNumLarsSums * c + k];
    }
    const GroupHParams& h = groups_[tensor_group_[t]];
    Coeffs<O> c = coeffs_[t];
    apply_lars(c, row[0], clipped_term_sq_sum(row[0], row[1], row[2], clip_, h), h);
    return c;
  }

  // `lars_tensor` / `lars_c`: the calling thread's last computed LARS coefficients (static schedules give each
  // thread consecutive chunks, so a tensor's are computed about once per thread).
  void update_chunk(const Chunk& chunk, int32_t& lars_tensor, Coeffs<O>& lars_c) const {
    const int32_t t = chunk.tensor;
    if (lars_[t] && lars_tensor != t) {
      lars_c = lars_coeffs(t);
      lars_tensor = t;
    }
    const Coeffs<O>& c = lars_[t] ? lars_c : coeffs_[t];
    if (std::isfinite(c.clip_value)) {
      update_elements<true>(chunk, t, c);
    } else {
      update_elements<false>(chunk, t, c);
    }
  }

  // One chunk's elements. The switches of the momentum step (a momentum buffer at all, the first step) become
  // constants of the loop, so the compiler sees a loop without branches and vectorizes it. `c` by value: the loop's stores
  // could alias a referenced Coeffs, which stops vectorization too.
  // Rounding the update stochastically is a switch of bf16 buckets without masters only (the others round in
  // fp32 or fp64, or to fp16, which the plan refuses): the tensors with a rounding step (rounds_stochastically).
  static constexpr bool kMayRoundStochastically = std::is_same_v<P, c10::BFloat16> && kWeight == Weight::kParam;

  // So is an update of the average of the weights (a tensor whose average takes this step), and whether it is the
  // first (which copies the weight): a select on AverageCoeffs::copy in the loop stops its vectorization.
  enum class Averaging { kNone, kUpdate, kFirstUpdate };

  template <bool kClipValue>
  void update_elements(const Chunk& chunk, int32_t t, const Coeffs<O> c) const {
    if (!average_[t].update) return choose_rounding<kClipValue, Averaging::kNone>(chunk, t, c);
    if (average_[t].copy) return choose_rounding<kClipValue, Averaging::kFirstUpdate>(chunk, t, c);
    return choose_rounding<kClipValue, Averaging::kUpdate>(chunk, t, c);
  }

  template <bool kClipValue, Averaging kAverage>
  void choose_rounding(const Chunk& chunk, int32_t t, const Coeffs<O> c) const {
    if constexpr (kMayRoundStochastically) {
      if (slots_[t].count(kRoundingStep) != nullptr) return update_cases<kClipValue, true, kAverage>(chunk, t, c);
    }
    return update_cases<kClipValue, false, kAverage>(chunk, t, c);
  }

  // Nesterov is a constant of the loop too: GCC does not vectorize a select on a bool loaded from memory in the
  // bf16 loops.
  template <bool kClipValue, bool kStochastic, Averaging kAverage>
  void update_cases(const Chunk& chunk, int32_t t, const Coeffs<O> c) const {
    // Schedule-free: z is the aux stream, which the loop reads and writes beside the weight.
    if (schedule_free_) return update_loop<kClipValue, true, false, false, kStochastic, kAverage, true>(chunk, t, c);
    if (!c.has_momentum_buffer) {
      return update_loop<kClipValue, false, false, false, kStochastic, kAverage>(chunk, t, c);
    }
    if (c.nesterov) {
      return c.first ? update_loop<kClipValue, true, true, true, kStochastic, kAverage>(chunk, t, c)
                     : update_loop<kClipValue, true, false, true, kStochastic, kAverage>(chunk, t, c);
    }
    return c.first ? update_loop<kClipValue, true, true, false, kStochastic, kAverage>(chunk, t, c)
                   : update_loop<kClipValue, true, false, false, kStochastic, kAverage>(chunk, t, c);
  }

  // kAux: the loop reads and writes an aux stream, SGD's momentum buffer (Coeffs::has_momentum_buffer) or, stepping
  // schedule-free, z. A template constant: derived in a constexpr local that the lambda below reads, it cost the
  // vectorizer 24 of its loops.
  template <bool kClipValue, bool kAux, bool kFirst, bool kNesterov, bool kStochastic, Averaging kAverage,
            bool kScheduleFree = false>
  void update_loop(const Chunk& chunk, int32_t t, Coeffs<O> c) const {
    c.has_momentum_buffer = kAux && !kScheduleFree;
    c.first = kFirst;
    c.nesterov = kNesterov;
    const Streams<P, A, kWeight> s = streams_of<P, A, kWeight>(w_ptr_[t], g_ptr_[t], slots_[t], schedule_free_);
    AverageCoeffs<O> a = average_[t];
    a.copy = kAverage == Averaging::kFirstUpdate;
    constexpr bool kAverages = kAverage != Averaging::kNone;
    const GroupHParams& h = groups_[tensor_group_[t]];
    const uint32_t key = kStochastic ? rounding_key(h.rounding_seed, *slots_[t].count(kRoundingStep), t) : 0;
    // An element (V: O) or a block of 16-bit params on ATen's vectors (V: FloatPair, vec_elements.h), which the
    // compiler vectorizes neither for c10::Half's conversions nor for the bf16 roundings' selects.
    const auto update = [&](int64_t i, const auto& like) __attribute__((always_inline)) {
      auto operands = load_operands(s, i, kAux && !kFirst, like);
      update_at<kScheduleFree, kClipValue>(s, i, operands, c, kAux, kStochastic, key, kAverages, a);
    };
    // Blocks, each asking for the lines of the block kPrefetchElems ahead in every stream, then the tail element
    // by element.
    constexpr int64_t kBlock = block_elems<P>();
    static_assert(kChunkElems % kBlock == 0, "a chunk holds whole blocks");
    const int64_t end = chunk.end;
    int64_t begin = chunk.begin;
    for (; begin + kBlock <= end; begin += kBlock) {
      s.template each<kAux, kAverages>(
          [&](const auto* stream, auto written) { prefetch_ahead<decltype(written)::value>(stream, begin, kBlock); });
#ifdef LFSGD_CPU_VECTORS
      if constexpr (kVectorBlocks<P>) {
        update(begin, FloatPair{});
        continue;
      }
#endif
#pragma omp simd
      for (int64_t i = begin; i < begin + kBlock; ++i) update(i, O{});
    }
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) update(i, O{});
  }

  M* companion(int32_t t) const { return static_cast<M*>(slots_[t].companion(kWeight)); }

  const std::vector<GroupHParams>& groups_;
  at::IntArrayRef tensor_group_;
  const std::vector<SlotPointers>& slots_;  // the bucket's, by tensor
  std::vector<P*> w_ptr_;
  std::vector<const P*> g_ptr_;
  std::vector<AverageCoeffs<O>> average_;  // this step's, per tensor (no update where it has no average)
  std::vector<Coeffs<O>> coeffs_;
  std::vector<bool> lars_;   // the ratio from this step's norm pass
  std::vector<bool> norms_;  // sums taken in the norm pass: LARS tensors', every tensor's where the step reports
  double* reported_;         // the step row's unscaled_grad_sq_sum, or null
  double clip_;  // the step's clip_grad_norm_ coefficient, 1 where it does not clip by norm
  bool schedule_free_;
  WorkList work_;
  std::vector<double> sums_;  // kNumLarsSums per chunk (0 where the norm pass takes none)
};

}  // namespace
}  // namespace lfsgd
