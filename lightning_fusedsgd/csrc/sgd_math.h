// The per-element SGD/LARS math, written once. Every backend mirrors these functions line for line:
// lightning_fusedsgd/reference.py (`sgd_element`, `trust_ratio`) is the plain-PyTorch twin.
#pragma once

#include <cstdint>

// Compiled for the host (C++ kernel) and, under nvcc, for the device (CUDA kernel) too.
#ifdef __CUDACC__
#define LFSGD_HOST_DEVICE __host__ __device__
#else
#define LFSGD_HOST_DEVICE
#endif

namespace lfsgd {

// Columns of the per-group hyperparameter table built by optim.py (`HPARAM_COLUMNS` there).
enum HParam : int {
  kLr = 0,
  kMomentum,
  kDampening,
  kWeightDecay,
  kNesterov,
  kMaximize,
  kWdAfterMomentum,
  kLars,
  kTrustCoefficient,
  kLarsEps,
  kTrustClip,
  kLarsDecayedGrad,
  kNumHParams,
};

// The type the math runs in for a parameter type P: float for fp32/bf16/fp16 params, double for fp64.
template <typename P>
struct OpMath {
  using type = float;
};
template <>
struct OpMath<double> {
  using type = double;
};

// Everything the element update needs, resolved once per tensor. `T` is the opmath type
// (float for fp32/bf16/fp16 params, double for fp64).
template <typename T>
struct Coeffs {
  T grad_mul;             // sign / grad_scale: unscale and maximize in one exact multiply
  T wd_coupled;           // lambda, or 0 when weight decay is applied after momentum
  T trust;                // LARS trust ratio r, 1 for plain SGD
  T momentum;             // mu
  T one_minus_dampening;  // 1 - tau
  T wd_after;             // lambda when wd_after_momentum, else 0
  T lr;                   // gamma
  bool has_momentum;      // mu != 0: a buffer exists
  bool first;             // this parameter's first step: seed the buffer with g
  bool nesterov;
};

template <typename T>
LFSGD_HOST_DEVICE inline void sgd_element(T& w, T g, T& b, const Coeffs<T>& c) {
  g = g * c.grad_mul;
  g = g + c.wd_coupled * w;
  g = g * c.trust;
  if (c.has_momentum) {
    b = c.first ? g : c.momentum * b + c.one_minus_dampening * g;
    g = c.nesterov ? g + c.momentum * b : b;
  }
  g = g + c.wd_after * w;
  w = w - c.lr * g;
}

// Master weights follow outside writes. The param must hold its master's rounding; where it does not, it
// was written outside the optimizer (load_state_dict, p.data.copy_, an EMA swap) and its value becomes the
// master from this step on. Compared bit for bit, element by element, at the cost of reading the param
// (2 bytes per element) in the pass that already reads the master.
template <typename Bits, typename T>
LFSGD_HOST_DEVICE inline T synced_master(T master, Bits master_rounded, Bits param_bits, T param) {
  return master_rounded == param_bits ? master : param;
}

// LARS trust ratio. `g_norm` is ||g_raw|| for the default denominator and ||g_raw + lambda w|| for
// the "decayed_grad" variant; both are norms of the unscaled, sign-corrected gradient.
LFSGD_HOST_DEVICE inline double trust_ratio(double w_norm, double g_norm, double weight_decay,
                                            double trust_coefficient, double eps, bool decayed_grad,
                                            bool trust_clip, double lr) {
  if (w_norm == 0.0 || g_norm == 0.0) return 1.0;
  const double denominator = decayed_grad ? g_norm + eps : g_norm + weight_decay * w_norm + eps;
  double r = trust_coefficient * w_norm / denominator;
  if (trust_clip) r = 1.0 < r / lr ? 1.0 : r / lr;  // LARC's clip, min(r / lr, 1); lr == 0 gives inf -> 1
  return r;
}

}  // namespace lfsgd
