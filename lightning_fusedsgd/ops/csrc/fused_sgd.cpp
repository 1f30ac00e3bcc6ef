// The CPU kernels of the lightning_fusedsgd ops: multi-tensor SGD/LARS over one (device, dtype)
// bucket per call, a work list of fixed-size chunks across all tensors (work_list.h), and one OpenMP parallel
// region over it. The math lives in sgd_math.h, the argument checks in bucket.h.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

// The AVX2 and AVX-512 builds step 16-bit params on ATen's vectors (vec_elements.h).
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#define LFSGD_CPU_VECTORS
#endif

#include "bucket.h"
#include "elements.h"
#include "plan_arguments.h"
#include "schedule.h"
#include "schedule_free.h"
#include "sgd_math.h"
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

// fp32 sums are exact enough where they are normal numbers; squares of values below about 1e-19 underflow
// and above about 1e19 overflow. A chunk whose sums leave that range (zero, tiny, inf, NaN) is summed again in
// double, as torch's CPU norm sums fp32, so the whole float range works at the cost of fp32 sums everywhere
// else.
inline bool exact_in_opmath(double sum) {
  constexpr double kMinExact = 1e-30;  // far above 16K subnormal squares (16384 x 1.2e-38)
  return sum >= kMinExact && sum <= 1e38;
}

// A chunk's LARS sums: of w^2, of the LARS term (lars_norm_term) squared and of w times it, accumulated in S (the
// opmath type, or double where the sums leave exact_in_opmath's range).
template <typename S, bool kDecayed, bool kClipValue, Weight kWeight, typename P, typename M, typename O>
void lars_partial_sums(const P* w, const M* m, const P* gr, const Chunk& chunk, const Coeffs<O>& c,
                       O weight_decay, double* sums) {
  S sw = 0, st = 0, swt = 0;
#pragma omp simd reduction(+ : sw, st, swt)
  for (int64_t i = chunk.begin; i < chunk.end; ++i) {
    const O wi = load_weight<kWeight>(w, m, i);
    const S ti = lars_norm_term<kClipValue, O>(wi, load(gr, i), c, weight_decay, kDecayed);
    sw += static_cast<S>(wi) * wi;
    st += ti * ti;
    swt += static_cast<S>(wi) * ti;
  }
  sums[0] = sw;
  sums[1] = st;
  sums[2] = swt;
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
  if (!exact_in_opmath(sums[0]) || !exact_in_opmath(sums[1])) sum(double{});
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

// One bucket's step on the CPU: each tensor's pointers and coefficients, the work list, and the LARS partial
// sums that the norm pass writes and the update reads.
template <typename P, typename B, Weight kWeight>
class CpuUpdate {
 public:
  using O = typename OpMath<P>::type;
  using M = Companion<kWeight>;

  // `groups`: the bucket's, with the step's lrs; `clip`: the step's clip_grad_norm_ coefficient.
  CpuUpdate(const Bucket& bucket, const std::vector<GroupHParams>& groups, double inv_scale, double clip)
      : groups_(groups),
        tensor_group_(bucket.tensor_group),
        slots_(bucket.slots),
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
    }
    work_ = make_work_list(params, lars_);
    sums_.resize(kNumLarsSums * work_.chunks.size());
  }

  // One parallel region over the waves: a wave's LARS norms, then its update; then each stochastically
  // rounded tensor counts the step (after the region: every chunk of it read the count first).
  void run() {
    update();
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
            if (lars_[work_.chunks[c].tensor]) norm_chunk(work_.chunks[c], c);
          }
        }
