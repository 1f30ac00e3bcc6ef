// Host-side work shared by the CPU and CUDA sgd_step ops: one bucket's arguments are validated in full, and
// the hyperparameter table decoded, before a kernel writes anything.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>
#include <type_traits>
#include <vector>

#include "elements.h"
#include "schedule.h"
#include "sgd_math.h"

namespace lfsgd {

// A validated bucket: each group's hyperparameters, each tensor's slot in momentum_buffers and in rounding_steps
// (-1: none), and the step's clip_grad_norm_ coefficient's inputs.
struct BucketArgs {
  std::vector<GroupHParams> groups;
  std::vector<int64_t> buffer_slot;
  std::vector<int64_t> step_slot;
  Masters masters = Masters::kNone;
  bool any_lars = false;
};

// Whether a tensor's update is rounded stochastically: a bf16 param without masters or compensations in a group
// with update_rounding "stochastic". Such a tensor has a rounding_steps entry.
inline bool rounds_stochastically(at::ScalarType dtype, Masters masters, const GroupHParams& h) {
  return dtype == at::kBFloat16 && masters == Masters::kNone && h.update_rounding == kStochastic;
}

inline void check_same_layout(const at::Tensor& param, const at::Tensor& other, const char* what,
                              const char* op = "sgd_step") {
  TORCH_CHECK(other.device() == param.device() && other.sizes() == param.sizes() &&
                  other.strides() == param.strides(),
              "lightning_fusedsgd::", op, ": each ", what, " must match its param's device, shape and strides");
}

inline void check_scalar(const std::optional<at::Tensor>& value, const at::Device& device, const char* what,
                         at::ScalarType dtype = at::kFloat) {
  TORCH_CHECK(!value.has_value() || (value->device() == device && value->scalar_type() == dtype &&
                                     value->numel() == 1),
              "lightning_fusedsgd::sgd_step: ", what, " must be a one-element ", dtype, " tensor on ", device);
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

// What master_params hold, checked against the params: all fp32 masters of bf16/fp16 params, or all bf16
// compensations of bf16 params, laid out as their params.
inline Masters check_masters(at::TensorList params, at::TensorList master_params, const char* op) {
  if (master_params.empty()) return Masters::kNone;
  const auto dtype = params[0].scalar_type();
  const auto kind = master_params[0].scalar_type();
  TORCH_CHECK(kind == at::kBFloat16 ? dtype == at::kBFloat16 : (kind == at::kFloat && (dtype == at::kBFloat16 ||
                                                                                       dtype == at::kHalf)),
              "lightning_fusedsgd::", op, ": master_params are fp32 masters of bf16/fp16 params or bf16 "
              "compensations of bf16 params, got ", kind, " for ", dtype, " params");
  for (size_t t = 0; t < params.size(); ++t) {
    check_same_layout(params[t], master_params[t], "master param", op);
    TORCH_CHECK(master_params[t].scalar_type() == kind, "lightning_fusedsgd::", op,
                ": master_params must have one dtype");
  }
  return kind == at::kBFloat16 ? Masters::kCompensation : Masters::kFp32;
}

// sgd_step's arguments, as the op receives them (documented with its schema, lightning_fusedsgd/ops/__init__.py).
struct StepArgs {
  at::TensorList params;
  at::TensorList grads;
  at::TensorList momentum_buffers;
  at::TensorList master_params;
  at::TensorList rounding_steps;
  const at::Tensor& group_hparams;
  at::IntArrayRef tensor_group;
  const c10::List<bool>& first_step;
  const std::optional<at::Tensor>& grad_scale;
  const std::optional<at::Tensor>& found_inf;
  const std::optional<at::Tensor>& grad_sq_sum;
  std::optional<double> max_grad_norm;
  const std::optional<at::Tensor>& lars_sq_sums;
  const std::optional<at::Tensor>& lrs;
};

// Checks every argument before a kernel writes anything, and decodes the table.
inline BucketArgs check_bucket(const StepArgs& a) {
  const size_t n = a.params.size();
  TORCH_CHECK(a.grads.size() == n && a.tensor_group.size() == n && a.first_step.size() == n,
              "lightning_fusedsgd::sgd_step: one grad, group and first_step entry per param");
  TORCH_CHECK(a.master_params.empty() || a.master_params.size() == n,
              "lightning_fusedsgd::sgd_step: master_params must be empty or one per param");
  BucketArgs args;
  args.groups = decode_table(a.group_hparams, "sgd_step");
  if (n == 0) return args;
  const at::Tensor& first = a.params[0];
  const auto dtype = first.scalar_type();
  TORCH_CHECK(supported_dtype(dtype), "lightning_fusedsgd::sgd_step: unsupported param dtype ", dtype);
  args.masters = check_masters(a.params, a.master_params, "sgd_step");
  check_scalar(a.grad_scale, first.device(), "grad_scale");
  check_scalar(a.found_inf, first.device(), "found_inf");
  check_scalar(a.grad_sq_sum, first.device(), "grad_sq_sum", at::kDouble);
  TORCH_CHECK(a.max_grad_norm.has_value() == a.grad_sq_sum.has_value() &&
                  (!a.max_grad_norm.has_value() || *a.max_grad_norm > 0.0),
              "lightning_fusedsgd::sgd_step: max_grad_norm (> 0) and grad_sq_sum come together, or neither");
  const auto& sums = a.lars_sq_sums;
  TORCH_CHECK(!sums.has_value() || (sums->device() == first.device() && sums->scalar_type() == at::kDouble &&
                                    sums->dim() == 2 && sums->size(0) == static_cast<int64_t>(n) &&
                                    sums->size(1) == kNumLarsSums && sums->is_contiguous()),
              "lightning_fusedsgd::sgd_step: lars_sq_sums must be a contiguous float64 [params, ", kNumLarsSums,
              "] tensor on ", first.device(), " (the lars_sq_sums op's result)");
  const auto& lrs = a.lrs;
  TORCH_CHECK(!lrs.has_value() ||
                  (lrs->device() == first.device() && lrs->scalar_type() == at::kDouble && lrs->dim() == 1 &&
                   lrs->size(0) == static_cast<int64_t>(args.groups.size()) && lrs->is_contiguous()),
              "lightning_fusedsgd::sgd_step: lrs must be a contiguous float64 [groups] tensor on ", first.device());
  const auto buffer_dtype = args.masters == Masters::kFp32 ? at::kFloat : dtype;
  size_t slot = 0, step_slot = 0;
  for (size_t t = 0; t < n; ++t) {
    const at::Tensor& p = a.params[t];
    TORCH_CHECK(a.tensor_group[t] >= 0 && a.tensor_group[t] < static_cast<int64_t>(args.groups.size()),
                "lightning_fusedsgd::sgd_step: tensor_group out of range");
    TORCH_CHECK(p.device() == first.device() && p.scalar_type() == dtype,
                "lightning_fusedsgd::sgd_step: one device and dtype per call");
    TORCH_CHECK(p.is_non_overlapping_and_dense(), "lightning_fusedsgd::sgd_step: params must be dense");
    check_same_layout(p, a.grads[t], "grad");
    TORCH_CHECK(a.grads[t].scalar_type() == dtype, "lightning_fusedsgd::sgd_step: grads must have their params' dtype");
    const GroupHParams& h = args.groups[a.tensor_group[t]];
    args.any_lars = args.any_lars || lars_adapts(h);
    TORCH_CHECK(h.update_rounding >= kNearest && h.update_rounding <= kKahan,
                "lightning_fusedsgd::sgd_step: update_rounding column out of range");
    TORCH_CHECK((args.masters == Masters::kCompensation) == (dtype == at::kBFloat16 && args.masters != Masters::kFp32 &&
                                                              h.update_rounding == kKahan),
                "lightning_fusedsgd::sgd_step: bf16 params of a group with update_rounding 'kahan' (and no fp32 "
                "masters) come with their compensations, and only they");
    if (rounds_stochastically(dtype, args.masters, h)) {
      TORCH_CHECK(step_slot < a.rounding_steps.size(),
                  "lightning_fusedsgd::sgd_step: one rounding step per param rounded stochastically");
      const at::Tensor& count = a.rounding_steps[step_slot];
      TORCH_CHECK(count.device() == first.device() && count.scalar_type() == at::kLong && count.numel() == 1,
                  "lightning_fusedsgd::sgd_step: rounding_steps must be one-element int64 tensors on ", first.device());
      args.step_slot.push_back(static_cast<int64_t>(step_slot++));
    } else {
      args.step_slot.push_back(-1);
    }
    args.buffer_slot.push_back(h.momentum != 0.0 ? static_cast<int64_t>(slot++) : -1);
    if (h.momentum != 0.0) {
      TORCH_CHECK(slot <= a.momentum_buffers.size(),
                  "lightning_fusedsgd::sgd_step: one momentum buffer per param whose group has momentum");
      const at::Tensor& buffer = a.momentum_buffers[slot - 1];
      check_same_layout(p, buffer, "momentum buffer");
      TORCH_CHECK(buffer.scalar_type() == buffer_dtype, "lightning_fusedsgd::sgd_step: momentum buffers must be ",
                  buffer_dtype);
    }
  }
  TORCH_CHECK(slot == a.momentum_buffers.size(),
              "lightning_fusedsgd::sgd_step: one momentum buffer per param whose group has momentum");
  TORCH_CHECK(step_slot == a.rounding_steps.size(),
              "lightning_fusedsgd::sgd_step: one rounding step per param rounded stochastically");
  return args;
}

// The sgd_step op of both kernels (the only place its C++ signature is written): checks the bucket, then runs a
// device's kernel, `Run(arguments, checked bucket)`.
template <void (*Run)(const StepArgs&, const BucketArgs&)>
void sgd_step_op(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                 at::TensorList master_params, at::TensorList rounding_steps, const at::Tensor& group_hparams,
                 at::IntArrayRef tensor_group, const c10::List<bool>& first_step,
                 const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
                 const std::optional<at::Tensor>& grad_sq_sum, std::optional<double> max_grad_norm,
                 const std::optional<at::Tensor>& lars_sq_sums, const std::optional<at::Tensor>& lrs) {
  const StepArgs arguments{params,     grads,        momentum_buffers, master_params, rounding_steps,
                           group_hparams, tensor_group, first_step,    grad_scale,    found_inf,
                           grad_sq_sum, max_grad_norm, lars_sq_sums,   lrs};
  Run(arguments, check_bucket(arguments));
}

// The op's function type, for typed calls through the dispatcher (KeptPlan).
using SgdStepFunction = decltype(sgd_step_op<nullptr>);

// What check_norm_inputs returns: the groups' hyperparameters and what master_params hold.
struct NormInputs {
  std::vector<GroupHParams> groups;
  Masters masters = Masters::kNone;
};

// lars_sq_sums's arguments: params, grads and masters as sgd_step takes them, and each param's group row.
inline NormInputs check_norm_inputs(at::TensorList params, at::TensorList grads, at::TensorList master_params,
                                    const at::Tensor& group_hparams, at::IntArrayRef tensor_group,
                                    const std::optional<at::Tensor>& grad_scale) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && tensor_group.size() == n && (master_params.empty() || master_params.size() == n),
              "lightning_fusedsgd::lars_sq_sums: one grad and group entry (and master, or none) per param");
  NormInputs args;
  args.groups = decode_table(group_hparams, "lars_sq_sums");
  const std::vector<GroupHParams>& groups = args.groups;
  if (n == 0) return args;
  const at::Tensor& first = params[0];
  TORCH_CHECK(supported_dtype(first.scalar_type()), "lightning_fusedsgd::lars_sq_sums: unsupported param dtype ",
              first.scalar_type());
  check_scalar(grad_scale, first.device(), "grad_scale");
  for (size_t t = 0; t < n; ++t) {
    const at::Tensor& p = params[t];
    TORCH_CHECK(tensor_group[t] >= 0 && tensor_group[t] < static_cast<int64_t>(groups.size()),
                "lightning_fusedsgd::lars_sq_sums: tensor_group out of range");
    TORCH_CHECK(p.device() == first.device() && p.scalar_type() == first.scalar_type() &&
                    p.is_non_overlapping_and_dense() && grads[t].scalar_type() == p.scalar_type(),
                "lightning_fusedsgd::lars_sq_sums: dense params of one device and dtype, grads of their dtype");
    check_same_layout(p, grads[t], "grad", "lars_sq_sums");
  }
  args.masters = check_masters(params, master_params, "lars_sq_sums");
  return args;
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

template <Masters kMasters>
using MastersTag = std::integral_constant<Masters, kMasters>;

// Calls run(param, buffer, masters) with value tags of the bucket's types: the param type P, the momentum buffer
// type B (fp32 with fp32 masters) and MastersTag<masters> (check_masters allows the combinations below).
template <typename Run>
void dispatch_bucket_types(at::ScalarType dtype, Masters masters, Run&& run) {
  using None = MastersTag<Masters::kNone>;
  using Fp32 = MastersTag<Masters::kFp32>;
  using Compensation = MastersTag<Masters::kCompensation>;
  switch (dtype) {
    case at::kFloat:
      return run(float{}, float{}, None{});
    case at::kDouble:
      return run(double{}, double{}, None{});
    case at::kBFloat16:
      if (masters == Masters::kFp32) return run(c10::BFloat16{}, float{}, Fp32{});
      if (masters == Masters::kCompensation) return run(c10::BFloat16{}, c10::BFloat16{}, Compensation{});
      return run(c10::BFloat16{}, c10::BFloat16{}, None{});
    case at::kHalf:
      return masters == Masters::kFp32 ? run(c10::Half{}, float{}, Fp32{}) : run(c10::Half{}, c10::Half{}, None{});
    default:
      TORCH_CHECK(false, "lightning_fusedsgd::sgd_step: unsupported dtype ", dtype);
  }
}

}  // namespace lfsgd
