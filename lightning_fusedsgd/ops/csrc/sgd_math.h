// The per-group hyperparameters (LFSGD_HPARAMS: the columns of the table the ops take) and the per-element math that
// reads them: SGD's and LARS's update, the average of the weights and schedule-free SGD's step, written once for
// the CPU kernel and (under nvcc) the CUDA kernel; how a result is rounded into bf16 is rounding.h's.
// lightning_fusedsgd/ops/reference.py mirrors every function here, and lightning_fusedsgd/_abi.py lists
// LFSGD_HPARAMS's columns in order (checked when the library loads). The table and its math share this file so that
// an option's field and its use sit side by side: an option touches one C++ file (docs/design.md).
#pragma once

#include <cmath>
#include <cstdint>

// Compiled for the host (C++ kernel) and, under nvcc, for the device (CUDA kernel) too. The per-element
// functions are always inlined: a call left in a loop body keeps the compiler from vectorizing it.
#ifdef __CUDACC__
#define LFSGD_HOST_DEVICE __host__ __device__
#define LFSGD_ELEMENT __host__ __device__ __forceinline__
#else
#define LFSGD_HOST_DEVICE
#define LFSGD_ELEMENT inline __attribute__((always_inline))
#endif

// The CPU library's AVX2 and AVX-512 builds step 16-bit params on ATen's vectors: the element functions below are
// templates, and vec_math.h gives the few operations that differ on a vector (declared first, as the templates'
// lookup needs).
#ifdef LFSGD_CPU_VECTORS
#include "vec_math.h"
#endif

