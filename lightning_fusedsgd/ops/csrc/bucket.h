// The op contract in C++, shared by the CPU and CUDA ops: the step row in _abi's order (checked when the library
// loads), the one signature of sgd_step (sgd_step_op), and the checks of one bucket's arguments against the slots'
// rules (LFSGD_SLOTS, slots.h), all made before a kernel writes anything, which decode them into a Bucket.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>
#include <type_traits>
#include <vector>

#include "schedule.h"
#include "schedule_free.h"
#include "sgd_math.h"
#include "slots.h"

namespace lfsgd {

// The step row (_abi.STEP_ROW): (element type, name, shape) of each value, on the params' device or absent.
enum class RowShape { kOne, kGroups, kLarsSums };
#define LFSGD_STEP_ROW(X)                       \
  X(float, grad_scale, RowShape::kOne)          \
  X(float, found_inf, RowShape::kOne)           \
  X(double, grad_sq_sum, RowShape::kOne)        \
  X(double, max_grad_norm, RowShape::kOne)      \
  X(double, lars_sq_sums, RowShape::kLarsSums)  \
  X(double, lrs, RowShape::kGroups)             \
  X(double, ckp1, RowShape::kGroups)

// The step row as the kernels read it: each value's device pointer, null where absent; and where sgd_step
// reports its gradient norm, its one written value (sgd_step's unscaled_grad_sq_sum argument, not a value of the
// row: torch.compile functionalizes a written Tensor?[] with absent values nowhere).
struct StepRow {
#define LFSGD_ROW_FIELD(type, name, shape) const type* name = nullptr;
  LFSGD_STEP_ROW(LFSGD_ROW_FIELD)
#undef LFSGD_ROW_FIELD
  double* unscaled_grad_sq_sum = nullptr;
};
#define LFSGD_ROW_NAME(type, name, shape) #name,
constexpr const char* kStepRowNames[] = {LFSGD_STEP_ROW(LFSGD_ROW_NAME)};
#undef LFSGD_ROW_NAME
constexpr int kNumRowValues = sizeof(kStepRowNames) / sizeof(kStepRowNames[0]);

using OptionalTensors = c10::List<std::optional<at::Tensor>>;

// A checked bucket: its tensors, each group's hyperparameters (the lrs of the row not yet read: a CUDA step
// reads them on the device), each tensor's slots and whether the kernel seeds its kGradient slots this step (its
// first step), how its weights are stored, the step row, and whether it steps schedule-free.
struct Bucket {
  at::TensorList params;
  at::TensorList grads;
  std::vector<GroupHParams> groups;
  at::IntArrayRef tensor_group;
  std::vector<bool> first_step;
  std::vector<SlotPointers> slots;
  Weight weight = Weight::kParam;
  StepRow row;
  bool any_lars = false;
  bool schedule_free = false;