#pragma omp for schedule(static)
        for (int64_t c = wave.chunk_begin; c < wave.chunk_end; ++c) {
          update_chunk(work_.chunks[c], lars_tensor, lars_c);
        }
      }
    }
  }

  // A chunk's LARS sums, taken before the norm clip (as lars_sq_sums takes them), which lars_coeffs applies.
  void norm_chunk(const Chunk& chunk, int64_t c) {
    const int32_t t = chunk.tensor;
    Coeffs<O> unclipped = coeffs_[t];
    unclipped.clip_coef = O(1);
    chunk_lars_sums<kWeight>(w_ptr_[t], companion(t), g_ptr_[t], chunk, unclipped, groups_[tensor_group_[t]],
                              &sums_[kNumLarsSums * c]);
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

  // One chunk's elements. The switches of the momentum step (a buffer at all, the first step) become constants
  // of the loop, so the compiler sees a loop without branches and vectorizes it. `c` by value: the loop's stores
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
    // Schedule-free: z is the buffer the loop reads and writes beside the weight (Bucket::buffer).
    if (schedule_free_) return update_loop<kClipValue, true, false, false, kStochastic, kAverage, true>(chunk, t, c);
    if (!c.has_momentum) return update_loop<kClipValue, false, false, false, kStochastic, kAverage>(chunk, t, c);
    if (c.nesterov) {
      return c.first ? update_loop<kClipValue, true, true, true, kStochastic, kAverage>(chunk, t, c)
                     : update_loop<kClipValue, true, false, true, kStochastic, kAverage>(chunk, t, c);
    }
    return c.first ? update_loop<kClipValue, true, true, false, kStochastic, kAverage>(chunk, t, c)
                   : update_loop<kClipValue, true, false, false, kStochastic, kAverage>(chunk, t, c);
  }

  template <bool kClipValue, bool kMomentum, bool kFirst, bool kNesterov, bool kStochastic, Averaging kAverage,
            bool kScheduleFree = false>
  void update_loop(const Chunk& chunk, int32_t t, Coeffs<O> c) const {
    c.has_momentum = kMomentum;
    c.first = kFirst;
    c.nesterov = kNesterov;
    const Streams<P, B, kWeight> s = streams_of<P, B, kWeight>(w_ptr_[t], g_ptr_[t], slots_[t], schedule_free_);
    AverageCoeffs<O> a = average_[t];
    a.copy = kAverage == Averaging::kFirstUpdate;
    constexpr bool kAverages = kAverage != Averaging::kNone;
    const GroupHParams& h = groups_[tensor_group_[t]];
    const uint32_t key = kStochastic ? rounding_key(h.rounding_seed, *slots_[t].count(kRoundingStep), t) : 0;
    // An element (V: O) or a block of 16-bit params on ATen's vectors (V: FloatPair, vec_elements.h), which the
    // compiler vectorizes neither for c10::Half's conversions nor for the bf16 roundings' selects.
    const auto update = [&](int64_t i, const auto& like) __attribute__((always_inline)) {
      auto operands = load_operands(s, i, kMomentum && !kFirst, like);
      update_at<kScheduleFree, kClipValue>(s, i, operands, c, kMomentum, kStochastic, key, kAverages, a);
    };
    // Blocks, each asking for the lines of the block kPrefetchElems ahead in every stream, then the tail element
    // by element.
    constexpr int64_t kBlock = block_elems<P>();
    static_assert(kChunkElems % kBlock == 0, "a chunk holds whole blocks");
    const int64_t end = chunk.end;
    int64_t begin = chunk.begin;
    for (; begin + kBlock <= end; begin += kBlock) {
      s.template each<kMomentum, kAverages>(
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
  std::vector<bool> lars_;
  double clip_;  // the step's clip_grad_norm_ coefficient, 1 where it does not clip by norm
  bool schedule_free_;
  WorkList work_;
  std::vector<double> sums_;  // kNumLarsSums per chunk of a LARS tensor
};

// The CPU kernel of lightning_fusedsgd::sgd_step (the op: sgd_step_op in bucket.h). The step row is read on the
// host, which costs nothing for CPU tensors.
void run_cpu(const Bucket& bucket) {
  const StepRow& row = bucket.row;
  if (bucket.params.empty() || (row.found_inf != nullptr && *row.found_inf != 0.0f)) return;
  std::vector<GroupHParams> groups = bucket.groups;
  if (row.lrs != nullptr) {
    for (size_t g = 0; g < groups.size(); ++g) groups[g].lr = row.lrs[g];
  }
  const double inv_scale = row_inverse_scale(row);
  const double clip = row_clip(row, inv_scale);
  dispatch_bucket_types(bucket.params[0].scalar_type(), bucket.weight, [&](auto param, auto buffer, auto weight) {
    CpuUpdate<decltype(param), decltype(buffer), decltype(weight)::value>(bucket, groups, inv_scale, clip).run();
  });
}

// lightning_fusedsgd::lars_sq_sums for CPU tensors (the op: lars_sq_sums_op in bucket.h): each LARS tensor's row
// of sums (kNumLarsSums in sgd_math.h) before norm clipping, zeros for the others, each summed over its chunks in
// a fixed order.
at::Tensor lars_sq_sums_cpu(const Bucket& bucket) {
  const at::TensorList params = bucket.params;
  const std::vector<GroupHParams>& groups = bucket.groups;
  const int64_t n = static_cast<int64_t>(params.size());
  at::Tensor out = at::zeros({n, kNumLarsSums}, at::TensorOptions().dtype(at::kDouble));
  if (n == 0) return out;
  const WorkList work = make_work_list(params, std::vector<bool>(n, false));
  std::vector<double> partials(kNumLarsSums * work.chunks.size(), 0.0);
  const double inv_scale = row_inverse_scale(bucket.row);
  dispatch_bucket_types(params[0].scalar_type(), bucket.weight, [&](auto param, auto, auto weight) {
    using P = decltype(param);
    using O = typename OpMath<P>::type;
    constexpr Weight kWeight = decltype(weight)::value;
    using M = Companion<kWeight>;
#pragma omp parallel for schedule(static) num_threads(num_threads_for(work))
    for (int64_t c = 0; c < static_cast<int64_t>(work.chunks.size()); ++c) {
      const Chunk& chunk = work.chunks[c];
      const int32_t t = chunk.tensor;
      const GroupHParams& h = groups[bucket.tensor_group[t]];
      if (!lars_adapts(h)) continue;
      const Coeffs<O> coeffs = make_coeffs<O>(h, inv_scale, /*clip=*/1.0, false);  // sums taken before the clip
      chunk_lars_sums<kWeight>(params[t].data_ptr<P>(), static_cast<const M*>(bucket.companion(t)),
                               bucket.grads[t].data_ptr<P>(), chunk, coeffs, h, &partials[kNumLarsSums * c]);
    }
  });
  double* rows = out.data_ptr<double>();
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t c = work.tensor_first_chunk[t]; c < work.tensor_first_chunk[t + 1]; ++c) {
      for (int k = 0; k < kNumLarsSums; ++k) rows[kNumLarsSums * t + k] += partials[kNumLarsSums * c + k];
    }
  }
  return out;
}

