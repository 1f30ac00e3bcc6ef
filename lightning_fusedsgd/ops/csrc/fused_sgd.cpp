// The CPU library of lightning_fusedsgd: the ops' CPU kernels (defined in lightning_fusedsgd/ops/__init__.py), each
// over one (device, dtype) bucket per call and a work list of fixed-size chunks across all tensors (work_list.h)
// in one OpenMP parallel region; the tables the loader compares with _abi.py; and the PlanArguments class. The
// update is CpuUpdate (cpu_update.h), the sums of squares are in cpu_sums.h, the math in sgd_math.h and the
// argument checks in bucket.h.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <omp.h>

#include <iterator>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

// The AVX2 and AVX-512 builds step 16-bit params on ATen's vectors (vec_elements.h).
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#define LFSGD_CPU_VECTORS
#endif

#include "bucket.h"
#include "cpu_sums.h"
#include "cpu_update.h"
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
  dispatch_bucket_types(bucket.params[0].scalar_type(), bucket.weight, [&](auto param, auto aux, auto weight) {
    CpuUpdate<decltype(param), decltype(aux), decltype(weight)::value>(bucket, groups, inv_scale, clip).run();
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
  dispatch_bucket_types(params[0].scalar_type(), bucket.weight, [&](auto param, auto aux, auto weight) {
    using P = decltype(param);
    using A = decltype(aux);
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
      const A* z = static_cast<const A*>(bucket.aux(t));  // a schedule-free tensor's aux stream
      M* m = static_cast<M*>(bucket.companion(t));
      const O to = static_cast<O>(switch_weight(bucket.groups[bucket.tensor_group[t]], train));
      const auto element = [&](int64_t e) __attribute__((always_inline)) {
        const O wi = lerp(load_weight<kWeight>(w, m, e), static_cast<O>(load(z, e)), to);
        store_update<kWeight>(w, static_cast<A*>(nullptr), m, e, wi, wi, false, false, 0);
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
          store_update<kWeight>(w, static_cast<A*>(nullptr), m, i, wi, wi, false, false, 0);
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
