// The benchmarks' data-movement floor, built by bench/common.py (not part of the product extension): the
// step's memory traffic with no math, over lightning_fusedsgd's own work list (csrc/work_list.h).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "bucket.h"
#include "work_list.h"

namespace lfsgd {
namespace {

// The data-movement floor: the same work list, waves, parallel region, bytes read and written and prefetches as
// sgd_step with momentum, and no arithmetic (bit moves only). Benchmarks divide step time by this. With `lars`, each
// wave that has LARS tensors first reads their w and g, as the norm pass does, XOR-reduced into per-chunk
// partials so the reads are kept (their XOR is returned); the values left behind are the plain floor's.
// kCompensation: a fourth stream of the params' dtype read and written too (16-bit params' Kahan compensations,
// or fp32 params' average of the weights);
// kMaster: 16-bit params with fp32 master weights (companions in fp32), the masters' bytes moved.
template <typename W, typename G, bool kMaster, bool kCompensation = false>
int64_t floor_bucket(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                     at::TensorList companions, const std::vector<bool>& lars) {
  const int32_t n = static_cast<int32_t>(params.size());
  std::vector<W*> w_ptr(n), b_ptr(n), c_ptr(n);
  std::vector<const G*> g_ptr(n);
  std::vector<G*> p_ptr(n);
  for (int32_t t = 0; t < n; ++t) {
    const at::Tensor& weights = kMaster ? companions[t] : params[t];
    w_ptr[t] = static_cast<W*>(weights.data_ptr());
    b_ptr[t] = static_cast<W*>(momentum_buffers[t].data_ptr());
    c_ptr[t] = kCompensation ? static_cast<W*>(companions[t].data_ptr()) : nullptr;
    g_ptr[t] = static_cast<const G*>(grads[t].data_ptr());
    p_ptr[t] = static_cast<G*>(params[t].data_ptr());
  }
  const WorkList work = make_work_list(params, lars);
  std::vector<W> partial(work.chunks.size());

  auto read_chunk = [&](const Chunk& chunk) {
    const W* w = w_ptr[chunk.tensor];
    const G* g = g_ptr[chunk.tensor];
    W sum = 0;
#pragma omp simd reduction(^ : sum)
    for (int64_t i = chunk.begin; i < chunk.end; ++i) sum ^= w[i] ^ static_cast<W>(g[i]);
    return sum;
  };

  auto move_chunk = [&](const Chunk& chunk) {
    W* w = w_ptr[chunk.tensor];
    W* b = b_ptr[chunk.tensor];
    W* c = c_ptr[chunk.tensor];
    const G* g = g_ptr[chunk.tensor];
    G* p = p_ptr[chunk.tensor];
    const auto move = [&](int64_t i) __attribute__((always_inline)) {
      const W w_old = w[i];
      const G g_i = g[i];
      if (kCompensation) c[i] = c[i] ^ static_cast<W>(g_i);
      if (kMaster) {
        w[i] = static_cast<W>(g_i) << 16;
        p[i] = g_i;
      } else {
        w[i] = static_cast<W>(g_i);
      }
      b[i] = w_old ^ b[i];
    };
    // As the kernel's update loop: blocks of a cache line of params, each asking for the lines kPrefetchElems
    // ahead in every stream, then the tail.
    constexpr int64_t kBlock = 64 / static_cast<int64_t>(sizeof(G));
    int64_t begin = chunk.begin;
    for (; begin + kBlock <= chunk.end; begin += kBlock) {
      prefetch_ahead<1>(w, begin, kBlock);
      prefetch_ahead<0>(g, begin, kBlock);
      prefetch_ahead<1>(b, begin, kBlock);
      if (kMaster) prefetch_ahead<1>(p, begin, kBlock);
      if (kCompensation) prefetch_ahead<1>(c, begin, kBlock);
#pragma omp simd
      for (int64_t i = begin; i < begin + kBlock; ++i) move(i);
    }
#pragma omp simd
    for (int64_t i = begin; i < chunk.end; ++i) move(i);
  };

#pragma omp parallel num_threads(num_threads_for(work))
  {
    for (const Wave& wave : work.waves) {
      if (wave.needs_norms) {
#pragma omp for schedule(static)
        for (int64_t c = wave.chunk_begin; c < wave.chunk_end; ++c) {
          if (lars[work.chunks[c].tensor]) partial[c] = read_chunk(work.chunks[c]);
        }
      }
#pragma omp for schedule(static)
      for (int64_t c = wave.chunk_begin; c < wave.chunk_end; ++c) move_chunk(work.chunks[c]);
    }
  }
  W checksum = 0;
  for (W value : partial) checksum ^= value;
  return static_cast<int64_t>(checksum);
}

// `lars`: which tensors get the norm pass's reads (empty: none, the plain floor).
int64_t floor_step(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                   at::TensorList companions, const c10::List<bool>& lars) {
  if (params.empty()) return 0;
  // companions: fp32 master weights of 16-bit params, or a fourth stream of the params' dtype (Kahan
  // compensations, averages of the weights).
  const bool compensation = !companions.empty() && companions[0].scalar_type() == params[0].scalar_type();
  const bool master = !companions.empty() && !compensation;
  TORCH_CHECK(grads.size() == params.size() && momentum_buffers.size() == params.size() &&
                  (companions.empty() || companions.size() == params.size()),
              "floor_step: one grad, momentum buffer (and master or compensation, or none) per param");
  for (size_t t = 0; t < params.size(); ++t) {
    const at::Tensor& weights = master ? companions[t] : params[t];
    if (compensation) check_same_layout(params[t], companions[t], "compensation");
    TORCH_CHECK(params[t].device().is_cpu() && params[t].scalar_type() == params[0].scalar_type() &&
                    params[t].is_non_overlapping_and_dense(),
                "floor_step: dense CPU params of one dtype");
    check_same_layout(params[t], grads[t], "grad");
    check_same_layout(params[t], momentum_buffers[t], "momentum buffer");
    check_same_layout(params[t], weights, "master param");
    TORCH_CHECK(grads[t].scalar_type() == params[t].scalar_type() &&
                    momentum_buffers[t].scalar_type() == weights.scalar_type() &&
                    (!master || weights.scalar_type() == at::kFloat),
                "floor_step: grads match their params' dtype, buffers their weights'");
  }
  TORCH_CHECK(lars.empty() || lars.size() == params.size(), "floor_step: lars must be empty or one flag per param");
  const std::vector<bool> flags = lars.empty() ? std::vector<bool>(params.size(), false) : lars.vec();
  switch (at::elementSize(params[0].scalar_type())) {
    case 2:
      if (compensation) {
        return floor_bucket<uint16_t, uint16_t, false, true>(params, grads, momentum_buffers, companions, flags);
      }
      return master ? floor_bucket<uint32_t, uint16_t, true>(params, grads, momentum_buffers, companions,
                                                             flags)
                    : floor_bucket<uint16_t, uint16_t, false>(params, grads, momentum_buffers, companions,
                                                              flags);
    case 4:
      if (compensation) {
        return floor_bucket<uint32_t, uint32_t, false, true>(params, grads, momentum_buffers, companions, flags);
      }
      return floor_bucket<uint32_t, uint32_t, false>(params, grads, momentum_buffers, companions, flags);
    case 8:
      return floor_bucket<uint64_t, uint64_t, false>(params, grads, momentum_buffers, companions, flags);
    default:
      TORCH_CHECK(false, "floor_step: unsupported dtype ", params[0].scalar_type());
  }
}

// The floor of a schedule-free switch (train() / eval()): the same work list and parallel region as the
// schedule_free_switch op, reading each param and its z and writing the param (12 bytes per fp32 parameter), no
// arithmetic.
void floor_switch(at::TensorList params, at::TensorList zs) {
  TORCH_CHECK(zs.size() == params.size(), "floor_switch: one z per param");
  for (size_t t = 0; t < params.size(); ++t) {
    TORCH_CHECK(params[t].device().is_cpu() && params[t].scalar_type() == at::kFloat &&
                    params[t].is_non_overlapping_and_dense(),
                "floor_switch: dense CPU fp32 params");
    check_same_layout(params[t], zs[t], "z");
    TORCH_CHECK(zs[t].scalar_type() == at::kFloat, "floor_switch: fp32 z");
  }
  const WorkList work = make_work_list(params, std::vector<bool>(params.size(), false));
#pragma omp parallel for schedule(static) num_threads(num_threads_for(work))
  for (int64_t c = 0; c < static_cast<int64_t>(work.chunks.size()); ++c) {
    const Chunk& chunk = work.chunks[c];
    uint32_t* w = static_cast<uint32_t*>(params[chunk.tensor].data_ptr());
    const uint32_t* z = static_cast<const uint32_t*>(zs[chunk.tensor].data_ptr());
#pragma omp simd
    for (int64_t i = chunk.begin; i < chunk.end; ++i) w[i] = w[i] ^ z[i];
  }
}

}  // namespace
}  // namespace lfsgd

TORCH_LIBRARY(lightning_fusedsgd_bench, m) {
  m.def(
      "floor_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, Tensor(c!)[] companions, "
      "bool[] lars) -> int");
  m.def("floor_switch(Tensor(a!)[] params, Tensor[] zs) -> ()");
}

TORCH_LIBRARY_IMPL(lightning_fusedsgd_bench, CPU, m) {
  m.impl("floor_step", &lfsgd::floor_step);
  m.impl("floor_switch", &lfsgd::floor_switch);
}