// lightning_fusedsgd::grad_sq_sum for CPU tensors: the sum of squares of every gradient, in a fixed order.
at::Tensor grad_sq_sum_cpu(at::TensorList grads) {
  check_grads(grads);
  const WorkList work = make_work_list(grads, std::vector<bool>(grads.size(), false));
  std::vector<double> partials(work.chunks.size());
  if (!grads.empty()) {
    dispatch_bucket_types(grads[0].scalar_type(), Weight::kParam, [&](auto grad, auto, auto) {
      using P = decltype(grad);
      using O = typename OpMath<P>::type;
#pragma omp parallel for schedule(static) num_threads(num_threads_for(work))
      for (int64_t c = 0; c < static_cast<int64_t>(work.chunks.size()); ++c) {
        const Chunk& chunk = work.chunks[c];
        const P* g = grads[chunk.tensor].data_ptr<P>();
        partials[c] = grad_sum_squares<O>(g, chunk);
        if (!exact_in_opmath(partials[c])) partials[c] = grad_sum_squares<double>(g, chunk);
      }
    });
  }
  double total = 0;
  for (double partial : partials) total += partial;
  return at::scalar_tensor(total, at::TensorOptions().dtype(at::kDouble));
}

// lightning_fusedsgd::schedule_lrs for CPU tensors (schedule_step in schedule.h).
void schedule_lrs_cpu(const at::Tensor& lrs, const at::Tensor& position, const at::Tensor& schedule,
                      const at::Tensor& peaks, const std::optional<at::Tensor>& applied, bool advance) {
  check_schedule_inputs(lrs, position, schedule, peaks, applied);
  schedule_step(lrs.data_ptr<double>(), position.data_ptr<int64_t>(), schedule.data_ptr<double>(), schedule.numel(),
                peaks.data_ptr<double>(), lrs.numel(), applied.has_value() ? applied->data_ptr<bool>() : nullptr,
                advance);
}