  void* aux(size_t t) const { return slots[t].aux(schedule_free); }
  void* companion(size_t t) const { return slots[t].companion(weight); }
};

// The step's inverse grad scale and clip_grad_norm_ coefficient (1 where it does not clip by norm) from its row,
// read where the row is: on the host for CPU tensors, on the device in a CUDA kernel.
LFSGD_HOST_DEVICE inline double row_inverse_scale(const StepRow& row) {
  return row.grad_scale == nullptr ? 1.0 : inverse_scale(*row.grad_scale);
}
LFSGD_HOST_DEVICE inline double row_clip(const StepRow& row, double inv_scale) {
  return row.grad_sq_sum == nullptr ? 1.0 : clip_coef(*row.grad_sq_sum, *row.max_grad_norm, inv_scale);
}

inline void check_same_layout(const at::Tensor& param, const at::Tensor& other, const char* what,
                              const char* op = "sgd_step") {
  TORCH_CHECK(other.device() == param.device() && other.sizes() == param.sizes() &&
                  other.strides() == param.strides(),
              "lightning_fusedsgd::", op, ": each ", what, " must match its param's device, shape and strides");
}

inline bool supported_dtype(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 || dtype == at::kHalf;
}

// The hyperparameter table (columns as LFSGD_HPARAMS), one GroupHParams per row.
inline std::vector<GroupHParams> decode_table(const at::Tensor& table, const char* op) {
  TORCH_CHECK(table.device().is_cpu() && table.scalar_type() == at::kDouble && table.dim() == 2 &&
                  table.size(1) == kNumHParams && table.is_contiguous(),
              "lightning_fusedsgd::", op, ": group_hparams must be a contiguous CPU float64 [groups, ", kNumHParams,
              "] table");
  std::vector<GroupHParams> groups;
  const double* rows = table.data_ptr<double>();
  for (int64_t g = 0; g < table.size(0); ++g) groups.push_back(hparams_from_row(rows + g * kNumHParams));
  return groups;
}

// grad_sq_sum's argument: dense gradients of one device and one supported dtype.
inline void check_grads(at::TensorList grads) {
  for (const at::Tensor& g : grads) {
    TORCH_CHECK(g.device() == grads[0].device() && g.scalar_type() == grads[0].scalar_type() &&
                    supported_dtype(g.scalar_type()) && g.is_non_overlapping_and_dense(),
                "lightning_fusedsgd::grad_sq_sum: dense gradients of one device and one float dtype");
  }
}

// A step row value, where present: checked against its declaration (element type T, shape) for n tensors of
// `groups` groups.
template <typename T>
inline const T* row_value(const std::optional<at::Tensor>& value, const char* name, RowShape shape,
                          const at::Device& device, int64_t n, int64_t groups, const char* op) {
  if (!value.has_value()) return nullptr;
  const bool shaped = shape == RowShape::kOne      ? value->numel() == 1
                      : shape == RowShape::kGroups ? value->dim() == 1 && value->size(0) == groups
                                                   : value->dim() == 2 && value->size(0) == n &&
                                                         value->size(1) == kNumLarsSums;
  const char* expected = shape == RowShape::kOne ? "one-element" : shape == RowShape::kGroups ? "[groups]" : "[params, LARS_SUMS]";
  const auto dtype = c10::CppTypeToScalarType<T>::value;
  TORCH_CHECK(value->device() == device && value->scalar_type() == dtype && shaped && value->is_contiguous(),
              "lightning_fusedsgd::", op, ": the step row's ", name, " must be a contiguous ", expected, " ", dtype,
              " tensor on ", device);
  return value->data_ptr<T>();
}

// The step row, each value checked against its declaration (LFSGD_STEP_ROW), for n tensors of `groups` groups.
inline StepRow read_row(const OptionalTensors& step, const at::Device& device, int64_t n, int64_t groups,
                        const char* op) {
  TORCH_CHECK(step.size() == kNumRowValues, "lightning_fusedsgd::", op, ": the step row has ", kNumRowValues,
              " values (_abi.STEP_ROW), got ", step.size());
  StepRow row;
  size_t index = 0;
#define LFSGD_ROW_READ(type, name, shape) \
  row.name = row_value<type>(step.get(index++), #name, shape, device, n, groups, op);
  LFSGD_STEP_ROW(LFSGD_ROW_READ)
#undef LFSGD_ROW_READ
  TORCH_CHECK((row.grad_sq_sum == nullptr) == (row.max_grad_norm == nullptr), "lightning_fusedsgd::", op,
              ": the step row's grad_sq_sum and max_grad_norm come together, or neither");
  return row;
}

// A tensor's slot `s`: checked laid out as its param (a count: one int64 on its device) in `dtype`.
inline void* checked_slot(const at::Tensor& value, const at::Tensor& param, Slot s, at::ScalarType dtype,
                          const char* op) {
  if (dtype == at::kLong) {  // a count
    TORCH_CHECK(value.device() == param.device() && value.scalar_type() == at::kLong && value.numel() == 1,
                "lightning_fusedsgd::", op, ": a ", kSlotNames[s], " must be a one-element int64 tensor on ",
                param.device());
  } else {
    check_same_layout(param, value, kSlotNames[s], op);
    TORCH_CHECK(value.scalar_type() == dtype, "lightning_fusedsgd::", op, ": a ", kSlotNames[s], " of ",
                param.scalar_type(), " params must be ", dtype, ", got ", value.scalar_type());
  }
  return value.data_ptr();
}

// Checks every argument of sgd_step or lars_sq_sums before a kernel writes anything, and decodes them: the slots a
// tensor holds must be those its group and dtype hold, in their dtypes (LFSGD_SLOTS' rules), and the kernel seeds
// only kGradient slots.
inline Bucket check_bucket(at::TensorList params, at::TensorList grads, at::TensorList state,
                           at::IntArrayRef state_slots, const at::Tensor& group_hparams, at::IntArrayRef tensor_group,
                           const OptionalTensors& step, const char* op) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && tensor_group.size() == n && state_slots.size() == n, "lightning_fusedsgd::", op,
              ": one grad, state_slots and tensor_group entry per param");
  Bucket bucket;
  bucket.params = params;
  bucket.grads = grads;
  bucket.tensor_group = tensor_group;
  bucket.groups = decode_table(group_hparams, op);
  if (n == 0) {
    TORCH_CHECK(state.empty() && step.size() == kNumRowValues, "lightning_fusedsgd::", op,
                ": no state for no params, and a step row of ", kNumRowValues, " values");
    return bucket;
  }
  const at::Tensor& first = params[0];
  const auto dtype = first.scalar_type();
  TORCH_CHECK(supported_dtype(dtype), "lightning_fusedsgd::", op, ": unsupported param dtype ", dtype);
  bucket.row = read_row(step, first.device(), static_cast<int64_t>(n), static_cast<int64_t>(bucket.groups.size()), op);
  const auto holds = [&](size_t t, Slot s) { return (state_slots[t] >> s & 1) != 0; };
  // One way of storing the weights per call (the first tensor's); LFSGD_SLOTS' rules check it is its group's.
  const bool masters = holds(0, kMasterParam);
  const bool compensations = holds(0, kKahanCompensation);
  bucket.weight = masters ? Weight::kMaster : compensations ? Weight::kKahan : Weight::kParam;
  size_t entry = 0;
  for (size_t t = 0; t < n; ++t) {
    const at::Tensor& p = params[t];
    TORCH_CHECK(tensor_group[t] >= 0 && tensor_group[t] < static_cast<int64_t>(bucket.groups.size()),
                "lightning_fusedsgd::", op, ": tensor_group out of range");
    TORCH_CHECK(p.device() == first.device() && p.scalar_type() == dtype, "lightning_fusedsgd::", op,
                ": one device and dtype per call");
    TORCH_CHECK(p.is_non_overlapping_and_dense(), "lightning_fusedsgd::", op, ": params must be dense");
    check_same_layout(p, grads[t], "grad", op);
    TORCH_CHECK(grads[t].scalar_type() == dtype, "lightning_fusedsgd::", op, ": grads must have their params' dtype");
    const GroupHParams& h = bucket.groups[tensor_group[t]];
    bucket.any_lars = bucket.any_lars || lars_adapts(h);
    TORCH_CHECK(options_in_range(h), "lightning_fusedsgd::", op, ": an option column out of range");
    TORCH_CHECK(!averages(h) || (h.ema_every >= 1 && h.ema_start >= 0), "lightning_fusedsgd::", op,
                ": ema_every must be >= 1 and ema_start >= 0");
    if (t == 0) bucket.schedule_free = h.schedule_free;
    TORCH_CHECK(h.schedule_free == bucket.schedule_free, "lightning_fusedsgd::", op,
                ": the tensors of one call step schedule-free, or none of them");
    TORCH_CHECK(holds(t, kKahanCompensation) == compensations, "lightning_fusedsgd::", op,
                ": the tensors of one call hold kahan_compensations, or none of them");
    const SlotRules rules = slot_rules(SlotFacts{dtype, masters, h});
    const int64_t seeded = state_slots[t] >> kNumSlots;
    TORCH_CHECK(state_slots[t] >= 0 && state_slots[t] < (int64_t{1} << (2 * kNumSlots)) &&
                    (seeded & ~(state_slots[t] & kKernelSeededSlots)) == 0,
                "lightning_fusedsgd::", op, ": state_slots entry ", state_slots[t], " out of range (the kernel seeds "
                "only held slots seeded from the gradient)");
    SlotPointers slots{};
    for (int s = 0; s < kNumSlots; ++s) {
      TORCH_CHECK(holds(t, static_cast<Slot>(s)) == rules.held[s], "lightning_fusedsgd::", op, ": tensor ", t,
                  "'s state_slots say it holds ", (rules.held[s] ? "no " : "a "), kSlotNames[s], ", but ", dtype,
                  " params of its group hold ", (rules.held[s] ? "one" : "none"), " (_abi.SLOTS)");
      if (!rules.held[s]) continue;
      TORCH_CHECK(entry < state.size(), "lightning_fusedsgd::", op, ": fewer state tensors than state_slots hold");
      slots.of[s] = checked_slot(state[entry++], p, static_cast<Slot>(s), rules.dtype[s], op);
    }
    bucket.slots.push_back(slots);
    bucket.first_step.push_back(seeded != 0);
  }
  TORCH_CHECK(entry == state.size(), "lightning_fusedsgd::", op, ": more state tensors than state_slots hold");
  return bucket;
}

