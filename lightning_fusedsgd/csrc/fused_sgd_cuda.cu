// Multi-tensor SGD/LARS for CUDA tensors: one launch per (device, dtype) bucket over a work list of
// fixed-size chunks across all tensors (two launches with LARS: norms, then update). The math lives in
// sgd_math.h; the CPU twin is fused_sgd.cpp. Nothing here reads device memory from the host: the grad
// scale, found_inf and the LARS norms stay on the device, so a step never synchronizes.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <vector>

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
  float* master;  // fp32 master weights, or null
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

// Same rounding as GradScaler.unscale_ and the CPU kernel: the reciprocal in double, rounded to float.
__device__ inline double inverse_scale(const float* grad_scale) {
  return grad_scale == nullptr ? 1.0 : static_cast<double>(static_cast<float>(1.0 / *grad_scale));
}

__device__ inline bool skipped(const float* found_inf) { return found_inf != nullptr && *found_inf != 0.0f; }

// The weight of element i in opmath: the param, or its master re-synced with the param (sgd_math.h).
template <bool kMaster, typename P>
__device__ inline typename OpMath<P>::type load_weight(const P* w, const float* m, int64_t i) {
  if constexpr (kMaster) {
    const P param = w[i];
    return synced_master(m[i], static_cast<P>(m[i]).x, param.x, static_cast<float>(param));
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
template <typename P, bool kMaster>
__global__ void __launch_bounds__(kThreads)
    norm_kernel(const TensorArgs* tensors, const ChunkArgs* chunks, const double* hparams, double* partials,
                const float* grad_scale, const float* found_inf) {
  using O = typename OpMath<P>::type;
  if (skipped(found_inf)) return;
  const ChunkArgs chunk = chunks[blockIdx.x];
  const TensorArgs t = tensors[chunk.tensor];
  if (!t.lars) return;
  const double* hp = hparams + t.group * kNumHParams;
  const bool decayed = hp[kLarsDecayedGrad] != 0.0;
  const double inv_scale = inverse_scale(grad_scale);
  const O grad_mul = static_cast<O>(hp[kMaximize] != 0.0 ? -inv_scale : inv_scale);
  const O weight_decay = static_cast<O>(hp[kWeightDecay]);
  const P* w = static_cast<const P*>(t.param);
  const P* g = static_cast<const P*>(t.grad);
  // Squares are summed in double (fp32 squares underflow below about 1e-23 and overflow above 1e19).
  double sum_w = 0, sum_g = 0;
  for (int64_t i = chunk.begin + threadIdx.x; i < chunk.end; i += kThreads) {
    const O wi = load_weight<kMaster>(w, t.master, i);
    const O gi = decayed ? static_cast<O>(g[i]) * grad_mul + weight_decay * wi : static_cast<O>(g[i]);
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
template <typename P, typename B, bool kMaster>
__global__ void __launch_bounds__(kThreads)
    update_kernel(const TensorArgs* tensors, const ChunkArgs* chunks, const double* hparams,
                  const double* partials, const float* grad_scale, const float* found_inf) {
  using O = typename OpMath<P>::type;
  if (skipped(found_inf)) return;
  const ChunkArgs chunk = chunks[blockIdx.x];
  const TensorArgs t = tensors[chunk.tensor];
  const double* hp = hparams + t.group * kNumHParams;
  const double inv_scale = inverse_scale(grad_scale);
  const bool wd_after = hp[kWdAfterMomentum] != 0.0;
  const bool has_momentum = hp[kMomentum] != 0.0;
  Coeffs<O> c{static_cast<O>(hp[kMaximize] != 0.0 ? -inv_scale : inv_scale),
              static_cast<O>(wd_after ? 0.0 : hp[kWeightDecay]),
              O(1),
              static_cast<O>(hp[kMomentum]),
              static_cast<O>(1.0 - hp[kDampening]),
              static_cast<O>(wd_after ? hp[kWeightDecay] : 0.0),
              static_cast<O>(hp[kLr]),
              has_momentum,
              t.first != 0,
              hp[kNesterov] != 0.0};
  if (t.lars) {
    __shared__ O trust;
    __shared__ double scratch[kThreads / 32];
    double part_w = 0, part_g = 0;
    for (int64_t k = t.first_chunk + threadIdx.x; k < t.first_chunk + t.num_chunks; k += kThreads) {
      part_w += partials[2 * k];
      part_g += partials[2 * k + 1];
    }
    const double sum_w = block_sum(part_w, scratch);
    const double sum_g = block_sum(part_g, scratch);
    if (threadIdx.x == 0) {
      const bool decayed = hp[kLarsDecayedGrad] != 0.0;
      const double g_norm = decayed ? sqrt(sum_g) : sqrt(sum_g) * fabs(inv_scale);
      trust = static_cast<O>(trust_ratio(sqrt(sum_w), g_norm, hp[kWeightDecay], hp[kTrustCoefficient],
                                         hp[kLarsEps], decayed, hp[kTrustClip] != 0.0, hp[kLr]));
    }
    __syncthreads();
    c.trust = trust;
  }
  P* w = static_cast<P*>(t.param);
  const P* g = static_cast<const P*>(t.grad);
  B* b = static_cast<B*>(t.buffer);
  for (int64_t base = chunk.begin + threadIdx.x; base < chunk.end; base += kThreads * kUnroll) {
    O wi[kUnroll], gi[kUnroll], bi[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * kThreads;
      if (i < chunk.end) {
        wi[u] = load_weight<kMaster>(w, t.master, i);
        gi[u] = static_cast<O>(g[i]);
        bi[u] = has_momentum && !c.first ? static_cast<O>(b[i]) : O(0);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * kThreads;
      if (i < chunk.end) {
        sgd_element(wi[u], gi[u], bi[u], c);
        if (kMaster) t.master[i] = static_cast<float>(wi[u]);
        w[i] = static_cast<P>(wi[u]);
        if (has_momentum) b[i] = static_cast<B>(bi[u]);
      }
    }
  }
}

void check_same_layout(const at::Tensor& param, const at::Tensor& other, const char* what) {
  TORCH_CHECK(other.device() == param.device() && other.sizes() == param.sizes() &&
                  other.strides() == param.strides(),
              "lightning_fusedsgd CUDA kernel: ", what, " must match its parameter's device, shape and strides");
}

const float* scalar_arg(const std::optional<at::Tensor>& value, const at::Device& device, const char* what) {
  if (!value.has_value()) return nullptr;
  TORCH_CHECK(value->device() == device && value->scalar_type() == at::kFloat && value->numel() == 1,
              "lightning_fusedsgd CUDA kernel: ", what, " must be a one-element float32 tensor on ", device);
  return value->data_ptr<float>();
}

template <typename P, typename B, bool kMaster>
void launch(const TensorArgs* tensors, const ChunkArgs* chunks, const double* hparams, double* partials,
            int64_t num_chunks, bool any_lars, const float* grad_scale, const float* found_inf,
            cudaStream_t stream) {
  if (any_lars) {
    norm_kernel<P, kMaster>
        <<<num_chunks, kThreads, 0, stream>>>(tensors, chunks, hparams, partials, grad_scale, found_inf);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  update_kernel<P, B, kMaster>
      <<<num_chunks, kThreads, 0, stream>>>(tensors, chunks, hparams, partials, grad_scale, found_inf);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void sgd_step_cuda(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                   const std::vector<std::optional<at::Tensor>>& momentum_buffers,
                   const std::vector<at::Tensor>& master_params, const at::Tensor& group_hparams,
                   const std::vector<int64_t>& tensor_group, const std::vector<bool>& first_step,
                   const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  if (params.empty()) return;
  const int64_t n = static_cast<int64_t>(params.size());
  const at::Device device = params[0].device();
  const bool master = !master_params.empty();
  TORCH_CHECK(device.is_cuda(), "lightning_fusedsgd CUDA kernel: CUDA tensors only");
  TORCH_CHECK(static_cast<int64_t>(grads.size()) == n && static_cast<int64_t>(momentum_buffers.size()) == n &&
                  static_cast<int64_t>(tensor_group.size()) == n && static_cast<int64_t>(first_step.size()) == n,
              "lightning_fusedsgd CUDA kernel: one grad, buffer slot, group and first flag per param");
  TORCH_CHECK(!master || static_cast<int64_t>(master_params.size()) == n,
              "lightning_fusedsgd CUDA kernel: master_params must be empty or one per param");
  TORCH_CHECK(group_hparams.device().is_cpu() && group_hparams.scalar_type() == at::kDouble &&
                  group_hparams.dim() == 2 && group_hparams.size(1) == kNumHParams && group_hparams.is_contiguous(),
              "lightning_fusedsgd CUDA kernel: group_hparams must be a contiguous CPU float64 [groups, ",
              kNumHParams, "] table");
  const int64_t num_groups = group_hparams.size(0);
  const double* hp = group_hparams.data_ptr<double>();

  std::vector<TensorArgs> tensors(n);
  std::vector<ChunkArgs> chunks;
  bool any_lars = false;
  for (int64_t t = 0; t < n; ++t) {
    const at::Tensor& p = params[t];
    const int64_t group = tensor_group[t];
    TORCH_CHECK(group >= 0 && group < num_groups, "lightning_fusedsgd CUDA kernel: tensor_group out of range");
    TORCH_CHECK(p.device() == device && p.scalar_type() == params[0].scalar_type(),
                "lightning_fusedsgd CUDA kernel: one device and dtype per call");
    TORCH_CHECK(p.is_non_overlapping_and_dense(), "lightning_fusedsgd CUDA kernel: params must be dense");
    check_same_layout(p, grads[t], "grad");
    TORCH_CHECK(grads[t].scalar_type() == p.scalar_type(), "lightning_fusedsgd CUDA kernel: grad dtype");
    const bool has_momentum = hp[group * kNumHParams + kMomentum] != 0.0;
    TORCH_CHECK(momentum_buffers[t].has_value() == has_momentum,
                "lightning_fusedsgd CUDA kernel: a momentum buffer is passed exactly when momentum != 0");
    TensorArgs& args = tensors[t];
    args.param = p.data_ptr();
    args.grad = grads[t].data_ptr();
    args.buffer = nullptr;
    if (has_momentum) {
      check_same_layout(p, *momentum_buffers[t], "momentum buffer");
      TORCH_CHECK(momentum_buffers[t]->scalar_type() == (master ? at::kFloat : p.scalar_type()),
                  "lightning_fusedsgd CUDA kernel: momentum buffer dtype");
      args.buffer = momentum_buffers[t]->data_ptr();
    }
    args.master = nullptr;
    if (master) {
      check_same_layout(p, master_params[t], "master param");
      TORCH_CHECK(master_params[t].scalar_type() == at::kFloat, "lightning_fusedsgd CUDA kernel: fp32 masters");
      args.master = master_params[t].data_ptr<float>();
    }
    args.group = group;
    args.first = first_step[t] ? 1 : 0;
    args.lars = hp[group * kNumHParams + kLars] != 0.0 ? 1 : 0;
    any_lars = any_lars || args.lars;
    args.first_chunk = static_cast<int64_t>(chunks.size());
    for (int64_t begin = 0; begin < p.numel(); begin += kChunkElems) {
      chunks.push_back({t, begin, std::min(begin + kChunkElems, p.numel())});
    }
    args.num_chunks = static_cast<int64_t>(chunks.size()) - args.first_chunk;
  }
  if (chunks.empty()) return;
  const float* scale_ptr = scalar_arg(grad_scale, device, "grad_scale");
  const float* found_inf_ptr = scalar_arg(found_inf, device, "found_inf");

  // Tensor table, chunk list and hyperparameters travel in one pinned buffer and one asynchronous copy;
  // the caching host allocator keeps the buffer alive until the copy has run.
  const size_t tensor_bytes = tensors.size() * sizeof(TensorArgs);
  const size_t chunk_bytes = chunks.size() * sizeof(ChunkArgs);
  const size_t hparam_bytes = static_cast<size_t>(num_groups) * kNumHParams * sizeof(double);
  at::Tensor host = at::empty({static_cast<int64_t>(tensor_bytes + chunk_bytes + hparam_bytes)},
                              at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  uint8_t* bytes = host.data_ptr<uint8_t>();
  std::memcpy(bytes, tensors.data(), tensor_bytes);
  std::memcpy(bytes + tensor_bytes, chunks.data(), chunk_bytes);
  std::memcpy(bytes + tensor_bytes + chunk_bytes, hp, hparam_bytes);

  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor args = at::empty({host.numel()}, at::TensorOptions().dtype(at::kByte).device(device));
  args.copy_(host, /*non_blocking=*/true);
  const uint8_t* dev = args.data_ptr<uint8_t>();
  const auto* tensor_args = reinterpret_cast<const TensorArgs*>(dev);
  const auto* chunk_args = reinterpret_cast<const ChunkArgs*>(dev + tensor_bytes);
  const auto* hparam_args = reinterpret_cast<const double*>(dev + tensor_bytes + chunk_bytes);
  const int64_t num_chunks = static_cast<int64_t>(chunks.size());
  at::Tensor partials = any_lars ? at::empty({2 * num_chunks}, at::TensorOptions().dtype(at::kDouble).device(device))
                                 : at::Tensor();
  double* partial_ptr = any_lars ? partials.data_ptr<double>() : nullptr;

  auto run = [&](auto param_tag, auto buffer_tag, auto master_tag) {
    using P = decltype(param_tag);
    using B = decltype(buffer_tag);
    launch<P, B, decltype(master_tag)::value>(tensor_args, chunk_args, hparam_args, partial_ptr, num_chunks,
                                              any_lars, scale_ptr, found_inf_ptr, stream);
  };
  using NoMaster = std::false_type;
  using Master = std::true_type;
  switch (params[0].scalar_type()) {
    case at::kFloat:
      TORCH_CHECK(!master, "lightning_fusedsgd CUDA kernel: master weights are for bf16/fp16 params");
      return run(float{}, float{}, NoMaster{});
    case at::kDouble:
      TORCH_CHECK(!master, "lightning_fusedsgd CUDA kernel: master weights are for bf16/fp16 params");
      return run(double{}, double{}, NoMaster{});
    case at::kBFloat16:
      return master ? run(c10::BFloat16{}, float{}, Master{}) : run(c10::BFloat16{}, c10::BFloat16{}, NoMaster{});
    case at::kHalf:
      return master ? run(c10::Half{}, float{}, Master{}) : run(c10::Half{}, c10::Half{}, NoMaster{});
    default:
      TORCH_CHECK(false, "lightning_fusedsgd CUDA kernel: unsupported dtype ", params[0].scalar_type());
  }
}

}  // namespace lfsgd