// lightning_fusedsgd::schedule_free_scalars for CPU tensors (the op: schedule_free_scalars_op in bucket.h): each
// group's scalars advanced (advance_schedule_free), unless the step was skipped.
void schedule_free_scalars_cpu(const at::Tensor& scalars, const std::vector<GroupHParams>& groups, const StepRow& row) {
  if (row.found_inf != nullptr && *row.found_inf != 0.0f) return;
  const int64_t n = static_cast<int64_t>(groups.size());
  for (int64_t g = 0; g < n; ++g) {
    advance_schedule_free(scalars.data_ptr<double>(), n, g, row.lrs != nullptr ? row.lrs[g] : groups[g].lr, groups[g]);
  }
}

// lightning_fusedsgd::schedule_free_switch for CPU tensors (the op: schedule_free_switch_op in bucket.h): each
// weight moved on its line through z (switch_weight), one pass reading weight and z and writing the weight.
void schedule_free_switch_cpu(const Bucket& bucket, bool train) {
  const at::TensorList params = bucket.params;
  if (params.empty()) return;
  const WorkList work = make_work_list(params, std::vector<bool>(params.size(), false));
  dispatch_bucket_types(params[0].scalar_type(), bucket.weight, [&](auto param, auto buffer, auto weight) {
    using P = decltype(param);
    using B = decltype(buffer);
    using O = typename OpMath<P>::type;
    constexpr Weight kWeight = decltype(weight)::value;
    using M = Companion<kWeight>;
    // As the update loop: blocks (a vector of 16-bit params where the build has vectors, else a cache line of
    // params), each asking for its streams' lines kPrefetchElems ahead, then the tail element by element.
    constexpr int64_t kBlock = block_elems<P>();
#pragma omp parallel for schedule(static) num_threads(num_threads_for(work))
    for (int64_t c = 0; c < static_cast<int64_t>(work.chunks.size()); ++c) {
      const Chunk& chunk = work.chunks[c];
      const int32_t t = chunk.tensor;
      P* w = params[t].data_ptr<P>();
      const B* z = static_cast<const B*>(bucket.buffer(t));
      M* m = static_cast<M*>(bucket.companion(t));
      const O to = static_cast<O>(switch_weight(bucket.groups[bucket.tensor_group[t]], train));
      const auto element = [&](int64_t e) __attribute__((always_inline)) {
        const O wi = lerp(load_weight<kWeight>(w, m, e), static_cast<O>(load(z, e)), to);
        store_update<kWeight>(w, static_cast<B*>(nullptr), m, e, wi, wi, false, false, 0);
      };
      int64_t i = chunk.begin;
      for (; i + kBlock <= chunk.end; i += kBlock) {
        prefetch_ahead<1>(w, i, kBlock);
        prefetch_ahead<0>(z, i, kBlock);
        if constexpr (kWeight != Weight::kParam) prefetch_ahead<1>(m, i, kBlock);
#ifdef LFSGD_CPU_VECTORS
        if constexpr (kVectorBlocks<P>) {
          FloatPair wi = load_weight_block<kWeight>(w, m, i);
          const FloatPair zi = load_block<P>(z, i);
          wi = {lerp(wi.low, zi.low, to), lerp(wi.high, zi.high, to)};
          store_update<kWeight>(w, static_cast<B*>(nullptr), m, i, wi, wi, false, false, 0);
          continue;
        }
#endif
#pragma omp simd
        for (int64_t e = i; e < i + kBlock; ++e) element(e);
      }
#pragma omp simd
      for (int64_t e = i; e < chunk.end; ++e) element(e);
    }
  });
}

// The kernels' order of each table they read (_abi.KERNEL_TABLES, compared when the library loads).
template <size_t N>
std::vector<std::string> names(const char* const (&table)[N]) {
  return {std::begin(table), std::end(table)};
}

