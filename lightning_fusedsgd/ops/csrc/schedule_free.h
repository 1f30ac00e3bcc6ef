// Schedule-free SGD's per-group scalars on the device (FusedSGDScheduleFree): the step count, the largest lr so far,
// the sum of the average's weights, this step's lr after warmup and its weight of z in the average, advanced once
// per applied step by the schedule_free_scalars op, for the CPU op and (under nvcc) the CUDA op, so that a captured
// step replays them. Written as schedulefree.SGDScheduleFree.step computes them in Python, operation for operation
// in double (Python's floats), so the two give the same values (the CUDA libm's pow may differ from the host's in
// the last bit).
#pragma once

#include <cmath>
#include <cstdint>

#include "sgd_math.h"

namespace lfsgd {

// The scalars' rows of the float64 [kNumScheduleFreeScalars, groups] tensor, in the order of
// _abi.SCHEDULE_FREE_SCALARS (checked when the library loads).
#define LFSGD_SCHEDULE_FREE_SCALARS(X) \
  X(kStepCount, k)                     \
  X(kLrMax, lr_max)                    \
  X(kWeightSum, weight_sum)            \
  X(kScheduledLr, scheduled_lr)        \
  X(kCkp1, ckp1)

#define LFSGD_ROW(constant, name) constant,
enum ScheduleFreeScalar : int { LFSGD_SCHEDULE_FREE_SCALARS(LFSGD_ROW) kNumScheduleFreeScalars };
#undef LFSGD_ROW
#define LFSGD_ROW(constant, name) #name,
constexpr const char* kScheduleFreeScalarNames[] = {LFSGD_SCHEDULE_FREE_SCALARS(LFSGD_ROW)};
#undef LFSGD_ROW

// One applied step of group g's scalars (`scalars`: the [kNumScheduleFreeScalars, groups] rows), whose lr before
// warmup is `lr`: a linear warmup over warmup_steps, the largest lr so far, and the average's weight of this step,
// (k + 1)^r lr_max^weight_lr_power, over the sum of every step's (0 where that sum is 0, as the peer's
// ZeroDivisionError gives).
LFSGD_HOST_DEVICE inline void advance_schedule_free(double* scalars, int64_t groups, int64_t g, double lr,
                                                    const GroupHParams& h) {
  double* k = scalars + kStepCount * groups + g;
  double* lr_max = scalars + kLrMax * groups + g;
  double* weight_sum = scalars + kWeightSum * groups + g;
  const double sched = *k < h.warmup_steps ? (*k + 1.0) / h.warmup_steps : 1.0;
  const double scheduled = lr * sched;
  if (!(*lr_max > scheduled)) *lr_max = scheduled;  // Python's max(lr, lr_max)
  const double weight = pow(*k + 1.0, h.r) * pow(*lr_max, h.weight_lr_power);
  *weight_sum = *weight_sum + weight;
  scalars[kScheduledLr * groups + g] = scheduled;
  scalars[kCkp1 * groups + g] = *weight_sum == 0.0 ? 0.0 : weight / *weight_sum;
  *k = *k + 1.0;
}

// The switch of a schedule-free param between its training point y and its average x (optimizer.train() and
// .eval()), both on the line through z: x = lerp(y, z, 1 - 1 / beta), y = lerp(x, z, 1 - beta), beta its
// interpolation.
LFSGD_HOST_DEVICE inline double switch_weight(const GroupHParams& h, bool train) {
  return train ? 1.0 - interpolation(h) : 1.0 - 1.0 / interpolation(h);
}

}  // namespace lfsgd
