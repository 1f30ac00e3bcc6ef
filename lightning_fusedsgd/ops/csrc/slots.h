// Every kind of per-parameter state the kernels read, in one table (LFSGD_SLOTS): each slot's state key, which
// tensors hold it, its dtype and how it starts, compared with _abi.SLOTS when the library loads; how a bucket's
// weights are stored (Weight); and a tensor's state as every kernel reads it (SlotPointers).
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <type_traits>

#include "sgd_math.h"

namespace lfsgd {

// How a bucket's weights are stored: in the params alone; in fp32 master weights (the master_param slot) of
// bf16/fp16 params, which hold their rounding; or as bf16 params plus their Kahan compensations (the
// kahan_compensation slot, sgd_math.h). The slot beside the param, where there is one, is its companion.
enum class Weight { kParam, kMaster, kKahan };

// The element type of a bucket's companions.
template <Weight kWeight>
using Companion = std::conditional_t<kWeight == Weight::kKahan, c10::BFloat16, float>;

// How a new slot starts (_abi.Slot.seed): the kernel seeds a kGradient slot from the gradient of its tensor's first
// step; the others are seeded before the op runs, from the weight, what rounding it to the param dropped, or zeros.
enum class Seed { kGradient, kWeight, kResidual, kZeros };
constexpr const char* kSeedNames[] = {"gradient", "weight", "residual", "zeros"};

// What a tensor's slots follow from: its param's dtype, whether its bucket keeps fp32 master weights (the
// master_weights option, which is no column) and its group.
struct SlotFacts {
  at::ScalarType dtype;
  bool master_weights;
  const GroupHParams& h;
};

inline bool low_precision(at::ScalarType dtype) { return dtype == at::kBFloat16 || dtype == at::kHalf; }

// The slots' held rules (_abi.Slot.held): each reads the dtype, the master weights and plan options only.
inline bool has_momentum_buffer(const SlotFacts& f) { return keeps_momentum_buffer(f.h); }
inline bool has_masters(const SlotFacts& f) { return f.master_weights && low_precision(f.dtype); }
inline bool rounds_bf16(const SlotFacts& f, UpdateRounding rounding) {
  return f.dtype == at::kBFloat16 && !has_masters(f) && f.h.update_rounding == rounding;
}
inline bool rounds_kahan(const SlotFacts& f) { return rounds_bf16(f, kKahan); }
// A bf16 param without masters whose group rounds its update stochastically: it counts its stochastic steps.
inline bool rounds_stochastically(const SlotFacts& f) { return rounds_bf16(f, kStochastic); }
inline bool has_average(const SlotFacts& f) { return averages(f.h); }
inline bool steps_schedule_free(const SlotFacts& f) { return f.h.schedule_free; }

// The slots' dtype rules (_abi.Slot.dtype). A stream the update reads and writes beside the weight (its aux stream,
// below) is fp32 beside fp32 masters, else in the param's dtype; the average is in opmath; a count is one int64.
inline at::ScalarType stream_dtype(const SlotFacts& f) { return has_masters(f) ? at::kFloat : f.dtype; }
inline at::ScalarType fp32_dtype(const SlotFacts&) { return at::kFloat; }
inline at::ScalarType bf16_dtype(const SlotFacts&) { return at::kBFloat16; }
inline at::ScalarType opmath_dtype(const SlotFacts& f) { return f.dtype == at::kDouble ? at::kDouble : at::kFloat; }
inline at::ScalarType count_dtype(const SlotFacts&) { return at::kLong; }

// Every kind of per-parameter state (_abi.SLOTS), the kernels' one table of it: (enum constant, state key, which
// tensors hold it, its dtype, how a new one starts). The op's `state` holds each tensor's slots in this order,
// those it holds (its `state_slots` entry: bit s, and bit kNumSlots + s where the kernel seeds slot s this step).
// Loading the library compares the names, the seeds and, over every combination of the plan options and dtypes,
// the held and dtype rules with _abi.SLOTS.
#define LFSGD_SLOTS(X)                                                                    \
  X(kMomentumBuffer, momentum_buffer, has_momentum_buffer, stream_dtype, Seed::kGradient) \
  X(kMasterParam, master_param, has_masters, fp32_dtype, Seed::kWeight)                   \
  X(kKahanCompensation, kahan_compensation, rounds_kahan, bf16_dtype, Seed::kResidual)    \
  X(kRoundingStep, rounding_step, rounds_stochastically, count_dtype, Seed::kZeros)       \
  X(kEma, ema, has_average, opmath_dtype, Seed::kWeight)                                  \
  X(kEmaStep, ema_step, has_average, count_dtype, Seed::kZeros)                           \
  X(kEmaUpdates, ema_updates, has_average, count_dtype, Seed::kZeros)                     \
  X(kZ, z, steps_schedule_free, stream_dtype, Seed::kWeight)

#define LFSGD_SLOT_ENUM(constant, name, held, dtype, seed) constant,
enum Slot : int { LFSGD_SLOTS(LFSGD_SLOT_ENUM) kNumSlots };
#undef LFSGD_SLOT_ENUM
#define LFSGD_SLOT_NAME(constant, name, held, dtype, seed) #name,
constexpr const char* kSlotNames[] = {LFSGD_SLOTS(LFSGD_SLOT_NAME)};
#undef LFSGD_SLOT_NAME
#define LFSGD_SLOT_SEED(constant, name, held, dtype, seed) seed,
constexpr Seed kSlotSeeds[] = {LFSGD_SLOTS(LFSGD_SLOT_SEED)};
#undef LFSGD_SLOT_SEED
// The slots the kernel seeds (Seed::kGradient), as bits of a state_slots entry.
#define LFSGD_SLOT_KERNEL_SEEDED(constant, name, held, dtype, seed) \
  | (seed == Seed::kGradient ? int64_t{1} << constant : int64_t{0})
constexpr int64_t kKernelSeededSlots = int64_t{0} LFSGD_SLOTS(LFSGD_SLOT_KERNEL_SEEDED);
#undef LFSGD_SLOT_KERNEL_SEEDED

// Whether each slot is held, and its dtype, for these facts (LFSGD_SLOTS' rules).
struct SlotRules {
  bool held[kNumSlots];
  at::ScalarType dtype[kNumSlots];
};
inline SlotRules slot_rules(const SlotFacts& f) {
  SlotRules rules{};
#define LFSGD_SLOT_RULES(constant, name, held_rule, dtype_rule, seed) \
  rules.held[constant] = held_rule(f);                                \
  rules.dtype[constant] = dtype_rule(f);
  LFSGD_SLOTS(LFSGD_SLOT_RULES)
#undef LFSGD_SLOT_RULES
  return rules;
}

// A tensor's state as every kernel reads it: each slot's data, indexed by Slot, null where it holds none; and
// where the update finds its streams there.
struct SlotPointers {
  void* of[kNumSlots];

  // The update's aux stream, which it reads and writes beside the weight: SGD's momentum buffer, or schedule-free
  // SGD's z.
  LFSGD_HOST_DEVICE void* aux(bool schedule_free) const { return of[schedule_free ? kZ : kMomentumBuffer]; }
  // The slot beside the param that holds part of its weight (Weight): its master or its compensation.
  LFSGD_HOST_DEVICE void* companion(Weight weight) const {
    return of[weight == Weight::kKahan ? kKahanCompensation : kMasterParam];
  }
  // A count slot (kRoundingStep, kEmaStep, kEmaUpdates).
  LFSGD_HOST_DEVICE int64_t* count(Slot s) const { return static_cast<int64_t*>(of[s]); }
};

}  // namespace lfsgd
