// The CUDA kernels of the lightning_fusedsgd ops (defined in lightning_fusedsgd/ops/__init__.py): one launch per
// (device, dtype) bucket over a work list of fixed-size chunks across all tensors (two launches with LARS:
// norms, then update; the update alone when a sharded step passes reduced lars_sq_sums), of grad_sq_sum, the
// gradients' sum of squares for norm clipping, and of lars_sq_sums, the partial LARS sums a sharded step
// all-reduces, and of schedule_lrs, the lr schedule on the device. The math lives in sgd_math.h and
// schedule.h, the argument checks in bucket.h. Nothing here reads device memory from the host: the grad scale,
// found_inf, the LARS norms and (capturable steps) the lrs stay on the device, so a step never synchronizes,
// and under CUDA graph capture the argument tables are written by kernels, so a replay reads no host memory.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "bucket.h"
#include "schedule.h"
#include "sgd_math.h"

namespace lfsgd {
namespace {

constexpr int kThreads = 512;
// Elements per independent load in flight per thread: enough memory parallelism to reach bandwidth.
constexpr int kUnroll = 4;
// Elements per block (32 per thread per unrolled iteration).
constexpr int64_t kChunkElems = 65536;

// One tensor, as the kernels see it. Pointers are typed by the launch's template arguments.
struct TensorArgs {
  void* param;
  const void* grad;
  void* buffer;  // momentum buffer, or null without momentum
  void* master;  // fp32 master weights or bf16 Kahan compensations (MasterType), or null
  int64_t* rounding_step;  // the count of a tensor rounded stochastically (rounds_stochastically), or null
  int64_t group;
  int32_t first;  // first step: the buffer is seeded with the gradient
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

// The step's scalars, all read on the device but max_grad_norm: GradScaler's grad scale and found_inf, the
// gradients' sum of squares for norm clipping, and the groups' lrs (each null when absent).
struct StepScalars {
  const float* grad_scale;
  const float* found_inf;
  const double* grad_sq_sum;  // with max_grad_norm: clip by norm
  double max_grad_norm;
  const double* lars_sums;  // [n, kNumLarsSums] reduced across shards: replaces the norm pass
  const double* lrs;        // [groups] (capturable steps): replaces the table's lr
};

// A group's hyperparameters, with its lr from the device where the step has one.
__device__ inline GroupHParams group_of(const GroupHParams* groups, int64_t group, const StepScalars& s) {
  GroupHParams h = groups[group];
  if (s.lrs != nullptr) h.lr = s.lrs[group];
  return h;
}

template <typename O>
__device__ inline Coeffs<O> coeffs_of(const GroupHParams& h, const TensorArgs& t, const StepScalars& s) {
  const double inv_scale = inverse_scale_of(s.grad_scale);
  const double clip = s.grad_sq_sum == nullptr ? 1.0 : clip_coef(*s.grad_sq_sum, s.max_grad_norm, inv_scale);
  return make_coeffs<O>(h, inv_scale, clip, t.first != 0);
}

// The weight of element i in opmath: the param, its fp32 master re-synced with the param, or the param plus its
// Kahan compensation (sgd_math.h).
template <Masters kMasters, typename P>
__device__ inline typename OpMath<P>::type load_weight(const P* w, const void* masters, int64_t i) {
  const MasterType<kMasters>* m = static_cast<const MasterType<kMasters>*>(masters);
  if constexpr (kMasters == Masters::kFp32) {
    const P param = w[i];
    return synced_master(m[i], static_cast<P>(m[i]).x, param.x, static_cast<float>(param));
  } else if constexpr (kMasters == Masters::kCompensation) {
    return static_cast<float>(w[i]) + static_cast<float>(m[i]);
  } else {
    return static_cast<typename OpMath<P>::type>(w[i]);
  }
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

// LARS pass 1: each chunk of a LARS tensor writes its partial sums of w^2 and g^2.
template <typename P, Masters kMasters>
__global__ void __launch_bounds__(kThreads)
    norm_kernel(const TensorArgs* tensors, const ChunkArgs* chunks, const GroupHParams* groups, double* partials,
                StepScalars scalars) {
  using O = typename OpMath<P>::type;
  if (skipped(scalars.found_inf)) return;
  const ChunkArgs chunk = chunks[blockIdx.x];
  const TensorArgs t = tensors[chunk.tensor];
  if (!t.lars) return;
  const GroupHParams& h = groups[t.group];
  const Coeffs<O> c = coeffs_of<O>(h, t, scalars);
  const O weight_decay = static_cast<O>(h.weight_decay);
  const P* w = static_cast<const P*>(t.param);
  const P* g = static_cast<const P*>(t.grad);
  // Squares are summed in double (fp32 squares underflow below about 1e-23 and overflow above 1e19).
  double sum_w = 0, sum_g = 0;
  for (int64_t i = chunk.begin + threadIdx.x; i < chunk.end; i += kThreads) {
    const O wi = load_weight<kMasters>(w, t.master, i);
    const O gi = lars_norm_term<true, O>(wi, static_cast<O>(g[i]), c, weight_decay, h.lars_decayed_grad);
    sum_w += static_cast<double>(wi) * wi;
    sum_g += static_cast<double>(gi) * gi;
  }
  __shared__ double scratch[kThreads / 32];
  const double total_w = block_sum(sum_w, scratch);
  const double total_g = block_sum(sum_g, scratch);
  if (threadIdx.x == 0) {
    partials[2 * blockIdx.x] = total_w;
    partials[2 * blockIdx.x + 1] = total_g;
  }
}

// The update: each block steps one chunk. LARS tensors first reduce their chunks' partial sums in a fixed
// order (so every chunk of a tensor gets the same trust ratio) and apply trust_ratio.
template <typename P, typename B, Masters kMasters>
__global__ void __launch_bounds__(kThreads)
    update_kernel(const TensorArgs* tensors, const ChunkArgs* chunks, const GroupHParams* groups,
                  const double* partials, StepScalars scalars) {
  using O = typename OpMath<P>::type;
  if (skipped(scalars.found_inf)) return;
  const ChunkArgs chunk = chunks[blockIdx.x];
  const TensorArgs t = tensors[chunk.tensor];
  const GroupHParams h = group_of(groups, t.group, scalars);
  const bool has_momentum = h.momentum != 0.0;
  Coeffs<O> c = coeffs_of<O>(h, t, scalars);
  if (t.lars && scalars.lars_sums != nullptr) {
    const double* row = scalars.lars_sums + kNumLarsSums * chunk.tensor;
    apply_lars(c, row[0], clipped_term_sq_sum(row[0], row[1], row[2], c.clip_coef, h), h);
  } else if (t.lars) {
    __shared__ O trust, wd_coupled;
    __shared__ double scratch[kThreads / 32];
    double part_w = 0, part_g = 0;
    for (int64_t k = t.first_chunk + threadIdx.x; k < t.first_chunk + t.num_chunks; k += kThreads) {
      part_w += partials[2 * k];
      part_g += partials[2 * k + 1];
    }
    const double sum_w = block_sum(part_w, scratch);
    const double sum_g = block_sum(part_g, scratch);
    if (threadIdx.x == 0) {
      apply_lars(c, sum_w, sum_g, h);
      trust = c.trust;
      wd_coupled = c.wd_coupled;
    }
    __syncthreads();
    c.trust = trust;
    c.wd_coupled = wd_coupled;
  }
  P* w = static_cast<P*>(t.param);
  const P* g = static_cast<const P*>(t.grad);
  B* b = static_cast<B*>(t.buffer);
  // Stochastic rounding of the update: bf16 params without masters only (sgd_math.h), those with a count.
  constexpr bool kMayRoundStochastically = std::is_same_v<P, c10::BFloat16> && kMasters == Masters::kNone;
  const bool stochastic = kMayRoundStochastically && t.rounding_step != nullptr;
  const uint32_t key = stochastic ? rounding_key(h.rounding_seed, *t.rounding_step, chunk.tensor) : 0;
  for (int64_t base = chunk.begin + threadIdx.x; base < chunk.end; base += kThreads * kUnroll) {
    O wi[kUnroll], gi[kUnroll], bi[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * kThreads;
      if (i < chunk.end) {
        wi[u] = load_weight<kMasters>(w, t.master, i);
        gi[u] = static_cast<O>(g[i]);
        bi[u] = has_momentum && !c.first ? static_cast<O>(b[i]) : O(0);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * kThreads;
      if (i < chunk.end) {
        sgd_element(wi[u], gi[u], bi[u], c);
        if constexpr (kMasters == Masters::kFp32) static_cast<float*>(t.master)[i] = wi[u];
        if constexpr (kMasters == Masters::kCompensation) {
          const P rounded = static_cast<P>(wi[u]);
          w[i] = rounded;
          static_cast<P*>(t.master)[i] =
              static_cast<P>(kahan_compensation(wi[u], static_cast<float>(rounded)));
          if (has_momentum) b[i] = static_cast<B>(bi[u]);
        } else if (kMayRoundStochastically && stochastic) {
          const uint32_t random = element_random_bits(key, i);
          reinterpret_cast<uint16_t*>(w)[i] = stochastic_bf16_bits(__float_as_uint(wi[u]), random >> 16);
          if (has_momentum) {
            reinterpret_cast<uint16_t*>(b)[i] = stochastic_bf16_bits(__float_as_uint(bi[u]), random & 0xFFFFu);
          }
        } else {
          w[i] = static_cast<P>(wi[u]);
          if (has_momentum) b[i] = static_cast<B>(bi[u]);
        }
      }
    }
  }
}

// Appends tensor t's chunks (kChunkElems elements each) to the work list.
inline void append_chunks(std::vector<ChunkArgs>& chunks, int64_t t, int64_t numel) {
  for (int64_t begin = 0; begin < numel; begin += kChunkElems) {
    chunks.push_back({t, begin, std::min(begin + kChunkElems, numel)});
  }
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

// Bytes one kernel parameter carries (CUDA allows 4 KB of parameters per launch).
constexpr size_t kParamBytes = 3968;
struct ParamBytes {
  uint8_t bytes[kParamBytes];
};

__global__ void write_bytes_kernel(uint8_t* out, ParamBytes in, int64_t count) {
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) out[i] = in.bytes[i];
}

// Copies host arrays (pointer, bytes) to `device` in one buffer, asynchronously on the current stream: from a
// pinned buffer, which the caching host allocator keeps alive until the copy has run; or, while the stream is
// captured in a CUDA graph, in the parameters of small kernels, which the graph keeps by value (a copy from host
// memory would be replayed from memory that is not kept).
inline DeviceTables upload(const at::Device& device, std::initializer_list<std::pair<const void*, size_t>> parts) {
  DeviceTables tables;
  size_t total = 0;
  for (const auto& part : parts) {
    tables.offsets.push_back(total);
    total += part.second;
  }
  const bool capturing = c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
  at::Tensor host =
      at::empty({static_cast<int64_t>(total)}, at::TensorOptions().dtype(at::kByte).pinned_memory(!capturing));
  size_t index = 0;
  for (const auto& part : parts) {
    std::memcpy(host.data_ptr<uint8_t>() + tables.offsets[index++], part.first, part.second);
  }
  tables.buffer = at::empty({host.numel()}, at::TensorOptions().dtype(at::kByte).device(device));
  if (!capturing) {
    tables.buffer.copy_(host, /*non_blocking=*/true);
    return tables;
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  for (size_t begin = 0; begin < total; begin += kParamBytes) {
    ParamBytes piece;
    const size_t count = std::min(kParamBytes, total - begin);
    std::memcpy(piece.bytes, host.data_ptr<uint8_t>() + begin, count);
    write_bytes_kernel<<<1, 256, 0, stream>>>(tables.buffer.data_ptr<uint8_t>() + begin, piece,
                                               static_cast<int64_t>(count));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return tables;
}

// After the update (whose every block read the counts): each stochastically rounded tensor counts its step,
// unless the step was skipped.
__global__ void advance_rounding_steps_kernel(const TensorArgs* tensors, int64_t n, const float* found_inf) {
  if (skipped(found_inf)) return;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < n;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (tensors[t].rounding_step != nullptr) ++*tensors[t].rounding_step;
  }
}

template <typename P, typename B, Masters kMasters>
void launch(const TensorArgs* tensors, int64_t n, const ChunkArgs* chunks, const GroupHParams* groups,
            double* partials, int64_t num_chunks, bool any_lars, bool any_stochastic, StepScalars scalars,
            cudaStream_t stream) {
  if (any_lars && scalars.lars_sums == nullptr) {
    norm_kernel<P, kMasters><<<num_chunks, kThreads, 0, stream>>>(tensors, chunks, groups, partials, scalars);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  update_kernel<P, B, kMasters><<<num_chunks, kThreads, 0, stream>>>(tensors, chunks, groups, partials, scalars);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (any_stochastic) {
    advance_rounding_steps_kernel<<<(n + 255) / 256, 256, 0, stream>>>(tensors, n, scalars.found_inf);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// The CUDA kernel of lightning_fusedsgd::sgd_step (the op: sgd_step_op in bucket.h).
void run_cuda(const StepArgs& a, const BucketArgs& bucket) {
  const at::TensorList params = a.params;
  if (params.empty()) return;
  const int64_t n = static_cast<int64_t>(params.size());
  const at::Device device = params[0].device();
  TORCH_CHECK(device.is_cuda(), "lightning_fusedsgd::sgd_step (CUDA): CUDA tensors only");

  std::vector<TensorArgs> tensors(n);
  std::vector<ChunkArgs> chunks;
  bool any_stochastic = false;
  for (int64_t t = 0; t < n; ++t) {
    const at::Tensor& p = params[t];
    TensorArgs& args = tensors[t];
    args.param = p.data_ptr();
    args.grad = a.grads[t].data_ptr();
    args.buffer = bucket.buffer_slot[t] >= 0 ? a.momentum_buffers[bucket.buffer_slot[t]].data_ptr() : nullptr;
    args.master = bucket.masters != Masters::kNone ? a.master_params[t].data_ptr() : nullptr;
    args.rounding_step =
        bucket.step_slot[t] >= 0 ? a.rounding_steps[bucket.step_slot[t]].data_ptr<int64_t>() : nullptr;
    any_stochastic = any_stochastic || args.rounding_step != nullptr;
    args.group = a.tensor_group[t];
    args.first = a.first_step[t] ? 1 : 0;
    args.lars = lars_adapts(bucket.groups[a.tensor_group[t]]) ? 1 : 0;
    args.first_chunk = static_cast<int64_t>(chunks.size());
    append_chunks(chunks, t, p.numel());
    args.num_chunks = static_cast<int64_t>(chunks.size()) - args.first_chunk;
  }
  if (chunks.empty()) return;
  const StepScalars scalars{a.grad_scale.has_value() ? a.grad_scale->data_ptr<float>() : nullptr,
                            a.found_inf.has_value() ? a.found_inf->data_ptr<float>() : nullptr,
                            a.grad_sq_sum.has_value() ? a.grad_sq_sum->data_ptr<double>() : nullptr,
                            a.max_grad_norm.value_or(0.0),
                            a.lars_sq_sums.has_value() ? a.lars_sq_sums->data_ptr<double>() : nullptr,
                            a.lrs.has_value() ? a.lrs->data_ptr<double>() : nullptr};

  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const DeviceTables tables = upload(device, {{tensors.data(), tensors.size() * sizeof(TensorArgs)},
                                               {chunks.data(), chunks.size() * sizeof(ChunkArgs)},
                                               {bucket.groups.data(), bucket.groups.size() * sizeof(GroupHParams)}});
  const auto* tensor_args = tables.table<TensorArgs>(0);
  const auto* chunk_args = tables.table<ChunkArgs>(1);
  const auto* group_args = tables.table<GroupHParams>(2);
  const int64_t num_chunks = static_cast<int64_t>(chunks.size());
  at::Tensor partials = bucket.any_lars
                            ? at::empty({2 * num_chunks}, at::TensorOptions().dtype(at::kDouble).device(device))
                            : at::Tensor();
  double* partial_ptr = bucket.any_lars ? partials.data_ptr<double>() : nullptr;

  dispatch_bucket_types(params[0].scalar_type(), bucket.masters, [&](auto param, auto buffer, auto masters) {
    launch<decltype(param), decltype(buffer), decltype(masters)::value>(tensor_args, n, chunk_args, group_args,
                                                                        partial_ptr, num_chunks, bucket.any_lars,
                                                                        any_stochastic, scalars, stream);
  });
}

// lars_sq_sums, pass 1: each chunk of a LARS tensor writes its sums of w^2, t^2 and w t (lars_norm_term before
// the norm clip, sgd_math.h), in double; other chunks leave their zeros.
template <typename P, Masters kMasters>
__global__ void __launch_bounds__(kThreads)
    lars_sums_kernel(const TensorArgs* tensors, const ChunkArgs* chunks, const GroupHParams* groups,
                     double* partials, const float* grad_scale) {
  using O = typename OpMath<P>::type;
  const ChunkArgs chunk = chunks[blockIdx.x];
  const TensorArgs t = tensors[chunk.tensor];
  if (!t.lars) return;
  const GroupHParams& h = groups[t.group];
  const Coeffs<O> c = make_coeffs<O>(h, inverse_scale_of(grad_scale), /*clip=*/1.0, false);  // before the clip
  const O weight_decay = static_cast<O>(h.weight_decay);
  const P* w = static_cast<const P*>(t.param);
  const P* g = static_cast<const P*>(t.grad);
  double sum[kNumLarsSums] = {0, 0, 0};
  for (int64_t i = chunk.begin + threadIdx.x; i < chunk.end; i += kThreads) {
    const O wi = load_weight<kMasters>(w, t.master, i);
    const O ti = lars_norm_term<true, O>(wi, static_cast<O>(g[i]), c, weight_decay, h.lars_decayed_grad);
    sum[0] += static_cast<double>(wi) * wi;
    sum[1] += static_cast<double>(ti) * ti;
    sum[2] += static_cast<double>(wi) * ti;
  }
  __shared__ double scratch[kThreads / 32];
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
  __shared__ double scratch[kThreads / 32];
  for (int j = 0; j < kNumLarsSums; ++j) {
    const double total = block_sum(sum[j], scratch);
    if (threadIdx.x == 0) rows[kNumLarsSums * blockIdx.x + j] = total;
  }
}

// lightning_fusedsgd::lars_sq_sums for CUDA tensors: a float64 [n, kNumLarsSums] table on the device (zeros for
// tensors without LARS), with no host sync.
at::Tensor lars_sq_sums_cuda(at::TensorList params, at::TensorList grads, at::TensorList master_params,
                             const at::Tensor& group_hparams, at::IntArrayRef tensor_group,
                             const std::optional<at::Tensor>& grad_scale) {
  const NormInputs checked = check_norm_inputs(params, grads, master_params, group_hparams, tensor_group, grad_scale);
  const std::vector<GroupHParams>& groups = checked.groups;
  TORCH_CHECK(!params.empty() && params[0].is_cuda(), "lightning_fusedsgd::lars_sq_sums (CUDA): CUDA tensors only");
  const int64_t n = static_cast<int64_t>(params.size());
  const at::Device device = params[0].device();
  const auto options = at::TensorOptions().dtype(at::kDouble).device(device);
  std::vector<TensorArgs> tensors(n);
  std::vector<ChunkArgs> chunks;
  for (int64_t t = 0; t < n; ++t) {
    TensorArgs& args = tensors[t];
    args.param = params[t].data_ptr();
    args.grad = grads[t].data_ptr();
    args.buffer = nullptr;
    args.master = checked.masters != Masters::kNone ? master_params[t].data_ptr() : nullptr;
    args.rounding_step = nullptr;
    args.group = tensor_group[t];
    args.first = 0;
    args.lars = lars_adapts(groups[tensor_group[t]]) ? 1 : 0;
    args.first_chunk = static_cast<int64_t>(chunks.size());
    append_chunks(chunks, t, params[t].numel());
    args.num_chunks = static_cast<int64_t>(chunks.size()) - args.first_chunk;
  }
  at::Tensor rows = at::zeros({n, kNumLarsSums}, options);
  if (chunks.empty()) return rows;
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const DeviceTables tables = upload(device, {{tensors.data(), tensors.size() * sizeof(TensorArgs)},
                                               {chunks.data(), chunks.size() * sizeof(ChunkArgs)},
                                               {groups.data(), groups.size() * sizeof(GroupHParams)}});
  const auto* tensor_args = tables.table<TensorArgs>(0);
  const auto* chunk_args = tables.table<ChunkArgs>(1);
  const auto* group_args = tables.table<GroupHParams>(2);
  const int64_t num_chunks = static_cast<int64_t>(chunks.size());
  at::Tensor partials = at::zeros({num_chunks, kNumLarsSums}, options);
  const float* scale = grad_scale.has_value() ? grad_scale->data_ptr<float>() : nullptr;
  dispatch_bucket_types(params[0].scalar_type(), checked.masters, [&](auto param, auto, auto masters) {
    lars_sums_kernel<decltype(param), decltype(masters)::value><<<num_chunks, kThreads, 0, stream>>>(
        tensor_args, chunk_args, group_args, partials.data_ptr<double>(), scale);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  lars_rows_kernel<<<n, kThreads, 0, stream>>>(tensor_args, partials.data_ptr<double>(), rows.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return rows;
}

// grad_sq_sum: each block sums the squares of one chunk in double, then the partials are added on the device.
template <typename P>
__global__ void __launch_bounds__(kThreads)
    grad_sq_sum_kernel(const P* const* grads, const ChunkArgs* chunks, double* partials) {
  const ChunkArgs chunk = chunks[blockIdx.x];
  const P* g = grads[chunk.tensor];
  double sum = 0;
  for (int64_t i = chunk.begin + threadIdx.x; i < chunk.end; i += kThreads) {
    const double gi = static_cast<double>(g[i]);
    sum += gi * gi;
  }
  __shared__ double scratch[kThreads / 32];
  const double total = block_sum(sum, scratch);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

// lightning_fusedsgd::grad_sq_sum for CUDA tensors: a float64 scalar on the device, with no host sync.
at::Tensor grad_sq_sum_cuda(at::TensorList grads) {
  check_grads(grads);
  TORCH_CHECK(!grads.empty() && grads[0].is_cuda(), "lightning_fusedsgd::grad_sq_sum (CUDA): CUDA tensors only");
  const at::Device device = grads[0].device();
  std::vector<const void*> pointers;
  std::vector<ChunkArgs> chunks;
  for (int64_t t = 0; t < static_cast<int64_t>(grads.size()); ++t) {
    pointers.push_back(grads[t].data_ptr());
    append_chunks(chunks, t, grads[t].numel());
  }
  const auto options = at::TensorOptions().dtype(at::kDouble).device(device);
  if (chunks.empty()) return at::zeros({}, options);
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const DeviceTables tables = upload(
      device, {{pointers.data(), pointers.size() * sizeof(void*)}, {chunks.data(), chunks.size() * sizeof(ChunkArgs)}});
  const int64_t num_chunks = static_cast<int64_t>(chunks.size());
  at::Tensor partials = at::empty({num_chunks}, options);
  dispatch_bucket_types(grads[0].scalar_type(), Masters::kNone, [&](auto grad, auto, auto) {
    using P = decltype(grad);
    grad_sq_sum_kernel<P><<<num_chunks, kThreads, 0, stream>>>(tables.table<const P*>(0), tables.table<ChunkArgs>(1),
                                                               partials.data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return partials.sum();
}

__global__ void schedule_kernel(double* lrs, int64_t* position, const double* schedule, int64_t length,
                                const double* peaks, int64_t groups, const bool* applied, bool advance) {
  schedule_step(lrs, position, schedule, length, peaks, groups, applied, advance);
}

// lightning_fusedsgd::schedule_lrs for CUDA tensors: one thread runs schedule_step (schedule.h) on the device.
void schedule_lrs_cuda(const at::Tensor& lrs, const at::Tensor& position, const at::Tensor& schedule,
                       const at::Tensor& peaks, const std::optional<at::Tensor>& applied, bool advance) {
  check_schedule_inputs(lrs, position, schedule, peaks, applied);
  TORCH_CHECK(lrs.is_cuda(), "lightning_fusedsgd::schedule_lrs (CUDA): CUDA tensors only");
  const c10::cuda::CUDAGuard guard(lrs.device());
  schedule_kernel<<<1, 1, 0, c10::cuda::getCurrentCUDAStream()>>>(
      lrs.data_ptr<double>(), position.data_ptr<int64_t>(), schedule.data_ptr<double>(), schedule.numel(),
      peaks.data_ptr<double>(), lrs.numel(), applied.has_value() ? applied->data_ptr<bool>() : nullptr, advance);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace lfsgd

TORCH_LIBRARY_IMPL(lightning_fusedsgd, CUDA, m) {
  m.impl("sgd_step", &lfsgd::sgd_step_op<lfsgd::run_cuda>);
  m.impl("grad_sq_sum", &lfsgd::grad_sq_sum_cuda);
  m.impl("lars_sq_sums", &lfsgd::lars_sq_sums_cuda);
  m.impl("schedule_lrs", &lfsgd::schedule_lrs_cuda);
}
