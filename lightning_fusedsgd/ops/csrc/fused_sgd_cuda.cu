// The CUDA kernels of the lightning_fusedsgd ops (defined in lightning_fusedsgd/ops/__init__.py): one launch per
// (device, dtype) bucket over a work list of fixed-size chunks across all tensors, of the update (with LARS,
// lars_sq_sums's two launches first, whose rows the update reads; a sharded step passes them reduced), of
// grad_sq_sum, the gradients' sum of squares for norm clipping, of lars_sq_sums, each LARS tensor's sums, and of
// schedule_lrs, the lr schedule on the device. The math lives in sgd_math.h and schedule.h, the argument checks in
// bucket.h, and what needs the CUDA runtime (streams, capture, the device guard, launches) behind device.h, which a
// host compiler replaces with an emulation of CUDA's execution model, so the tests run this file on the CPU.
// Nothing here reads device memory from the host: the grad scale, found_inf, the LARS norms, the rounding steps
// and (capturable steps) the lrs stay on the device, so a step never synchronizes, and under CUDA graph capture
// the argument tables are written by kernels, so a replay reads no host memory.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "bucket.h"
#include "elements.h"
#include "schedule.h"
#include "schedule_free.h"
#include "sgd_math.h"
#include "work_list.h"
// Last: the emulation spells CUDA's keywords as macros.
#include "device.h"

