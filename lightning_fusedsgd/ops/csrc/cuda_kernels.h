// The CUDA kernels of the lightning_fusedsgd ops: the update, a block per chunk of the work list (update_kernel, SGD's
// or schedule-free SGD's by a template constant), and its counts (advance_counts_kernel); the sums of squares of
// grad_sq_sum (a block per chunk) and of lars_sq_sums (each chunk's sums, then a block per tensor for its row); the
// schedule-free switch and scalars; and the lr schedule. The math lives in sgd_math.h, schedule.h and
// schedule_free.h, the element loads and stores in elements.h; the arguments arrive as cuda_launch.h lays them out.
// The grad scale, found_inf, the LARS rows, the counts and (capturable steps) the lrs are read here, on the device.
// Part of fused_sgd_cuda.cu's translation unit (its anonymous namespace), which alone includes it.
#pragma once

#include <cstdint>

#include "bucket.h"
#include "elements.h"
#include "rounding.h"
#include "schedule.h"
#include "schedule_free.h"
#include "sgd_math.h"
#include "slots.h"
// Last: they include device.h, whose emulation spells CUDA's keywords as macros.
#include "cuda_launch.h"
#include "device.h"

namespace lfsgd {
namespace {

__device__ inline double inverse_scale_of(const float* grad_scale) {
  return grad_scale == nullptr ? 1.0 : inverse_scale(*grad_scale);
}

__device__ inline bool skipped(const float* found_inf) { return found_inf != nullptr && *found_inf != 0.0f; }

// A group's hyperparameters, with its lr from the step row where the step has lrs.
__device__ inline GroupHParams group_of(const GroupHParams* groups, int64_t group, const StepRow& row) {
  GroupHParams h = groups[group];
  if (row.lrs != nullptr) h.lr = row.lrs[group];
  return h;
}

// Block-wide sum in a fixed order (warp shuffles, then warp 0 over the warps), so results do not vary
// from run to run. The total is returned to thread 0.
__device__ inline double block_sum(double value, double* scratch) {
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_down_sync(0xffffffffu, value, offset);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  value = threadIdx.x < kThreads / 32 ? scratch[threadIdx.x] : 0.0;
  if (warp == 0) {
    for (int offset = 16; offset > 0; offset /= 2) value += __shfl_down_sync(0xffffffffu, value, offset);
  }
  __syncthreads();  // scratch is reused by the next call
  return value;
}

// lars_sq_sums, pass 1: each chunk of a LARS tensor writes its sums of w^2, t^2, w t (lars_norm_term before the
// norm clip, sgd_math.h) and g^2 (clipped_grad before the norm clip: t itself for the default denominator), in
// double; with `grads_too` (a step reporting its gradient norm), each chunk of another tensor its g^2 alone; other
// chunks leave their zeros. The CPU kernel sums a chunk in fp32 and falls back to double out of fp32's exact range
// (chunk_lars_sums in cpu_sums.h: its pass runs from cache at the vector width); here the pass is memory-bound,
// and double costs nothing.
template <typename P, Weight kWeight>
__global__ void __launch_bounds__(kThreads)
    lars_sums_kernel(const TensorArgs* tensors, const ChunkArgs* chunks, const GroupHParams* groups,
                     double* partials, const float* grad_scale, bool grads_too) {
  using O = typename OpMath<P>::type;
  using M = Companion<kWeight>;
  const ChunkArgs chunk = chunks[blockIdx.x];
  const TensorArgs t = tensors[chunk.tensor];
  if (!t.lars && !grads_too) return;
  const GroupHParams& h = groups[t.group];
  const Coeffs<O> c = make_coeffs<O>(h, inverse_scale_of(grad_scale), /*clip=*/1.0, false);  // before the clip
  const O weight_decay = static_cast<O>(h.weight_decay);
  const bool decayed = decayed_grad(h);
  const P* w = static_cast<const P*>(t.param);
  const P* g = static_cast<const P*>(t.grad);
  const M* m = static_cast<const M*>(t.slots.companion(kWeight));
  double sum[kNumLarsSums] = {0, 0, 0, 0};
  for (int64_t i = chunk.begin + threadIdx.x; i < chunk.end; i += kThreads) {
    const O gi = clipped_grad<true, O>(load(g, i), c);
    sum[kGradSq] += static_cast<double>(gi) * gi;
    if (!t.lars) continue;
    const O wi = load_weight<kWeight>(w, m, i);
    const O ti = decayed ? mul_add(wi, weight_decay, gi) : gi;  // lars_norm_term
    sum[0] += static_cast<double>(wi) * wi;
    sum[1] += static_cast<double>(ti) * ti;
    sum[2] += static_cast<double>(wi) * ti;
  }
  LFSGD_SHARED(double, scratch, kThreads / 32);
  for (int k = 0; k < kNumLarsSums; ++k) {
    const double total = block_sum(sum[k], scratch);
    if (threadIdx.x == 0) partials[kNumLarsSums * blockIdx.x + k] = total;
  }
}

// lars_sq_sums, pass 2: one block per tensor adds its chunks' sums in a fixed order into its row.
__global__ void __launch_bounds__(kThreads)
    lars_rows_kernel(const TensorArgs* tensors, const double* partials, double* rows) {
  const TensorArgs t = tensors[blockIdx.x];
  double sum[kNumLarsSums] = {0, 0, 0, 0};
  for (int64_t k = t.first_chunk + threadIdx.x; k < t.first_chunk + t.num_chunks; k += kThreads) {
    for (int j = 0; j < kNumLarsSums; ++j) sum[j] += partials[kNumLarsSums * k + j];
  }
  LFSGD_SHARED(double, scratch, kThreads / 32);
  for (int j = 0; j < kNumLarsSums; ++j) {
    const double total = block_sum(sum[j], scratch);
    if (threadIdx.x == 0) rows[kNumLarsSums * blockIdx.x + j] = total;
  }
}

// A step reporting its gradient norm: one block adds the grad_sq sums of every row, in a fixed order, to the step
// row's unscaled_grad_sq_sum, unless the step was skipped.
__global__ void __launch_bounds__(kThreads)
    grad_sq_total_kernel(const double* rows, int64_t n, double* total, const float* found_inf) {
  double sum = 0;
  for (int64_t t = threadIdx.x; t < n; t += kThreads) sum += rows[kNumLarsSums * t + kGradSq];
  LFSGD_SHARED(double, scratch, kThreads / 32);
  sum = block_sum(sum, scratch);
  if (threadIdx.x == 0 && !skipped(found_inf)) *total += sum;
}

// The update: each block steps one chunk. A LARS tensor's trust ratio comes from its row of sums (the same for
// every chunk of the tensor), clipped_term_sq_sum applying the norm clip to them. A schedule-free bucket
// (kScheduleFree) steps schedule_free_element, each tensor's z as its aux stream, with its group's ckp1.
template <typename P, typename A, Weight kWeight, bool kScheduleFree>
__global__ void __launch_bounds__(kThreads)
    update_kernel(const TensorArgs* tensors, const ChunkArgs* chunks, const GroupHParams* groups, StepRow row) {
  using O = typename OpMath<P>::type;
  if (skipped(row.found_inf)) return;
  const ChunkArgs chunk = chunks[blockIdx.x];
  const TensorArgs t = tensors[chunk.tensor];
  const GroupHParams h = group_of(groups, t.group, row);
  const double inv_scale = row_inverse_scale(row);
  const double clip = row_clip(row, inv_scale);
  Coeffs<O> c = make_coeffs<O>(h, inv_scale, clip, t.first != 0);
  const bool has_aux = kScheduleFree || c.has_momentum_buffer;  // z, or SGD's momentum buffer
  if constexpr (kScheduleFree) apply_schedule_free(c, h, row.ckp1[t.group]);
  if (t.lars) {
    const double* sums = row.lars_sq_sums + kNumLarsSums * chunk.tensor;
    apply_lars(c, sums[0], clipped_term_sq_sum(sums[0], sums[1], sums[2], clip, h), h);
  }
  const Streams<P, A, kWeight> s = streams_of<P, A, kWeight>(t.param, t.grad, t.slots, kScheduleFree);
  // Stochastic rounding of the update: bf16 params without masters only (rounds_stochastically), those with a count.
  int64_t* rounding_step = t.slots.count(kRoundingStep);
  const bool stochastic = rounding_step != nullptr;
  const uint32_t key = stochastic ? rounding_key(h.rounding_seed, *rounding_step, chunk.tensor) : 0;
  const AverageCoeffs<O> a =
      s.e != nullptr ? average_coeffs<O>(h, *t.slots.count(kEmaStep), *t.slots.count(kEmaUpdates)) : AverageCoeffs<O>{};
  // kUnroll elements' loads in flight, then their updates and stores.
  for (int64_t base = chunk.begin + threadIdx.x; base < chunk.end; base += kThreads * kUnroll) {
    Operands<O> operands[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * kThreads;
      if (i < chunk.end) operands[u] = load_operands(s, i, has_aux && !c.first, O{});
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * kThreads;
      if (i < chunk.end) update_at<kScheduleFree, true>(s, i, operands[u], c, has_aux, stochastic, key, a.update,
                                                        a);
    }
  }
}

// schedule_free_switch: each weight moved on its line through z (switch_weight), rounded to nearest into the
// param (and its master or compensation).
template <typename P, typename A, Weight kWeight>
__global__ void __launch_bounds__(kThreads)
    schedule_free_switch_kernel(const TensorArgs* tensors, const ChunkArgs* chunks, const GroupHParams* groups,
                                bool train) {
  using O = typename OpMath<P>::type;
  using M = Companion<kWeight>;
  const ChunkArgs chunk = chunks[blockIdx.x];
  const TensorArgs t = tensors[chunk.tensor];
  const O to = static_cast<O>(switch_weight(groups[t.group], train));
  P* w = static_cast<P*>(t.param);
  const A* z = static_cast<const A*>(t.slots.aux(true));
  M* m = static_cast<M*>(t.slots.companion(kWeight));
  for (int64_t i = chunk.begin + threadIdx.x; i < chunk.end; i += kThreads) {
    const O moved = lerp(load_weight<kWeight>(w, m, i), static_cast<O>(load(z, i)), to);
    store_update<kWeight>(w, static_cast<A*>(nullptr), m, i, moved, moved, false, false, 0);
  }
}

// schedule_free_scalars: one thread advances every group's scalars (advance_schedule_free), unless the step was
// skipped.
__global__ void schedule_free_scalars_kernel(double* scalars, const GroupHParams* groups, int64_t n, StepRow row) {
  if (skipped(row.found_inf)) return;
  for (int64_t g = 0; g < n; ++g) {
    advance_schedule_free(scalars, n, g, row.lrs != nullptr ? row.lrs[g] : groups[g].lr, groups[g]);
  }
}

// After the update (whose every block read the counts): each stochastically rounded tensor counts its step, and
// each tensor with an average its step and (where the step updated it) the update, unless the step was skipped.
__global__ void advance_counts_kernel(const TensorArgs* tensors, const GroupHParams* groups, int64_t n,
                                      const float* found_inf) {
  if (skipped(found_inf)) return;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < n;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const TensorArgs& args = tensors[t];
    if (int64_t* rounding_step = args.slots.count(kRoundingStep)) ++*rounding_step;
    if (int64_t* steps = args.slots.count(kEmaStep)) {
      int64_t* updates = args.slots.count(kEmaUpdates);
      const bool update = average_coeffs<double>(groups[args.group], *steps, *updates).update;
      ++*steps;
      if (update) ++*updates;
    }
  }
}

// grad_sq_sum: each block sums the squares of one chunk in double, then the partials are added on the device.
template <typename P>
__global__ void __launch_bounds__(kThreads)
    grad_sq_sum_kernel(const P* const* grads, const ChunkArgs* chunks, double* partials) {
  const ChunkArgs chunk = chunks[blockIdx.x];
  const P* g = grads[chunk.tensor];
  double sum = 0;
  for (int64_t i = chunk.begin + threadIdx.x; i < chunk.end; i += kThreads) {
    const double gi = load(g, i);
    sum += gi * gi;
  }
  LFSGD_SHARED(double, scratch, kThreads / 32);
  const double total = block_sum(sum, scratch);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

__global__ void schedule_kernel(double* lrs, int64_t* position, const double* schedule, int64_t length,
                                const double* peaks, int64_t groups, const bool* applied, bool advance) {
  schedule_step(lrs, position, schedule, length, peaks, groups, applied, advance);
}

}  // namespace
}  // namespace lfsgd
