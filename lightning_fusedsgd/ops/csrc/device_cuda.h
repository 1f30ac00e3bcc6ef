// The device interface (device.h) on CUDA: the CUDA runtime through c10::cuda.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <utility>

#define LFSGD_DEVICE_LIBRARY lightning_fusedsgd
#define LFSGD_DEVICE_DISPATCH CUDA
#define LFSGD_SHARED(T, name, count) __shared__ T name[count]

namespace lfsgd::device {

constexpr const char* kName = "CUDA";

using Stream = cudaStream_t;
using Guard = c10::cuda::CUDAGuard;

inline bool on_device(const at::Tensor& tensor) { return tensor.is_cuda(); }

inline Stream current_stream() { return c10::cuda::getCurrentCUDAStream(); }

inline bool capturing() {
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
}

// Pinned memory is kept by the caching host allocator until the copies from it have run.
inline at::Tensor host_buffer(int64_t bytes, bool pinned) {
  return at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(pinned));
}

template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), int64_t blocks, int threads, Stream stream, Args&&... args) {
  kernel<<<blocks, threads, 0, stream>>>(std::forward<Args>(args)...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace lfsgd::device
