// How a bucket reaches the CUDA kernels (cuda_kernels.h), as apex's multi_tensor_apply keeps its launch machinery
// apart from the functors: the launch geometry, each tensor's and each chunk's arguments (TensorArgs, ChunkArgs),
// which make_work builds from a checked bucket (bucket.h) over the work list of fixed-size chunks (work_list.h),
// and the argument tables on the device (upload): one asynchronous copy from pinned memory, or, under CUDA graph
// capture, kernels' parameters, so that a replay reads no host memory. Part of fused_sgd_cuda.cu's translation
// unit (its anonymous namespace), which alone includes it.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <utility>
#include <vector>

#include "bucket.h"
#include "slots.h"
#include "work_list.h"
// Last: the emulation spells CUDA's keywords as macros.
#include "device.h"

namespace lfsgd {
namespace {

// Threads per block of the kernels over chunks (their __launch_bounds__).
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
  SlotPointers slots;  // its state, by slot (slots.h)
  int64_t group;
  int32_t first;  // first step: the kernel seeds its kGradient slots (the momentum buffer) with the gradient
  int32_t lars;
  int64_t first_chunk;  // its chunks are first_chunk .. first_chunk + num_chunks - 1 of the work list
  int64_t num_chunks;
};

struct ChunkArgs {
  int64_t tensor;
  int64_t begin;
  int64_t end;
};

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

// Bytes one kernel parameter carries (CUDA allows 4 KB of parameters per launch).
constexpr size_t kParamBytes = 3968;
struct ParamBytes {
  uint8_t bytes[kParamBytes];
};

__global__ void write_bytes_kernel(uint8_t* out, ParamBytes in, int64_t count) {
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) out[i] = in.bytes[i];
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

}  // namespace
}  // namespace lfsgd
