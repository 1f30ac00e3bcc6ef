// The lr schedule on the device, for capturable steps: WarmupSchedule.lr_at (schedule/function.py) evaluated from a
// step counter that lives on the params' device, for the CPU op and (under nvcc) the CUDA op. Written as lr_at
// computes it, operation for operation in double, with the decay's factors (cos, pow) computed by the host into
// the row: CUDA's cos and pow differ from the host libm's in the last bits, where +, -, * and / (not contracted:
// the libraries fuse nothing implicitly) round alike everywhere, so the two give the same lr bit for bit.
#pragma once

#include <cmath>
#include <cstdint>

#include "sgd_math.h"

namespace lfsgd {

// The decays, in the order of _abi.DECAYS (checked when the library loads).
enum Decay : int { kCosine = 0, kMultistep, kPoly, kLinear, kConstant };
constexpr const char* kDecayNames[] = {"cosine", "multistep", "poly", "linear", "constant"};

// A schedule as a float64 row: these columns (enum constant, name), in the order of _abi.SCHEDULE_HEADER (checked
// when the library loads), then the multistep milestones (global steps, increasing), then the decay's factors
// (WarmupSchedule.as_row): gamma^k for k milestones reached (multistep), the shape at each step from warmup_steps to
// total_steps (cosine, poly, linear).
#define LFSGD_SCHEDULE_HEADER(X) \
  X(kTotalSteps, total_steps)    \
  X(kWarmupSteps, warmup_steps)  \
  X(kStartFactor, start_factor)  \
  X(kDecayColumn, decay)         \
  X(kGamma, gamma)               \
  X(kPower, power)               \
  X(kEndLr, end_lr)              \
  X(kMilestoneCount, milestone_count)

#define LFSGD_COLUMN(constant, name) constant,
enum ScheduleColumn : int { LFSGD_SCHEDULE_HEADER(LFSGD_COLUMN) kScheduleHeader };
#undef LFSGD_COLUMN
#define LFSGD_COLUMN(constant, name) #name,
constexpr const char* kScheduleHeaderNames[] = {LFSGD_SCHEDULE_HEADER(LFSGD_COLUMN)};
#undef LFSGD_COLUMN

// f(step) for a group whose peak lr is `peak`; `length` is the row's length (header and milestones).
LFSGD_HOST_DEVICE inline double scheduled_lr(const double* schedule, int64_t length, int64_t step, double peak) {
  const double warmup = schedule[kWarmupSteps];
  const double start_factor = schedule[kStartFactor];
  if (step < warmup) return peak * (start_factor + (1.0 - start_factor) * static_cast<double>(step) / warmup);
  const int64_t total = static_cast<int64_t>(schedule[kTotalSteps]);
  const int64_t t = step < total ? step : total;
  const int decay = static_cast<int>(schedule[kDecayColumn]);
  if (decay == kConstant) return peak;
  const int64_t milestones = static_cast<int64_t>(schedule[kMilestoneCount]);
  const double* factors = schedule + kScheduleHeader + milestones;
  int64_t index = t - static_cast<int64_t>(warmup);
  if (decay == kMultistep) {
    index = 0;  // milestones <= t, as bisect_right counts them
    for (int64_t i = kScheduleHeader; i < kScheduleHeader + milestones; ++i) index += schedule[i] <= t ? 1 : 0;
  }
  // A row shorter than its schedule gives NaN rather than a read past its end.
  const double factor = index >= 0 && kScheduleHeader + milestones + index < length ? factors[index] : nan("");
  if (decay == kMultistep) return peak * factor;
  const double end_lr = schedule[kEndLr];
  return end_lr + (peak - end_lr) * factor;  // two roundings, as in Python
}

// One scheduler step. `position` is [applied steps, skipped steps]. After an applied optimizer step (`applied`
// null or true) it counts one more applied step and sets every group's lr to f(applied steps) from its peak;
// after a skipped one (a GradScaler found inf/NaN) it counts the skip and leaves the lrs. `advance` false
// only sets the lrs from the position (a new or resumed scheduler).
LFSGD_HOST_DEVICE inline void schedule_step(double* lrs, int64_t* position, const double* schedule, int64_t length,
                                            const double* peaks, int64_t groups, const bool* applied, bool advance) {
  if (advance) {
    if (applied != nullptr && !*applied) {
      position[1] += 1;
      return;
    }
    position[0] += 1;
  }
  for (int64_t g = 0; g < groups; ++g) lrs[g] = scheduled_lr(schedule, length, position[0], peaks[g]);
}

}  // namespace lfsgd
