// Multi-tensor SGD/LARS for CPU tensors: one call per (device, dtype) bucket, a work list of fixed-size
// chunks across all tensors, and one OpenMP parallel region over it. The math lives in sgd_math.h.
#include <torch/extension.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "cached_step.h"
#include "sgd_math.h"

namespace lfsgd {
namespace {

// Elements per work item: large enough to amortise scheduling, small enough to balance 2-64 threads.
constexpr int64_t kChunkElems = 16384;
// LARS processes tensors in waves of about this many elements (w + g ~ 8 MB in fp32), norms then update,
// so the update pass re-reads w and g from cache instead of memory.
constexpr int64_t kWaveElems = int64_t{1} << 20;
// Below this many elements a bucket runs on one thread: waking the pool costs more than it saves.
constexpr int64_t kParallelMinElems = 32768;

// Loads and stores convert to and from opmath. The bf16 versions are bit operations the compiler vectorizes
// (round to nearest even, NaN kept quiet), identical to c10::BFloat16's conversions.
inline float load(const float* p, int64_t i) { return p[i]; }
inline double load(const double* p, int64_t i) { return p[i]; }
inline float load(const c10::Half* p, int64_t i) { return static_cast<float>(p[i]); }
inline float load(const c10::BFloat16* p, int64_t i) {
  const uint32_t bits = uint32_t{reinterpret_cast<const uint16_t*>(p)[i]} << 16;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// The bits of v rounded to bf16, and the bits a 16-bit param element holds.
inline uint16_t rounded_bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(v != v ? 0x7FC0u : rounded);
}
template <typename P>
inline uint16_t param_bits(const P* p, int64_t i) {
  return reinterpret_cast<const uint16_t*>(p)[i];
}

inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(double* p, int64_t i, double v) { p[i] = v; }
inline void store(c10::Half* p, int64_t i, float v) { p[i] = c10::Half(v); }
inline void store(c10::BFloat16* p, int64_t i, float v) {
  reinterpret_cast<uint16_t*>(p)[i] = rounded_bits(v);
}

// The weight of element i in opmath: the param, or its master re-synced with the param (synced_master in
// sgd_math.h). The bf16 comparison is integer work the compiler vectorizes (a NaN master may compare unequal
// and take the param's NaN: NaN either way).
template <bool kMaster, typename P>
inline typename OpMath<P>::type load_weight(const P* w, const float* m, int64_t i) {
  if constexpr (!kMaster) {
    return load(w, i);
  } else if constexpr (std::is_same_v<P, c10::BFloat16>) {
    uint32_t master;
    std::memcpy(&master, &m[i], sizeof(master));
    const uint32_t rounded = ((master + 0x7FFFu + ((master >> 16) & 1u)) >> 16) & 0xFFFFu;
    const uint32_t param = param_bits(w, i);
    const uint32_t bits = synced_master(master, rounded, param, param << 16);
    float value;
    std::memcpy(&value, &bits, sizeof(value));
    return value;
  } else {
    return synced_master(m[i], c10::Half(m[i]).x, param_bits(w, i), load(w, i));
  }
}

struct Chunk {
  int32_t tensor;
  int64_t begin;
  int64_t end;
};

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

// Without LARS the whole bucket is one wave; with LARS, waves of about kWaveElems elements.
WorkList make_work_list(const std::vector<at::Tensor>& params, const std::vector<bool>& lars) {
  WorkList work;
  const int32_t n = static_cast<int32_t>(params.size());
  const bool any_lars = std::find(lars.begin(), lars.end(), true) != lars.end();
  work.tensor_first_chunk.reserve(n + 1);
  Wave wave{0, 0, false};
  int64_t wave_elems = 0;
  for (int32_t t = 0; t < n; ++t) {
    const int64_t numel = params[t].numel();
    work.tensor_first_chunk.push_back(static_cast<int64_t>(work.chunks.size()));
    for (int64_t begin = 0; begin < numel; begin += kChunkElems) {
      work.chunks.push_back({t, begin, std::min(begin + kChunkElems, numel)});
    }
    work.total_elems += numel;
    wave.needs_norms = wave.needs_norms || lars[t];
    wave_elems += numel;
    if (any_lars && wave_elems >= kWaveElems) {
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

int num_threads_for(const WorkList& work) {
  return work.total_elems >= kParallelMinElems ? at::get_num_threads() : 1;
}

void check_same_layout(const at::Tensor& param, const at::Tensor& other, const char* what) {
  TORCH_CHECK(other.device() == param.device() && other.sizes() == param.sizes() &&
                  other.strides() == param.strides(),
              "lightning_fusedsgd kernel: ", what, " must match its parameter's device, shape and strides");
}

template <typename P, typename B, bool kMaster>
void sgd_bucket(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                const std::vector<std::optional<at::Tensor>>& momentum_buffers,
                const std::vector<at::Tensor>& master_params, const at::Tensor& group_hparams,
                const std::vector<int64_t>& tensor_group, const std::vector<bool>& first_step,
                double inv_scale) {
  using O = typename OpMath<P>::type;
  const int32_t n = static_cast<int32_t>(params.size());
  const auto hp = group_hparams.accessor<double, 2>();

  std::vector<P*> w_ptr(n);
  std::vector<const P*> g_ptr(n);
  std::vector<B*> b_ptr(n, nullptr);
  std::vector<float*> m_ptr(n, nullptr);
  std::vector<Coeffs<O>> coeffs(n);
  std::vector<bool> lars(n);
  for (int32_t t = 0; t < n; ++t) {
    const int64_t g = tensor_group[t];
    check_same_layout(params[t], grads[t], "grad");
    w_ptr[t] = params[t].data_ptr<P>();
    g_ptr[t] = grads[t].data_ptr<P>();
    const bool has_momentum = hp[g][kMomentum] != 0.0;
    TORCH_CHECK(momentum_buffers[t].has_value() == has_momentum,
                "lightning_fusedsgd kernel: a momentum buffer is passed exactly when momentum != 0");
    if (has_momentum) {
      check_same_layout(params[t], *momentum_buffers[t], "momentum buffer");
      b_ptr[t] = momentum_buffers[t]->data_ptr<B>();
    }
    if (kMaster) {
      check_same_layout(params[t], master_params[t], "master param");
      m_ptr[t] = master_params[t].data_ptr<float>();
    }
    const bool maximize = hp[g][kMaximize] != 0.0;
    const bool wd_after = hp[g][kWdAfterMomentum] != 0.0;
    const double weight_decay = hp[g][kWeightDecay];
    coeffs[t] = Coeffs<O>{static_cast<O>(maximize ? -inv_scale : inv_scale),
                          static_cast<O>(wd_after ? 0.0 : weight_decay),
                          O(1),
                          static_cast<O>(hp[g][kMomentum]),
                          static_cast<O>(1.0 - hp[g][kDampening]),
                          static_cast<O>(wd_after ? weight_decay : 0.0),
                          static_cast<O>(hp[g][kLr]),
                          has_momentum,
                          static_cast<bool>(first_step[t]),
                          hp[g][kNesterov] != 0.0};
    lars[t] = hp[g][kLars] != 0.0;
  }

  const WorkList work = make_work_list(params, lars);
  std::vector<double> w_sq(work.chunks.size()), g_sq(work.chunks.size());

  auto norm_chunk = [&](const Chunk& chunk, int64_t c) {
    const int32_t t = chunk.tensor;
    const int64_t g = tensor_group[t];
    const P* w = w_ptr[t];
    const float* m = m_ptr[t];
    const P* gr = g_ptr[t];
    const bool decayed = hp[g][kLarsDecayedGrad] != 0.0;
    const O grad_mul = coeffs[t].grad_mul;
    const O weight_decay = static_cast<O>(hp[g][kWeightDecay]);
    // Squares are summed in double, as torch's CPU norm does for fp32: fp32 squares underflow below about
    // 1e-23 and overflow above about 1e19.
    double sum_w = 0, sum_g = 0;
    if (decayed) {
#pragma omp simd reduction(+ : sum_w, sum_g)
      for (int64_t i = chunk.begin; i < chunk.end; ++i) {
        const O wi = load_weight<kMaster>(w, m, i);
        const double gi = load(gr, i) * grad_mul + weight_decay * wi;
        sum_w += static_cast<double>(wi) * wi;
        sum_g += gi * gi;
      }
    } else {
#pragma omp simd reduction(+ : sum_w, sum_g)
      for (int64_t i = chunk.begin; i < chunk.end; ++i) {
        const double wi = load_weight<kMaster>(w, m, i);
        const double gi = load(gr, i);
        sum_w += wi * wi;
        sum_g += gi * gi;
      }
    }
    w_sq[c] = sum_w;
    g_sq[c] = sum_g;
  };

  // Sums the chunk partials in a fixed order, so the ratio does not depend on the thread count. Each thread
  // computes it for the tensors its chunks belong to (update_chunk keeps the last one), which saves a
  // barrier per wave.
  auto lars_trust = [&](int32_t t) -> O {
    const int64_t g = tensor_group[t];
    double sum_w = 0, sum_g = 0;
    for (int64_t c = work.tensor_first_chunk[t]; c < work.tensor_first_chunk[t + 1]; ++c) {
      sum_w += w_sq[c];
      sum_g += g_sq[c];
    }
    const bool decayed = hp[g][kLarsDecayedGrad] != 0.0;
    const double g_norm = decayed ? std::sqrt(sum_g) : std::sqrt(sum_g) * std::abs(inv_scale);
    return static_cast<O>(trust_ratio(std::sqrt(sum_w), g_norm, hp[g][kWeightDecay], hp[g][kTrustCoefficient],
                                      hp[g][kLarsEps], decayed, hp[g][kTrustClip] != 0.0, hp[g][kLr]));
  };

  // `trust_tensor` / `trust`: the calling thread's last computed ratio (static schedules give each thread
  // consecutive chunks, so a tensor's ratio is computed about once per thread).
  auto update_chunk = [&](const Chunk& chunk, int32_t& trust_tensor, O& trust) {
    const int32_t t = chunk.tensor;
    Coeffs<O> c = coeffs[t];
    if (lars[t]) {
      if (trust_tensor != t) {
        trust = lars_trust(t);
        trust_tensor = t;
      }
      c.trust = trust;
    }
    P* w = w_ptr[t];
    const P* gr = g_ptr[t];
    B* b = b_ptr[t];
    float* m = m_ptr[t];
    if (c.has_momentum) {
#pragma omp simd
      for (int64_t i = chunk.begin; i < chunk.end; ++i) {
        O wi = load_weight<kMaster>(w, m, i);
        O bi = c.first ? O(0) : static_cast<O>(load(b, i));
        sgd_element(wi, static_cast<O>(load(gr, i)), bi, c);
        if (kMaster) m[i] = static_cast<float>(wi);
        store(w, i, wi);
        store(b, i, bi);
      }
    } else {
#pragma omp simd
      for (int64_t i = chunk.begin; i < chunk.end; ++i) {
        O wi = load_weight<kMaster>(w, m, i);
        O bi = 0;
        sgd_element(wi, static_cast<O>(load(gr, i)), bi, c);
        if (kMaster) m[i] = static_cast<float>(wi);
        store(w, i, wi);
      }
    }
  };

#pragma omp parallel num_threads(num_threads_for(work))
  {
    int32_t trust_tensor = -1;
    O trust = 1;
    for (const Wave& wave : work.waves) {
      if (wave.needs_norms) {
#pragma omp for schedule(static)
        for (int64_t c = wave.chunk_begin; c < wave.chunk_end; ++c) {
          if (lars[work.chunks[c].tensor]) norm_chunk(work.chunks[c], c);
        }
      }
#pragma omp for schedule(static)
      for (int64_t c = wave.chunk_begin; c < wave.chunk_end; ++c) update_chunk(work.chunks[c], trust_tensor, trust);
    }
  }
}

// Reads `found_inf` (a CPU scalar) and `grad_scale`: true when the step must be skipped.
bool skip_step(const std::optional<at::Tensor>& found_inf) {
  return found_inf.has_value() && found_inf->item<double>() != 0.0;
}

double inverse_scale(const std::optional<at::Tensor>& grad_scale) {
  // Same rounding as GradScaler.unscale_: the reciprocal in double, then rounded to float.
  return grad_scale.has_value() ? static_cast<double>(static_cast<float>(1.0 / grad_scale->item<double>()))
                                : 1.0;
}

void check_bucket(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                  const std::vector<std::optional<at::Tensor>>& momentum_buffers,
                  const std::vector<at::Tensor>& master_params) {
  TORCH_CHECK(grads.size() == params.size() && momentum_buffers.size() == params.size(),
              "lightning_fusedsgd kernel: params, grads and momentum_buffers must have the same length");
  TORCH_CHECK(master_params.empty() || master_params.size() == params.size(),
              "lightning_fusedsgd kernel: master_params must be empty or one per param");
  for (const auto& p : params) {
    TORCH_CHECK(p.device().is_cpu(), "lightning_fusedsgd kernel: CPU tensors only");
    TORCH_CHECK(p.scalar_type() == params[0].scalar_type(), "lightning_fusedsgd kernel: one dtype per call");
    TORCH_CHECK(p.is_non_overlapping_and_dense(), "lightning_fusedsgd kernel: params must be dense");
  }
}

}  // namespace

void sgd_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
              const std::vector<std::optional<at::Tensor>>& momentum_buffers,
              const std::vector<at::Tensor>& master_params, const at::Tensor& group_hparams,
              const std::vector<int64_t>& tensor_group, const std::vector<bool>& first_step,
              const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  if (params.empty() || skip_step(found_inf)) return;
  check_bucket(params, grads, momentum_buffers, master_params);
  TORCH_CHECK(group_hparams.scalar_type() == at::kDouble && group_hparams.dim() == 2 &&
                  group_hparams.size(1) == kNumHParams && group_hparams.is_contiguous(),
              "lightning_fusedsgd kernel: group_hparams must be a contiguous float64 [groups, ", kNumHParams,
              "] table");
  TORCH_CHECK(tensor_group.size() == params.size() && first_step.size() == params.size(),
              "lightning_fusedsgd kernel: tensor_group and first_step need one entry per param");
  for (int64_t g : tensor_group) {
    TORCH_CHECK(g >= 0 && g < group_hparams.size(0), "lightning_fusedsgd kernel: tensor_group out of range");
  }
  const double inv_scale = inverse_scale(grad_scale);
  const bool master = !master_params.empty();
  switch (params[0].scalar_type()) {
    case at::kFloat:
      TORCH_CHECK(!master, "lightning_fusedsgd kernel: master weights are for bf16/fp16 params");
      return sgd_bucket<float, float, false>(params, grads, momentum_buffers, master_params, group_hparams,
                                             tensor_group, first_step, inv_scale);
    case at::kDouble:
      TORCH_CHECK(!master, "lightning_fusedsgd kernel: master weights are for bf16/fp16 params");
      return sgd_bucket<double, double, false>(params, grads, momentum_buffers, master_params, group_hparams,
                                               tensor_group, first_step, inv_scale);
    case at::kBFloat16:
      return master ? sgd_bucket<c10::BFloat16, float, true>(params, grads, momentum_buffers, master_params,
                                                             group_hparams, tensor_group, first_step, inv_scale)
                    : sgd_bucket<c10::BFloat16, c10::BFloat16, false>(params, grads, momentum_buffers,
                                                                      master_params, group_hparams,
                                                                      tensor_group, first_step, inv_scale);
    case at::kHalf:
      return master ? sgd_bucket<c10::Half, float, true>(params, grads, momentum_buffers, master_params,
                                                         group_hparams, tensor_group, first_step, inv_scale)
                    : sgd_bucket<c10::Half, c10::Half, false>(params, grads, momentum_buffers, master_params,
                                                              group_hparams, tensor_group, first_step,
                                                              inv_scale);
    default:
      TORCH_CHECK(false, "lightning_fusedsgd kernel: unsupported dtype ", params[0].scalar_type());
  }
}

// The data-movement floor: the same work list, waves, parallel region and bytes read and written as sgd_step
// with momentum, and no arithmetic (bit moves only). Benchmarks divide step time by this. With `lars`, each
// wave that has LARS tensors first reads their w and g, as the norm pass does, XOR-reduced into per-chunk
// partials so the reads are kept (their XOR is returned); the values left behind are the plain floor's.
template <typename W, typename G, bool kMaster>
int64_t floor_bucket(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                  const std::vector<std::optional<at::Tensor>>& momentum_buffers,
                  const std::vector<at::Tensor>& master_params, const std::vector<bool>& lars) {
  const int32_t n = static_cast<int32_t>(params.size());
  std::vector<W*> w_ptr(n), b_ptr(n);
  std::vector<const G*> g_ptr(n);
  std::vector<G*> p_ptr(n);
  for (int32_t t = 0; t < n; ++t) {
    const at::Tensor& weights = kMaster ? master_params[t] : params[t];
    w_ptr[t] = static_cast<W*>(weights.data_ptr());
    b_ptr[t] = static_cast<W*>(momentum_buffers[t]->data_ptr());
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
    const G* g = g_ptr[chunk.tensor];
    G* p = p_ptr[chunk.tensor];
#pragma omp simd
    for (int64_t i = chunk.begin; i < chunk.end; ++i) {
      const W w_old = w[i];
      const G g_i = g[i];
      if (kMaster) {
        w[i] = static_cast<W>(g_i) << 16;
        p[i] = g_i;
      } else {
        w[i] = static_cast<W>(g_i);
      }
      b[i] = w_old ^ b[i];
    }
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
int64_t floor_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                   const std::vector<std::optional<at::Tensor>>& momentum_buffers,
                   const std::vector<at::Tensor>& master_params, const std::vector<bool>& lars) {
  if (params.empty()) return 0;
  check_bucket(params, grads, momentum_buffers, master_params);
  const bool master = !master_params.empty();
  for (size_t t = 0; t < params.size(); ++t) {
    TORCH_CHECK(momentum_buffers[t].has_value(),
                "lightning_fusedsgd floor kernel: pass a momentum buffer for every param");
    const at::Tensor& weights = master ? master_params[t] : params[t];
    check_same_layout(params[t], grads[t], "grad");
    check_same_layout(params[t], *momentum_buffers[t], "momentum buffer");
    check_same_layout(params[t], weights, "master param");
    TORCH_CHECK(grads[t].scalar_type() == params[t].scalar_type() &&
                    momentum_buffers[t]->scalar_type() == weights.scalar_type() &&
                    (!master || weights.scalar_type() == at::kFloat),
                "lightning_fusedsgd floor kernel: grads match their params' dtype, buffers their weights'");
  }
  TORCH_CHECK(lars.empty() || lars.size() == params.size(),
              "lightning_fusedsgd floor kernel: lars must be empty or one flag per param");
  const std::vector<bool> flags = lars.empty() ? std::vector<bool>(params.size(), false) : lars;
  switch (at::elementSize(params[0].scalar_type())) {
    case 2:
      return master ? floor_bucket<uint32_t, uint16_t, true>(params, grads, momentum_buffers, master_params,
                                                             flags)
                    : floor_bucket<uint16_t, uint16_t, false>(params, grads, momentum_buffers, master_params,
                                                              flags);
    case 4:
      return floor_bucket<uint32_t, uint32_t, false>(params, grads, momentum_buffers, master_params, flags);
    case 8:
      return floor_bucket<uint64_t, uint64_t, false>(params, grads, momentum_buffers, master_params, flags);
    default:
      TORCH_CHECK(false, "lightning_fusedsgd floor kernel: unsupported dtype ", params[0].scalar_type());
  }
}

}  // namespace lfsgd

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sgd_step", &lfsgd::sgd_step, "Fused SGD/LARS step over one (device, dtype) bucket of CPU tensors");
  m.def("floor_step", &lfsgd::floor_step,
        "Data-movement floor: sgd_step's memory traffic, no math; lars flags the tensors with a norm pass "
        "(returns an XOR of what it read)");
  lfsgd::bind_cached_step<&lfsgd::sgd_step>(m);
  m.attr("hparam_columns") = static_cast<int>(lfsgd::kNumHParams);
}
