// The CPU kernel's schedule: a work list of fixed-size chunks across every tensor of a bucket, in waves
// (LARS reduces a wave's norms before updating it; a step reporting its gradient norm takes them there too). Shared with the benchmarks' data-movement floor
// (bench/csrc/floor.cpp), which must move its bytes in exactly this order.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace lfsgd {

// Elements per work item: large enough to amortise scheduling, small enough to balance 2-64 threads.
constexpr int64_t kChunkElems = 16384;
// LARS processes tensors in waves of about this many elements (w + g ~ 8 MB in fp32), norms then update,
// so the update pass re-reads w and g from cache instead of memory.
constexpr int64_t kWaveElems = int64_t{1} << 20;
// Below this many elements a bucket runs on one thread: waking the pool costs more than it saves.
constexpr int64_t kParallelMinElems = 32768;

struct Chunk {
  int32_t tensor;
  int64_t begin;
  int64_t end;
};

// Appends tensor `t`'s chunks of `chunk_elems` elements (the last one ragged) to a work list: the CPU kernel's
// (Chunk) and the CUDA kernel's (a block per chunk) alike.
template <typename ChunkType, typename Index>
void append_chunks(std::vector<ChunkType>& chunks, Index t, int64_t numel, int64_t chunk_elems) {
  for (int64_t begin = 0; begin < numel; begin += chunk_elems) {
    chunks.push_back({t, begin, std::min(begin + chunk_elems, numel)});
  }
}

// A run of consecutive tensors whose norms are reduced before any of them is updated.
struct Wave {
  int64_t chunk_begin;
  int64_t chunk_end;
  bool needs_norms;
};

struct WorkList {
  std::vector<Chunk> chunks;
  std::vector<int64_t> tensor_first_chunk;  // size n + 1
  std::vector<Wave> waves;
  int64_t total_elems = 0;
};

// `norms`: whether a tensor's norms are taken before its update. Without any the whole bucket is one wave; with
// some, waves of about kWaveElems elements.
inline WorkList make_work_list(at::TensorList params, const std::vector<bool>& norms) {
  WorkList work;
  const int32_t n = static_cast<int32_t>(params.size());
  const bool any_norms = std::find(norms.begin(), norms.end(), true) != norms.end();
  work.tensor_first_chunk.reserve(n + 1);
  Wave wave{0, 0, false};
  int64_t wave_elems = 0;
  for (int32_t t = 0; t < n; ++t) {
    const int64_t numel = params[t].numel();
    work.tensor_first_chunk.push_back(static_cast<int64_t>(work.chunks.size()));
    append_chunks(work.chunks, t, numel, kChunkElems);
    work.total_elems += numel;
    wave.needs_norms = wave.needs_norms || norms[t];
    wave_elems += numel;
    if (any_norms && wave_elems >= kWaveElems) {
      wave.chunk_end = static_cast<int64_t>(work.chunks.size());
      work.waves.push_back(wave);
      wave = Wave{wave.chunk_end, wave.chunk_end, false};
      wave_elems = 0;
    }
  }
  work.tensor_first_chunk.push_back(static_cast<int64_t>(work.chunks.size()));
  wave.chunk_end = static_cast<int64_t>(work.chunks.size());
  if (wave.chunk_end > wave.chunk_begin) work.waves.push_back(wave);
  return work;
}

// How far ahead of the elements it moves a pass asks for its streams' cache lines. The hardware prefetcher alone
// leaves the loads of a loop with math in it waiting on memory: on a 2-core AVX-512 Xeon, bf16 steps took
// 1.6-1.8x as long without, fp32 steps 1.15x.
constexpr int64_t kPrefetchElems = 2048;

// Asks for the cache lines of elements [i, i + n) of p, kPrefetchElems ahead (kWrite: to be written).
template <int kWrite, typename T>
inline void prefetch_ahead(const T* p, int64_t i, int64_t n) {
  const char* first = reinterpret_cast<const char*>(p + i + kPrefetchElems);
  for (int64_t byte = 0; byte < n * static_cast<int64_t>(sizeof(T)); byte += 64) {
    __builtin_prefetch(first + byte, kWrite);
  }
}

inline int num_threads_for(const WorkList& work) {
  return work.total_elems >= kParallelMinElems ? at::get_num_threads() : 1;
}

}  // namespace lfsgd