// The sgd_step op of both kernels (the only place its C++ signature is written): checks the bucket, then runs a
// device's kernel, `Run(checked bucket)`. `unscaled_grad_sq_sum`: where given, the kernel adds the sum of squares
// of the gradients its norm pass takes (kGradSq), which given lars_sq_sums replace.
template <void (*Run)(const Bucket&)>
void sgd_step_op(at::TensorList params, at::TensorList grads, at::TensorList state, at::IntArrayRef state_slots,
                 const at::Tensor& group_hparams, at::IntArrayRef tensor_group, const OptionalTensors& step,
                 const std::optional<at::Tensor>& unscaled_grad_sq_sum) {
  Bucket bucket = check_bucket(params, grads, state, state_slots, group_hparams, tensor_group, step, "sgd_step");
  TORCH_CHECK(!bucket.schedule_free || (bucket.row.ckp1 != nullptr && bucket.row.lrs != nullptr),
              "lightning_fusedsgd::sgd_step: a schedule-free step takes the step row's ckp1 and lrs, which the "
              "schedule_free_scalars op gives (FusedSGDScheduleFree)");
  if (unscaled_grad_sq_sum.has_value()) {
    const at::Tensor& sum = *unscaled_grad_sq_sum;
    TORCH_CHECK(sum.scalar_type() == at::kDouble && sum.numel() == 1 && sum.is_contiguous() &&
                    (params.empty() || sum.device() == params[0].device()),
                "lightning_fusedsgd::sgd_step: unscaled_grad_sq_sum must be a one-element float64 tensor on the "
                "params' device");
    TORCH_CHECK(bucket.row.lars_sq_sums == nullptr, "lightning_fusedsgd::sgd_step: unscaled_grad_sq_sum takes the "
                "sums of the kernel's own norm pass, which given lars_sq_sums replace: a sharded step sums their "
                "grad_sq column instead");
    bucket.row.unscaled_grad_sq_sum = sum.data_ptr<double>();
  }
  Run(bucket);
}