std::vector<std::string> slot_seed_names() {
  std::vector<std::string> seeds;
  for (Seed seed : kSlotSeeds) seeds.emplace_back(kSeedNames[static_cast<int>(seed)]);
  return seeds;
}

// LFSGD_SLOTS' held and dtype rules for `dtype` params of each group (a row of `group_hparams`, with its
// `master_weights`), slot after slot: whether it is held, and an empty tensor of its dtype. Loading the library
// compares them with _abi.SLOTS' over every combination of the plan options.
std::tuple<c10::List<bool>, std::vector<at::Tensor>> slot_rules_of(const at::Tensor& group_hparams,
                                                                    at::ScalarType dtype,
                                                                    const c10::List<bool>& master_weights) {
  const std::vector<GroupHParams> groups = decode_table(group_hparams, "slot_rules");
  TORCH_CHECK(master_weights.size() == groups.size(), "lightning_fusedsgd::slot_rules: one master_weights per group");
  c10::List<bool> held;
  std::vector<at::Tensor> dtypes;
  for (size_t g = 0; g < groups.size(); ++g) {
    const SlotRules rules = slot_rules(SlotFacts{dtype, master_weights.get(g), groups[g]});
    for (int s = 0; s < kNumSlots; ++s) {
      held.push_back(rules.held[s]);
      dtypes.push_back(at::empty({0}, at::TensorOptions().dtype(rules.dtype[s])));
    }
  }
  return {held, dtypes};
}

}  // namespace
}  // namespace lfsgd

// The ops are defined with their schemas in lightning_fusedsgd/ops/__init__.py; this library adds the CPU kernels,
// the ABI checks the loader compares with _abi.py, and the PlanArguments class. The CUDA library
// (fused_sgd_cuda.cu) adds the CUDA kernels.
TORCH_LIBRARY_FRAGMENT(lightning_fusedsgd, m) {
  m.def("hparam_names() -> str[]", [] { return lfsgd::names(lfsgd::kHParamNames); });
  m.def("slot_names() -> str[]", [] { return lfsgd::names(lfsgd::kSlotNames); });
  m.def("slot_seeds() -> str[]", &lfsgd::slot_seed_names);
  m.def("slot_rules(Tensor group_hparams, ScalarType dtype, bool[] master_weights) -> (bool[], Tensor[])",
        &lfsgd::slot_rules_of);
  m.def("step_row_names() -> str[]", [] { return lfsgd::names(lfsgd::kStepRowNames); });
  m.def("decay_names() -> str[]", [] { return lfsgd::names(lfsgd::kDecayNames); });
  m.def("update_rounding_names() -> str[]", [] { return lfsgd::names(lfsgd::kUpdateRoundingNames); });
  m.def("lars_denominator_names() -> str[]", [] { return lfsgd::names(lfsgd::kLarsDenominatorNames); });
  m.def("lars_zero_norm_names() -> str[]", [] { return lfsgd::names(lfsgd::kLarsZeroNormNames); });
  m.def("schedule_header_names() -> str[]", [] { return lfsgd::names(lfsgd::kScheduleHeaderNames); });
  m.def("lars_sum_names() -> str[]", [] { return lfsgd::names(lfsgd::kLarsSumNames); });
  m.def("schedule_free_scalar_names() -> str[]", [] { return lfsgd::names(lfsgd::kScheduleFreeScalarNames); });
  lfsgd::register_plan_arguments(m);
}

TORCH_LIBRARY_IMPL(lightning_fusedsgd, CPU, m) {
  m.impl("sgd_step", &lfsgd::sgd_step_op<lfsgd::run_cpu>);
  m.impl("grad_sq_sum", &lfsgd::grad_sq_sum_cpu);
  m.impl("lars_sq_sums", &lfsgd::lars_sq_sums_op<lfsgd::lars_sq_sums_cpu>);
  m.impl("schedule_lrs", &lfsgd::schedule_lrs_cpu);
  m.impl("schedule_free_scalars", &lfsgd::schedule_free_scalars_op<lfsgd::schedule_free_scalars_cpu>);
  m.impl("schedule_free_switch", &lfsgd::schedule_free_switch_op<lfsgd::schedule_free_switch_cpu>);
}