namespace lfsgd {

// One parameter group's hyperparameters: (type, name) in the order of _abi.HPARAMS, the columns of the float64
// [groups, kNumHParams] table the ops take. Adding one: _abi.py, here and its use below, and reference.py.
#define LFSGD_HPARAMS(X)        \
  X(double, lr)                 \
  X(double, momentum)           \
  X(double, dampening)          \
  X(double, weight_decay)       \
  X(bool, nesterov)             \
  X(bool, maximize)             \
  X(bool, wd_after_momentum)    \
  X(bool, lars)                 \
  X(double, trust_coefficient)  \
  X(double, lars_eps)           \
  X(bool, trust_clip)           \
  X(int, lars_denominator)      \
  X(double, max_grad_value)     \
  X(bool, always_adapt)         \
  X(int, lars_zero_norm)        \
  X(int, update_rounding)       \
  X(double, rounding_seed)      \
  X(double, ema_decay)          \
  X(int64_t, ema_every)         \
  X(int64_t, ema_start)         \
  X(double, ema_warmup_gamma)   \
  X(double, ema_warmup_power)   \
  X(bool, schedule_free)        \
  X(double, warmup_steps)       \
  X(double, r)                  \
  X(double, weight_lr_power)

// The options a column numbers, in the order of _abi's tuples of their names (checked when the library loads):
// how bf16 params without master weights take their update (update_rounding: kKahan keeps a compensation), the
// LARS denominator (lars_denominator), and what LARS does where a norm is 0 (lars_zero_norm).
enum UpdateRounding : int { kNearest = 0, kStochastic, kKahan };
constexpr const char* kUpdateRoundingNames[] = {"nearest", "stochastic", "kahan"};
enum LarsDenominator : int { kGradPlusDecay = 0, kDecayedGrad };
constexpr const char* kLarsDenominatorNames[] = {"grad_plus_decay", "decayed_grad"};
enum LarsZeroNorm : int { kUnitRatio = 0, kPlainGrad };
constexpr const char* kLarsZeroNormNames[] = {"unit_ratio", "plain_grad"};

struct GroupHParams {
#define LFSGD_FIELD(type, name) type name;
  LFSGD_HPARAMS(LFSGD_FIELD)
#undef LFSGD_FIELD
};

// Whether a group's option columns hold numbers of their options (the enums above).
inline bool options_in_range(const GroupHParams& h) {
  return h.update_rounding >= kNearest && h.update_rounding <= kKahan && h.lars_denominator >= kGradPlusDecay &&
         h.lars_denominator <= kDecayedGrad && h.lars_zero_norm >= kUnitRatio && h.lars_zero_norm <= kPlainGrad;
}

#define LFSGD_NAME(type, name) #name,
constexpr const char* kHParamNames[] = {LFSGD_HPARAMS(LFSGD_NAME)};
#undef LFSGD_NAME
constexpr int kNumHParams = sizeof(kHParamNames) / sizeof(kHParamNames[0]);

// One row of the table as the typed struct (a flag is set where its value is not 0).
inline GroupHParams hparams_from_row(const double* row) {
  GroupHParams h;
  int column = 0;
#define LFSGD_READ(type, name) h.name = static_cast<type>(row[column++]);
  LFSGD_HPARAMS(LFSGD_READ)
#undef LFSGD_READ
  return h;
}

// The type the math runs in for a parameter type P: float for fp32/bf16/fp16 params, double for fp64.
template <typename P>
struct OpMath {
  using type = float;
};
template <>
struct OpMath<double> {
  using type = double;
};

// 1 / grad_scale rounded as GradScaler.unscale_ rounds it: the reciprocal in double, then to float.
LFSGD_HOST_DEVICE inline double inverse_scale(float grad_scale) {
  return static_cast<double>(static_cast<float>(1.0 / grad_scale));
}

// clip_grad_norm_'s coefficient, min(1, max_norm / (||g|| + 1e-6)), from the sum of squares of every
// stepped gradient as the kernels receive it (still scaled: ||g|| is unscaled here). A NaN norm gives NaN,
// as torch's clamp does. The threshold is one value for the whole step (a value of the step row, not a column).
LFSGD_HOST_DEVICE inline double clip_coef(double grad_sq_sum, double max_norm, double inv_scale) {
  const double coef = max_norm / (sqrt(grad_sq_sum) * fabs(inv_scale) + 1e-6);
  return coef > 1.0 ? 1.0 : coef;
}

// a * b + c as ATen's CPU kernels compute `c.add(a, alpha=b)`: one fused multiply-add where the build has FMA
// (ATen's Vectorized::fmadd, and its scalar loops, contracted by the compiler), two roundings where it has not
// (the baseline x86-64 build). The CUDA kernel fuses, as nvcc does for ATen's CUDA kernels. The libraries are
// compiled with -ffp-contract=off / --fmad=false, so this is the only place where a multiply-add is fused.
#if defined(__CUDA_ARCH__) || defined(__FMA__)
LFSGD_ELEMENT float mul_add(float a, float b, float c) { return fmaf(a, b, c); }
LFSGD_ELEMENT double mul_add(double a, double b, double c) { return fma(a, b, c); }
#else
template <typename T>
LFSGD_ELEMENT T mul_add(T a, T b, T c) {
  return a * b + c;
}
#endif

// Whether a group's update keeps a momentum buffer: SGD's momentum is on. A schedule-free group's momentum column
// is its interpolation (interpolation below), and it keeps z instead. Decided here alone: make_coeffs gives it to
// the loops (Coeffs::has_momentum_buffer), and the momentum_buffer slot's held rule reads it (slots.h).
LFSGD_HOST_DEVICE inline bool keeps_momentum_buffer(const GroupHParams& h) {
  return h.momentum != 0.0 && !h.schedule_free;
}

// Everything the element update needs, resolved once per tensor. `T` is the opmath type.
template <typename T>
struct Coeffs {
  T grad_mul;                // sign / grad_scale: unscale and maximize in one exact multiply
  T clip_value;              // clip_grad_value_'s bound, inf when off
  T clip_coef;               // clip_grad_norm_'s coefficient, 1 when off
  T wd_coupled;              // lambda, or 0 when weight decay is applied after momentum
  T trust;                   // LARS trust ratio r, 1 for plain SGD
  T momentum;                // mu
  T one_minus_dampening;     // 1 - tau
  T wd_after;                // lambda when wd_after_momentum, else 0
  T lr;                      // gamma
  bool has_momentum_buffer;  // keeps_momentum_buffer
  bool first;                // this parameter's first step: seed the momentum buffer with g
  bool nesterov;
  T ckp1;                    // schedule-free: the weight of z in this step's average (apply_schedule_free)
  T y_grad;                  // schedule-free: the gradient's coefficient in y's step
};

// `clip`: the step's clip_grad_norm_ coefficient (clip_coef), 1 where it does not clip by norm.
template <typename T>
LFSGD_HOST_DEVICE inline Coeffs<T> make_coeffs(const GroupHParams& h, double inv_scale, double clip, bool first) {
  const double weight_decay = h.weight_decay;
  return Coeffs<T>{static_cast<T>(h.maximize ? -inv_scale : inv_scale),
                   static_cast<T>(h.max_grad_value),
                   static_cast<T>(clip),
                   static_cast<T>(h.wd_after_momentum ? 0.0 : weight_decay),
                   T(1),
                   static_cast<T>(h.momentum),
                   static_cast<T>(1.0 - h.dampening),
                   static_cast<T>(h.wd_after_momentum ? weight_decay : 0.0),
                   static_cast<T>(h.lr),
                   keeps_momentum_buffer(h),
                   first,
                   h.nesterov,
                   T(0),
                   T(0)};
}

// a where `condition`, else b, for a condition that holds for the whole loop (a coefficient's test).
template <typename V>
LFSGD_ELEMENT V pick(bool condition, V a, V b) {
  return condition ? a : b;
}

// g clamped to [-bound, bound] as torch's clamp does it: a NaN stays NaN.
template <typename T>
LFSGD_ELEMENT T clamp_keep_nan(T g, T bound) {
  return g < -bound ? -bound : (g > bound ? bound : g);
}

// The element functions below take one value `V` of the opmath type `S` (whose Coeffs they read), or a vector of
// them (vec_math.h): V(s) broadcasts a coefficient, and a select on a coefficient picks a whole vector.

// The gradient as clip_grad_value_ / clip_grad_norm_ leave it: unscaled and sign-corrected, then clipped
// (only one clip is on). kClipValue = false leaves the clamp out, for a clip_value of inf: a loop without
// clip_grad_value_ does not pay for it.
template <bool kClipValue, typename V, typename S>
LFSGD_ELEMENT V clipped_grad(V g, const Coeffs<S>& c) {
  g = g * V(c.grad_mul);
  if constexpr (kClipValue) g = clamp_keep_nan(g, c.clip_value);
  return g * V(c.clip_coef);
}

// One element's update, rounding as torch.optim.SGD's default path rounds (its single-tensor ops, each with
// ATen's rounding): grad.add(param, alpha=wd), buf.mul_(momentum).add_(grad, alpha=1 - dampening),
// grad.add(buf, alpha=momentum), param.add_(grad, alpha=-lr); a term whose coefficient is 0 is left out, as
// torch leaves out its op (computed and selected away rather than branched around: a branch around a
// multiply-add keeps the compiler from vectorizing the loop). The plain path (no clipping, LARS, GradScaler or
// masters) therefore gives torch's bits; the trust ratio and clipping multiply where torch has nothing.
template <bool kClipValue = true, typename V, typename S>
LFSGD_ELEMENT void sgd_element(V& w, V g, V& b, const Coeffs<S>& c) {
  g = clipped_grad<kClipValue>(g, c);
  const V decayed = mul_add(w, V(c.wd_coupled), g);
  g = pick(c.wd_coupled != S(0), decayed, g);
  g = g * V(c.trust);
  const V averaged = mul_add(g, V(c.one_minus_dampening), b * V(c.momentum));
  const V buffer = c.first ? g : averaged;
  const V looked_ahead = mul_add(buffer, V(c.momentum), g);
  const V direction = c.nesterov ? looked_ahead : buffer;
  b = c.has_momentum_buffer ? buffer : b;
  g = c.has_momentum_buffer ? direction : g;
  const V decayed_after = mul_add(w, V(c.wd_after), g);
  g = pick(c.wd_after != S(0), decayed_after, g);
  w = mul_add(g, V(-c.lr), w);
}

// The average of the weights (ema_decay; NaN: none) takes each updated weight w as
// avg <- decay * avg + (1 - decay) * w, three roundings in that order (torch.optim.swa_utils.get_ema_avg_fn, which
// Lightning's EMAWeightAveraging applies), at the applied steps `steps` >= ema_start that ema_every divides
// (Lightning's update_starting_at_step / update_every_n_steps, counting this param's steps since its average
// began); its first update copies w. With ema_warmup_gamma, the decay of the update after `updates` updates is
// min(ema_decay, 1 - (1 + updates / gamma) ^ -power) (timm's ModelEmaV3 warmup).
template <typename T>
struct AverageCoeffs {
  bool update;  // this step updates the average
  bool copy;    // its first update: the average takes the weight
  T decay;
  T one_minus_decay;
};

LFSGD_HOST_DEVICE inline bool averages(const GroupHParams& h) { return h.ema_decay == h.ema_decay; }

template <typename T>
LFSGD_HOST_DEVICE inline AverageCoeffs<T> average_coeffs(const GroupHParams& h, int64_t steps, int64_t updates) {
  double decay = h.ema_decay;
  if (h.ema_warmup_gamma > 0.0 && updates > 0) {
    const double warm = 1.0 - pow(1.0 + static_cast<double>(updates) / h.ema_warmup_gamma, -h.ema_warmup_power);
    decay = warm < decay ? warm : decay;
  }
  return AverageCoeffs<T>{steps >= h.ema_start && steps % h.ema_every == 0, updates == 0, static_cast<T>(decay),
                          static_cast<T>(1.0 - decay)};
}

// One element's average after an update, `w` its new weight in opmath (a value or a vector: V(s) broadcasts).
template <typename V, typename S>
LFSGD_ELEMENT V averaged(V average, V w, const AverageCoeffs<S>& a) {
  return pick(a.copy, w, average * V(a.decay) + w * V(a.one_minus_decay));
}

// torch.lerp(self, end, weight) for one weight, rounding as ATen's kernels do: self + weight (end - self) where
// |weight| < 0.5, else end + (weight - 1)(end - self), each one multiply-add (the weight - 1 in the opmath type).
template <typename V, typename S>
LFSGD_ELEMENT V lerp(V self, V end, S weight) {
  const V difference = end - self;
  const bool small = weight < S(0.5) && weight > S(-0.5);
  return pick(small, mul_add(V(weight), difference, self), mul_add(V(weight - S(1)), difference, end));
}

// Schedule-free SGD's interpolation beta between the average x and the SGD sequence z: a schedule-free group holds it
// in the momentum column (schedulefree's argument name), which means SGD's momentum elsewhere.
LFSGD_HOST_DEVICE inline double interpolation(const GroupHParams& h) { return h.momentum; }

// Schedule-free SGD (Defazio et al. 2024), as schedulefree.SGDScheduleFree steps it: the param holds
// y = (1 - beta) z + beta x, z takes plain SGD steps and x is the average of the z's, with weight c_{k+1}
// (ckp1) on the newest. Its step in y and z alone (x is never formed): y <- lerp(y, z, ckp1) + lr (beta (1 - ckp1)
// - 1) g, z <- z - lr g, with g the gradient decayed at y; the coefficients from the step's lr (after warmup) and
// ckp1 (schedule_free_scalars), in double, then in the opmath type, as the peer's Python floats reach its ops.
template <typename T>
LFSGD_HOST_DEVICE inline void apply_schedule_free(Coeffs<T>& c, const GroupHParams& h, double ckp1) {
  c.ckp1 = static_cast<T>(ckp1);
  c.y_grad = static_cast<T>(h.lr * (interpolation(h) * (1.0 - ckp1) - 1.0));
}

// One element's schedule-free step (`z`: the update's aux stream, where SGD has its momentum buffer), in the peer's
// foreach operations and their roundings: grad.add_(y, alpha=wd), y.lerp_(z, ckp1), y.add_(grad, alpha=y_grad),
// z.sub_(grad, alpha=lr).
template <bool kClipValue = true, typename V, typename S>
LFSGD_ELEMENT void schedule_free_element(V& y, V g, V& z, const Coeffs<S>& c) {
  g = clipped_grad<kClipValue>(g, c);
  const V decayed = mul_add(y, V(c.wd_coupled), g);
  g = pick(c.wd_coupled != S(0), decayed, g);
  y = mul_add(g, V(c.y_grad), lerp(y, z, c.ckp1));
  z = mul_add(g, V(-c.lr), z);
}

// What an element's update reads, in opmath (V: a value, or a vector block): its weight, its gradient and its aux
// stream (the momentum buffer, or z). The kernels load and store them in elements.h (load_operands, update_at).
template <typename V>
struct Operands {
  V w;
  V g;
  V aux;
};

// Calls f(a's, b's, c's) for each operand of three Operands, in order (a block's halves are taken so).
template <typename F, typename A, typename B, typename C>
LFSGD_ELEMENT void zip_operands(F&& f, A& a, B& b, C& c) {
  f(a.w, b.w, c.w);
  f(a.g, b.g, c.g);
  f(a.aux, b.aux, c.aux);
}

// One element's update: SGD's, with the momentum buffer, or (kScheduleFree) schedule-free SGD's, with z.
template <bool kScheduleFree, bool kClipValue = true, typename V, typename S>
LFSGD_ELEMENT void update_element(Operands<V>& o, const Coeffs<S>& c) {
  if constexpr (kScheduleFree) {
    schedule_free_element<kClipValue>(o.w, o.g, o.aux, c);
  } else {
    sgd_element<kClipValue>(o.w, o.g, o.aux, c);
  }
}

// Whether the LARS denominator is ||g_raw + lambda w|| ("decayed_grad") rather than ||g_raw|| + lambda ||w||.
LFSGD_HOST_DEVICE inline bool decayed_grad(const GroupHParams& h) { return h.lars_denominator == kDecayedGrad; }

// The gradient term whose squares the LARS norm pass sums: g_raw (clipped_grad) for the default
// denominator, g_raw + lambda w for "decayed_grad".
template <bool kClipValue = true, typename T>
LFSGD_ELEMENT T lars_norm_term(T w, T g, const Coeffs<T>& c, T weight_decay, bool decayed) {
  const T raw = clipped_grad<kClipValue>(g, c);
  return decayed ? mul_add(w, weight_decay, raw) : raw;
}

// A tensor's row of lars_sq_sums: the sums of w^2, of the LARS norm term squared, of w times it, and of the gradient
// squared (clipped_grad before the norm clip: unscaled, sign-corrected, clipped by value; the same as the term's
// for the default denominator), in the order of _abi.LARS_SUM_NAMES (checked when the library loads). The last is
// what a step reports as its gradient norm (the step row's unscaled_grad_sq_sum).
constexpr const char* kLarsSumNames[] = {"w_sq", "term_sq", "w_term", "grad_sq"};
constexpr int kNumLarsSums = sizeof(kLarsSumNames) / sizeof(kLarsSumNames[0]);
constexpr int kGradSq = 3;  // the grad_sq sum's place in a row

// The LARS norm term's sum of squares under norm clipping by c, from sums taken before that clip (the
// lars_sq_sums op, whose partial sums are all-reduced under sharding: the clip coefficient needs the global
// gradient norm, which the same collective carries). sum_w = sum w^2, sum_t = sum term^2 and sum_wt =
// sum w term, with term = lars_norm_term at c = 1. Default denominator: term = g_raw, so c^2 sum_t.
// "decayed_grad": c g_raw + lambda w = c term + (1 - c) lambda w. A negative result (cancellation) is 0.
LFSGD_HOST_DEVICE inline double clipped_term_sq_sum(double sum_w, double sum_t, double sum_wt, double c,
                                                    const GroupHParams& h) {
  if (!decayed_grad(h) || c == 1.0) return c * c * sum_t;
  const double d = (1.0 - c) * h.weight_decay;
  const double sum = c * c * sum_t + 2.0 * c * d * sum_wt + d * d * sum_w;
  return sum < 0.0 ? 0.0 : sum;
}

// Master weights follow outside writes. The param must hold its master's rounding; where it does not, it
// was written outside the optimizer (load_state_dict, p.data.copy_, an EMA swap) and its value becomes the
// master from this step on. Compared bit for bit, element by element, at the cost of reading the param
// (2 bytes per element) in the pass that already reads the master.
template <typename Bits, typename T>
LFSGD_ELEMENT T synced_master(T master, Bits master_rounded, Bits param_bits, T param) {
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

// Whether LARS adapts a group's tensors: LARS on, and always_adapt or a weight decay (timm's switch: lightly,
// lightning-bolts and, by default, timm leave a group without weight decay unadapted).
LFSGD_HOST_DEVICE inline bool lars_adapts(const GroupHParams& h) {
  return h.lars && (h.always_adapt || h.weight_decay != 0.0);
}

// The trust ratio from a tensor's sums of squares (of w and of lars_norm_term).
LFSGD_HOST_DEVICE inline double lars_trust(double sum_w, double sum_g, const GroupHParams& h) {
  return trust_ratio(sqrt(sum_w), sqrt(sum_g), h.weight_decay, h.trust_coefficient, h.lars_eps,
                     decayed_grad(h), h.trust_clip, h.lr);
}

// A LARS tensor's coefficients from its sums of squares: the trust ratio, and where a norm is 0 under
// lars_zero_norm="plain_grad" (lightly's and lightning-bolts' rule) no weight decay either, so the plain
// gradient steps.
template <typename T>
LFSGD_HOST_DEVICE inline void apply_lars(Coeffs<T>& c, double sum_w, double sum_g, const GroupHParams& h) {
  c.trust = static_cast<T>(lars_trust(sum_w, sum_g, h));
  if (h.lars_zero_norm == kPlainGrad && (sum_w == 0.0 || sum_g == 0.0)) c.wd_coupled = T(0);
}

}  // namespace lfsgd