// The op's function type, for typed calls through the dispatcher (PlanArguments).
using SgdStepFunction = decltype(sgd_step_op<nullptr>);

// The lars_sq_sums op of both kernels: checks the bucket, then a device's `Sums(checked bucket)`.
template <at::Tensor (*Sums)(const Bucket&)>
at::Tensor lars_sq_sums_op(at::TensorList params, at::TensorList grads, at::TensorList state,
                           at::IntArrayRef state_slots, const at::Tensor& group_hparams, at::IntArrayRef tensor_group,
                           const OptionalTensors& step) {
  return Sums(check_bucket(params, grads, state, state_slots, group_hparams, tensor_group, step, "lars_sq_sums"));
}

// schedule_lrs's arguments (documented with its schema in ops/__init__.py), all on one device.
inline void check_schedule_inputs(const at::Tensor& lrs, const at::Tensor& position, const at::Tensor& schedule,
                                  const at::Tensor& peaks, const std::optional<at::Tensor>& applied) {
  const auto on_device = [&](const at::Tensor& t) { return t.device() == lrs.device() && t.is_contiguous(); };
  TORCH_CHECK(lrs.scalar_type() == at::kDouble && lrs.dim() == 1 && lrs.is_contiguous(),
              "lightning_fusedsgd::schedule_lrs: lrs must be a contiguous float64 [groups] tensor");
  TORCH_CHECK(on_device(peaks) && peaks.scalar_type() == at::kDouble && peaks.sizes() == lrs.sizes(),
              "lightning_fusedsgd::schedule_lrs: peaks must be float64 [groups] on the lrs' device");
  TORCH_CHECK(on_device(position) && position.scalar_type() == at::kLong && position.numel() == 2,
              "lightning_fusedsgd::schedule_lrs: position must be int64 [applied steps, skipped steps] on the lrs' "
              "device");
  TORCH_CHECK(on_device(schedule) && schedule.scalar_type() == at::kDouble && schedule.dim() == 1 &&
                  schedule.size(0) >= kScheduleHeader,
              "lightning_fusedsgd::schedule_lrs: schedule must be a float64 row of at least ", kScheduleHeader,
              " values on the lrs' device");
  TORCH_CHECK(!applied.has_value() || (applied->device() == lrs.device() && applied->scalar_type() == at::kBool &&
                                       applied->numel() == 1),
              "lightning_fusedsgd::schedule_lrs: applied must be a one-element bool tensor on the lrs' device");
}