namespace lfsgd {
namespace {

constexpr int kThreads = 512;
// Elements per independent load in flight per thread: enough memory parallelism to reach bandwidth.
constexpr int kUnroll = 4;
// Elements per block (32 per thread per unrolled iteration). The emulated build takes fewer, so that the tests'
// tensors cross every loop's boundaries (fused_sgd_cuda_emulated.cpp).
#ifndef LFSGD_BLOCK_CHUNK_ELEMS
#define LFSGD_BLOCK_CHUNK_ELEMS 65536
#endif
constexpr int64_t kBlockChunkElems = LFSGD_BLOCK_CHUNK_ELEMS;

// One tensor, as the kernels see it. Pointers are typed by the launch's template arguments.
struct TensorArgs {
  void* param;
  const void* grad;
  SlotPointers slots;  // its state, by slot (bucket.h)
  int64_t group;
  int32_t first;  // first step: the kernel seeds its kGradient slots (the buffer) with the gradient
  int32_t lars;
  int64_t first_chunk;  // its chunks are first_chunk .. first_chunk + num_chunks - 1 of the work list
  int64_t num_chunks;
};

struct ChunkArgs {
  int64_t tensor;
  int64_t begin;
  int64_t end;
};

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

// lars_sq_sums, pass 1: each chunk of a LARS tensor writes its sums of w^2, t^2 and w t (lars_norm_term before
// the norm clip, sgd_math.h), in double; other chunks leave their zeros. The CPU kernel sums a chunk in fp32 and
// falls back to double out of fp32's exact range (chunk_lars_sums in fused_sgd.cpp: its pass runs from cache at
// the vector width); here the pass is memory-bound, and double costs nothing.
template <typename P, Weight kWeight>
__global__ void __launch_bounds__(kThreads)
    lars_sums_kernel(const TensorArgs* tensors, const ChunkArgs* chunks, const GroupHParams* groups,
                     double* partials, const float* grad_scale) {
  using O = typename OpMath<P>::type;
  using M = Companion<kWeight>;
  const ChunkArgs chunk = chunks[blockIdx.x];
  const TensorArgs t = tensors[chunk.tensor];
  if (!t.lars) return;
  const GroupHParams& h = groups[t.group];
  const Coeffs<O> c = make_coeffs<O>(h, inverse_scale_of(grad_scale), /*clip=*/1.0, false);  // before the clip
  const O weight_decay = static_cast<O>(h.weight_decay);
  const P* w = static_cast<const P*>(t.param);
  const P* g = static_cast<const P*>(t.grad);
  const M* m = static_cast<const M*>(t.slots.companion(kWeight));
  double sum[kNumLarsSums] = {0, 0, 0};
  for (int64_t i = chunk.begin + threadIdx.x; i < chunk.end; i += kThreads) {
    const O wi = load_weight<kWeight>(w, m, i);
    const O ti = lars_norm_term<true, O>(wi, load(g, i), c, weight_decay, decayed_grad(h));
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
  double sum[kNumLarsSums] = {0, 0, 0};
  for (int64_t k = t.first_chunk + threadIdx.x; k < t.first_chunk + t.num_chunks; k += kThreads) {
    for (int j = 0; j < kNumLarsSums; ++j) sum[j] += partials[kNumLarsSums * k + j];
  }
  LFSGD_SHARED(double, scratch, kThreads / 32);
  for (int j = 0; j < kNumLarsSums; ++j) {
    const double total = block_sum(sum[j], scratch);
    if (threadIdx.x == 0) rows[kNumLarsSums * blockIdx.x + j] = total;
  }
}

// The update: each block steps one chunk. A LARS tensor's trust ratio comes from its row of sums (the same for
// every chunk of the tensor), clipped_term_sq_sum applying the norm clip to them. A schedule-free bucket
// (kScheduleFree) steps schedule_free_element, each tensor's z where SGD's buffer is, with its group's ckp1.
template <typename P, typename B, Weight kWeight, bool kScheduleFree>
__global__ void __launch_bounds__(kThreads)
    update_kernel(const TensorArgs* tensors, const ChunkArgs* chunks, const GroupHParams* groups, StepRow row) {
  using O = typename OpMath<P>::type;
  if (skipped(row.found_inf)) return;
  const ChunkArgs chunk = chunks[blockIdx.x];
  const TensorArgs t = tensors[chunk.tensor];
  const GroupHParams h = group_of(groups, t.group, row);
  const bool has_momentum = kScheduleFree || h.momentum != 0.0;
  const double inv_scale = row_inverse_scale(row);
  const double clip = row_clip(row, inv_scale);
  Coeffs<O> c = make_coeffs<O>(h, inv_scale, clip, t.first != 0);
  if constexpr (kScheduleFree) apply_schedule_free(c, h, row.ckp1[t.group]);
  if (t.lars) {
    const double* sums = row.lars_sq_sums + kNumLarsSums * chunk.tensor;
    apply_lars(c, sums[0], clipped_term_sq_sum(sums[0], sums[1], sums[2], clip, h), h);
  }
  const Streams<P, B, kWeight> s = streams_of<P, B, kWeight>(t.param, t.grad, t.slots, kScheduleFree);
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
      if (i < chunk.end) operands[u] = load_operands(s, i, has_momentum && !c.first, O{});
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * kThreads;
      if (i < chunk.end) update_at<kScheduleFree, true>(s, i, operands[u], c, has_momentum, stochastic, key, a.update,
                                                        a);
    }
  }
}

// schedule_free_switch: each weight moved on its line through z (switch_weight), rounded to nearest into the
// param (and its master or compensation).
template <typename P, typename B, Weight kWeight>
__global__ void __launch_bounds__(kThreads)
    schedule_free_switch_kernel(const TensorArgs* tensors, const ChunkArgs* chunks, const GroupHParams* groups,
                                bool train) {
  using O = typename OpMath<P>::type;
  using M = Companion<kWeight>;
  const ChunkArgs chunk = chunks[blockIdx.x];
  const TensorArgs t = tensors[chunk.tensor];
  const O to = static_cast<O>(switch_weight(groups[t.group], train));
  P* w = static_cast<P*>(t.param);
  const B* z = static_cast<const B*>(t.slots.buffer(true));
  M* m = static_cast<M*>(t.slots.companion(kWeight));
  for (int64_t i = chunk.begin + threadIdx.x; i < chunk.end; i += kThreads) {
    const O moved = lerp(load_weight<kWeight>(w, m, i), static_cast<O>(load(z, i)), to);
    store_update<kWeight>(w, static_cast<B*>(nullptr), m, i, moved, moved, false, false, 0);
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

// Bytes one kernel parameter carries (CUDA allows 4 KB of parameters per launch).
constexpr size_t kParamBytes = 3968;
struct ParamBytes {
  uint8_t bytes[kParamBytes];
};

__global__ void write_bytes_kernel(uint8_t* out, ParamBytes in, int64_t count) {
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) out[i] = in.bytes[i];
}

// Host code.

// A bucket as the kernels see it: each tensor's arguments and the work list of their chunks.
struct Work {
  std::vector<TensorArgs> tensors;
  std::vector<ChunkArgs> chunks;
};

inline Work make_work(const Bucket& bucket) {
  Work work;
  const size_t n = bucket.params.size();
  work.tensors.resize(n);
  for (size_t t = 0; t < n; ++t) {
    TensorArgs& args = work.tensors[t];
    args = TensorArgs{};
    args.param = bucket.params[t].data_ptr();
    args.grad = bucket.grads[t].data_ptr();
    args.slots = bucket.slots[t];
    args.group = bucket.tensor_group[t];
    args.first = bucket.first_step[t] ? 1 : 0;
    args.lars = lars_adapts(bucket.groups[args.group]) ? 1 : 0;
    args.first_chunk = static_cast<int64_t>(work.chunks.size());
    append_chunks(work.chunks, static_cast<int64_t>(t), bucket.params[t].numel(), kBlockChunkElems);
    args.num_chunks = static_cast<int64_t>(work.chunks.size()) - args.first_chunk;
  }
  return work;
}

// A kernel's argument tables on the device: one buffer holding every table, and where each one starts.
struct DeviceTables {
  at::Tensor buffer;
  std::vector<size_t> offsets;

  template <typename T>
  const T* table(size_t index) const {
    return reinterpret_cast<const T*>(buffer.data_ptr<uint8_t>() + offsets[index]);
  }
};

// Copies host arrays (pointer, bytes) to `device` in one buffer, asynchronously on the current stream: from a
// staging buffer (pinned on CUDA, kept alive by the caching host allocator until the copy has run); or, while the
// stream is captured in a graph, in the parameters of small kernels, which the graph keeps by value (a copy from
// host memory would be replayed from memory that is not kept).
inline DeviceTables upload(const at::Device& device, device::Stream stream,
                           std::initializer_list<std::pair<const void*, size_t>> parts) {
  DeviceTables tables;
  size_t total = 0;
  for (const auto& part : parts) {
    tables.offsets.push_back(total);
    total += part.second;
  }
  const bool capturing = device::capturing();
  const auto bytes = at::TensorOptions().dtype(at::kByte);
  at::Tensor host = device::host_buffer(static_cast<int64_t>(total), /*pinned=*/!capturing);
  size_t index = 0;
  for (const auto& part : parts) {
    std::memcpy(host.data_ptr<uint8_t>() + tables.offsets[index++], part.first, part.second);
  }
  tables.buffer = at::empty({host.numel()}, bytes.device(device));
  if (!capturing) {
    tables.buffer.copy_(host, /*non_blocking=*/true);
    return tables;
  }
  for (size_t begin = 0; begin < total; begin += kParamBytes) {
    ParamBytes piece;
    const size_t count = std::min(kParamBytes, total - begin);
    std::memcpy(piece.bytes, host.data_ptr<uint8_t>() + begin, count);
    device::launch(&write_bytes_kernel, 1, 256, stream, tables.buffer.data_ptr<uint8_t>() + begin, piece,
                   static_cast<int64_t>(count));
  }
  return tables;
}

// Uploads a bucket's work tables (tensors, chunks, groups).
inline DeviceTables upload_work(const at::Device& device, device::Stream stream, const Work& work,
                                const std::vector<GroupHParams>& groups) {
  return upload(device, stream,
                {{work.tensors.data(), work.tensors.size() * sizeof(TensorArgs)},
                 {work.chunks.data(), work.chunks.size() * sizeof(ChunkArgs)},
                 {groups.data(), groups.size() * sizeof(GroupHParams)}});
}

// Each LARS tensor's row of sums (lars_sq_sums), for a bucket whose work tables are on the device: a float64
// [n, kNumLarsSums] tensor there, zeros for the other tensors.
inline at::Tensor lars_rows(const Work& work, const DeviceTables& tables, const at::Device& device,
                            device::Stream stream, at::ScalarType dtype, Weight weight, const float* grad_scale) {
  const auto options = at::TensorOptions().dtype(at::kDouble).device(device);
  const int64_t n = static_cast<int64_t>(work.tensors.size());
  at::Tensor rows = at::zeros({n, kNumLarsSums}, options);
  const int64_t num_chunks = static_cast<int64_t>(work.chunks.size());
  if (num_chunks == 0) return rows;
  at::Tensor partials = at::zeros({num_chunks, kNumLarsSums}, options);
  dispatch_bucket_types(dtype, weight, [&](auto param, auto, auto weight_tag) {
    device::launch(&lars_sums_kernel<decltype(param), decltype(weight_tag)::value>, num_chunks, kThreads, stream,
                   tables.table<TensorArgs>(0), tables.table<ChunkArgs>(1), tables.table<GroupHParams>(2),
                   partials.data_ptr<double>(), grad_scale);
  });
  device::launch(&lars_rows_kernel, n, kThreads, stream, tables.table<TensorArgs>(0), partials.data_ptr<double>(),
                 rows.data_ptr<double>());
  return rows;
}

inline void check_on_device(const at::Tensor& tensor, const char* op) {
  TORCH_CHECK(device::on_device(tensor), "lightning_fusedsgd::", op, " (", device::kName, "): ", device::kName,
              " tensors only");
}

// The CUDA kernel of lightning_fusedsgd::sgd_step (the op: sgd_step_op in bucket.h).
void run_device(const Bucket& bucket) {
  const at::TensorList params = bucket.params;
  if (params.empty()) return;
  check_on_device(params[0], "sgd_step");
  const int64_t n = static_cast<int64_t>(params.size());
  const at::Device device = params[0].device();
  const Work work = make_work(bucket);
  bool any_counts = false;
  for (const TensorArgs& args : work.tensors) {
    any_counts = any_counts || args.slots.count(kRoundingStep) != nullptr || args.slots.count(kEmaStep) != nullptr;
  }
  const int64_t num_chunks = static_cast<int64_t>(work.chunks.size());
  if (num_chunks == 0 && !any_counts) return;

  const device::Guard guard(device);
  const device::Stream stream = device::current_stream();
  const DeviceTables tables = upload_work(device, stream, work, bucket.groups);
  StepRow row = bucket.row;
  // Unsharded LARS: the sums of each LARS tensor, reduced once into its row, which every block of it reads.
  const at::Tensor rows = bucket.any_lars && row.lars_sq_sums == nullptr
                              ? lars_rows(work, tables, device, stream, params[0].scalar_type(), bucket.weight,
                                          row.grad_scale)
                              : at::Tensor();
  if (rows.defined()) row.lars_sq_sums = rows.data_ptr<double>();
  if (num_chunks > 0) {
    dispatch_bucket_types(params[0].scalar_type(), bucket.weight, [&](auto param, auto buffer, auto weight) {
      using P = decltype(param);
      using B = decltype(buffer);
      constexpr Weight kWeight = decltype(weight)::value;
      const auto kernel =
          bucket.schedule_free ? &update_kernel<P, B, kWeight, true> : &update_kernel<P, B, kWeight, false>;
      device::launch(kernel, num_chunks, kThreads, stream, tables.table<TensorArgs>(0), tables.table<ChunkArgs>(1),
                     tables.table<GroupHParams>(2), row);
    });
  }
  if (any_counts) {
    device::launch(&advance_counts_kernel, (n + 255) / 256, 256, stream, tables.table<TensorArgs>(0),
                   tables.table<GroupHParams>(2), n, row.found_inf);
  }
}

// lightning_fusedsgd::lars_sq_sums on the device (the op: lars_sq_sums_op in bucket.h): a float64
// [n, kNumLarsSums] table there (zeros for tensors without LARS), with no host sync.
at::Tensor lars_sq_sums_device(const Bucket& bucket) {
  const at::TensorList params = bucket.params;
  TORCH_CHECK(!params.empty(), "lightning_fusedsgd::lars_sq_sums: no params");
  check_on_device(params[0], "lars_sq_sums");
  const at::Device device = params[0].device();
  const Work work = make_work(bucket);
  if (work.chunks.empty()) return at::zeros({static_cast<int64_t>(params.size()), kNumLarsSums},
                                            at::TensorOptions().dtype(at::kDouble).device(device));
  const device::Guard guard(device);
  const device::Stream stream = device::current_stream();
  const DeviceTables tables = upload_work(device, stream, work, bucket.groups);
  return lars_rows(work, tables, device, stream, params[0].scalar_type(), bucket.weight, bucket.row.grad_scale);
}

// lightning_fusedsgd::grad_sq_sum on the device: a float64 scalar there, with no host sync.
at::Tensor grad_sq_sum_device(at::TensorList grads) {
  check_grads(grads);
  TORCH_CHECK(!grads.empty(), "lightning_fusedsgd::grad_sq_sum: no gradients");
  check_on_device(grads[0], "grad_sq_sum");
  const at::Device device = grads[0].device();
  std::vector<const void*> pointers;
  std::vector<ChunkArgs> chunks;
  for (int64_t t = 0; t < static_cast<int64_t>(grads.size()); ++t) {
    pointers.push_back(grads[t].data_ptr());
    append_chunks(chunks, t, grads[t].numel(), kBlockChunkElems);
  }
  const auto options = at::TensorOptions().dtype(at::kDouble).device(device);
  if (chunks.empty()) return at::zeros({}, options);
  const device::Guard guard(device);
  const device::Stream stream = device::current_stream();
  const DeviceTables tables = upload(
      device, stream,
      {{pointers.data(), pointers.size() * sizeof(void*)}, {chunks.data(), chunks.size() * sizeof(ChunkArgs)}});
  const int64_t num_chunks = static_cast<int64_t>(chunks.size());
  at::Tensor partials = at::empty({num_chunks}, options);
  dispatch_bucket_types(grads[0].scalar_type(), Weight::kParam, [&](auto grad, auto, auto) {
    using P = decltype(grad);
    device::launch(&grad_sq_sum_kernel<P>, num_chunks, kThreads, stream, tables.table<const P*>(0),
                   tables.table<ChunkArgs>(1), partials.data_ptr<double>());
  });
  return partials.sum();
}

// lightning_fusedsgd::schedule_lrs on the device: one thread runs schedule_step (schedule.h).
void schedule_lrs_device(const at::Tensor& lrs, const at::Tensor& position, const at::Tensor& schedule,
                         const at::Tensor& peaks, const std::optional<at::Tensor>& applied, bool advance) {
  check_schedule_inputs(lrs, position, schedule, peaks, applied);
  check_on_device(lrs, "schedule_lrs");
  const device::Guard guard(lrs.device());
  device::launch(&schedule_kernel, 1, 1, device::current_stream(), lrs.data_ptr<double>(),
                 position.data_ptr<int64_t>(), schedule.data_ptr<double>(), schedule.numel(), peaks.data_ptr<double>(),
                 lrs.numel(), applied.has_value() ? applied->data_ptr<bool>() : nullptr, advance);
}

// lightning_fusedsgd::schedule_free_scalars on the device (the op: schedule_free_scalars_op in bucket.h).
void schedule_free_scalars_device(const at::Tensor& scalars, const std::vector<GroupHParams>& groups,
                                  const StepRow& row) {
  check_on_device(scalars, "schedule_free_scalars");
  if (groups.empty()) return;
  const device::Guard guard(scalars.device());
  const device::Stream stream = device::current_stream();
  const DeviceTables tables = upload(scalars.device(), stream, {{groups.data(), groups.size() * sizeof(GroupHParams)}});
  device::launch(&schedule_free_scalars_kernel, 1, 1, stream, scalars.data_ptr<double>(),
                 tables.table<GroupHParams>(0), static_cast<int64_t>(groups.size()), row);
}

// lightning_fusedsgd::schedule_free_switch on the device (the op: schedule_free_switch_op in bucket.h).
void schedule_free_switch_device(const Bucket& bucket, bool train) {
  const at::TensorList params = bucket.params;
  if (params.empty()) return;
  check_on_device(params[0], "schedule_free_switch");
  const Work work = make_work(bucket);
  const int64_t num_chunks = static_cast<int64_t>(work.chunks.size());
  if (num_chunks == 0) return;
  const device::Guard guard(params[0].device());
  const device::Stream stream = device::current_stream();
  const DeviceTables tables = upload_work(params[0].device(), stream, work, bucket.groups);
  dispatch_bucket_types(params[0].scalar_type(), bucket.weight, [&](auto param, auto buffer, auto weight) {
    device::launch(&schedule_free_switch_kernel<decltype(param), decltype(buffer), decltype(weight)::value>,
                   num_chunks, kThreads, stream, tables.table<TensorArgs>(0), tables.table<ChunkArgs>(1),
                   tables.table<GroupHParams>(2), train);
  });
}

}  // namespace
}  // namespace lfsgd

TORCH_LIBRARY_IMPL(LFSGD_DEVICE_LIBRARY, LFSGD_DEVICE_DISPATCH, m) {
  m.impl("sgd_step", &lfsgd::sgd_step_op<lfsgd::run_device>);
  m.impl("grad_sq_sum", &lfsgd::grad_sq_sum_device);
  m.impl("lars_sq_sums", &lfsgd::lars_sq_sums_op<lfsgd::lars_sq_sums_device>);
  m.impl("schedule_lrs", &lfsgd::schedule_lrs_device);
  m.impl("schedule_free_scalars", &lfsgd::schedule_free_scalars_op<lfsgd::schedule_free_scalars_device>);
  m.impl("schedule_free_switch", &lfsgd::schedule_free_switch_op<lfsgd::schedule_free_switch_device>);
}