// schedule_free_scalars's scalars: float64 [kNumScheduleFreeScalars, groups] rows, contiguous.
inline void check_schedule_free_scalars(const at::Tensor& scalars, int64_t groups) {
  TORCH_CHECK(scalars.scalar_type() == at::kDouble && scalars.dim() == 2 &&
                  scalars.size(0) == kNumScheduleFreeScalars && scalars.size(1) == groups && scalars.is_contiguous(),
              "lightning_fusedsgd::schedule_free_scalars: scalars must be a contiguous float64 [",
              kNumScheduleFreeScalars, ", groups] tensor (_abi.SCHEDULE_FREE_SCALARS), with a column per row of "
              "group_hparams");
}

// The schedule_free_scalars op of both kernels: checks the scalars and the step row (of which it reads found_inf and
// lrs), then a device's `Run(scalars, groups, row)`.
template <void (*Run)(const at::Tensor&, const std::vector<GroupHParams>&, const StepRow&)>
void schedule_free_scalars_op(const at::Tensor& scalars, const at::Tensor& group_hparams, const OptionalTensors& step) {
  const char* op = "schedule_free_scalars";
  const std::vector<GroupHParams> groups = decode_table(group_hparams, op);
  check_schedule_free_scalars(scalars, static_cast<int64_t>(groups.size()));
  Run(scalars, groups, read_row(step, scalars.device(), 0, static_cast<int64_t>(groups.size()), op));
}

// The schedule_free_switch op of both kernels: checks the bucket as sgd_step's (the params standing in for the
// gradients, which a switch does not read), then a device's `Run(checked bucket, train)`.
template <void (*Run)(const Bucket&, bool)>
void schedule_free_switch_op(at::TensorList params, at::TensorList state, at::IntArrayRef state_slots,
                             const at::Tensor& group_hparams, at::IntArrayRef tensor_group, bool train) {
  const char* op = "schedule_free_switch";
  OptionalTensors no_row;
  for (int i = 0; i < kNumRowValues; ++i) no_row.push_back(std::nullopt);
  const Bucket bucket = check_bucket(params, params, state, state_slots, group_hparams, tensor_group, no_row, op);
  TORCH_CHECK(params.empty() || bucket.schedule_free, "lightning_fusedsgd::", op,
              ": the params of schedule-free groups only (their z is where they switch towards)");
  Run(bucket, train);
}

template <Weight kWeight>
using WeightTag = std::integral_constant<Weight, kWeight>;

// Calls run(param, aux, weight) with value tags of the bucket's types: the param type P, the aux stream's type A
// (the momentum buffer's or z's: fp32 beside fp32 masters) and WeightTag<weight> (check_bucket allows the
// combinations below).
template <typename Run>
void dispatch_bucket_types(at::ScalarType dtype, Weight weight, Run&& run) {
  using Param = WeightTag<Weight::kParam>;
  using Master = WeightTag<Weight::kMaster>;
  using Kahan = WeightTag<Weight::kKahan>;
  switch (dtype) {
    case at::kFloat:
      return run(float{}, float{}, Param{});
    case at::kDouble:
      return run(double{}, double{}, Param{});
    case at::kBFloat16:
      if (weight == Weight::kMaster) return run(c10::BFloat16{}, float{}, Master{});
      if (weight == Weight::kKahan) return run(c10::BFloat16{}, c10::BFloat16{}, Kahan{});
      return run(c10::BFloat16{}, c10::BFloat16{}, Param{});
    case at::kHalf:
      return weight == Weight::kMaster ? run(c10::Half{}, float{}, Master{}) : run(c10::Half{}, c10::Half{}, Param{});
    default:
      TORCH_CHECK(false, "lightning_fusedsgd: unsupported dtype ", dtype);
  }
}

}  // namespace lfsgd
