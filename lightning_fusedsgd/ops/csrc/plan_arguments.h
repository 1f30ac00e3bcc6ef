// The op arguments of a kept step plan, held in C++ (torch.classes.lightning_fusedsgd.PlanArguments): every param,
// whether it had a grad, views of the stepped params taken when the plan was made (their layouts and addresses),
// and each bucket's op arguments with views of its state (their layouts). It holds the plan, not the step: gather()
// (plain params) or take() (a sharded plan's local shards) checks that the plan still holds and collects this
// step's grads, and the optimizer's one step path (optim/_step.py) then calls grad_sq_sum and sgd_step per bucket,
// as it calls the ops for a plan made in Python. A step so converts no tensor lists from Python, which on models
// with thousands of tensors costs as much as the update. This is the one place that decides whether a kept plan
// still holds, for both kinds of plan.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bucket.h"

namespace lfsgd {

class PlanArguments : public torch::CustomClassHolder {
 public:
  // `ops`: the namespace whose grad_sq_sum and sgd_step run the plan (the compiled kernels', or the emulated CUDA
  // kernels').
  PlanArguments(std::vector<at::Tensor> params, c10::List<bool> has_grad, std::vector<at::Tensor> layouts,
                const std::string& ops)
      : params_(std::move(params)),
        has_grad_(has_grad.vec()),
        layouts_(std::move(layouts)),
        grad_sq_sum_(c10::Dispatcher::singleton()
                         .findSchemaOrThrow((ops + "::grad_sq_sum").c_str(), "")
                         .typed<at::Tensor(at::TensorList)>()),
        sgd_step_(c10::Dispatcher::singleton()
                      .findSchemaOrThrow((ops + "::sgd_step").c_str(), "")
                      .typed<SgdStepFunction>()) {
    TORCH_CHECK(params_.size() == has_grad_.size(), "PlanArguments: one has_grad entry per param");
  }

  // `positions`: each tensor's position among the stepped params (the order of `layouts`); `state` and
  // `state_slots` as sgd_step takes them.
  void add_bucket(std::vector<at::Tensor> params, std::vector<at::Tensor> state, std::vector<int64_t> state_slots,
                  std::vector<int64_t> tensor_group, std::vector<int64_t> positions) {
    for (int64_t position : positions) {
      TORCH_CHECK(position >= 0 && position < static_cast<int64_t>(layouts_.size()));
    }
    // Detached views keep the layouts as they are now; `.data = ...` later changes the live tensors only.
    std::vector<at::Tensor> state_layouts;
    for (const at::Tensor& tensor : state) state_layouts.push_back(tensor.detach());
    buckets_.push_back({std::move(params), std::move(state), std::move(state_slots), std::move(tensor_group),
                        std::move(positions), std::move(state_layouts), {}});
  }

  // Collects this step's grads (each param's .grad) into the buckets and returns true, or returns false, having
  // changed nothing, when the plan no longer holds: a param gained or lost its grad or moved to other memory, or a
  // param, grad or state tensor is laid out differently from what was recorded.
  bool gather() {
    return collect(params_, [this](size_t i) { return params_[i].grad(); });
  }

  // As gather(), for the local shards of DTensor params (whose grads are DTensors): `params` are the params' local
  // shards now, `grads` their grads' local shards (None where a param has no grad).
  bool take(std::vector<at::Tensor> params, c10::List<std::optional<at::Tensor>> grads) {
    TORCH_CHECK(params.size() == params_.size() && grads.size() == params_.size(),
                "PlanArguments: one param and grad entry per param");
    return collect(params, [&grads](size_t i) {
      const std::optional<at::Tensor> grad = grads.get(i);
      return grad.has_value() ? *grad : at::Tensor();
    });
  }

  // Bucket `b`'s grads, as the last gather() or take() collected them.
  std::vector<at::Tensor> grads(int64_t b) { return bucket(b).grads; }

  // lightning_fusedsgd::grad_sq_sum over bucket `b`'s grads (after gather()).
  at::Tensor grad_sq_sum(int64_t b) {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return grad_sq_sum_.call(bucket(b).grads);
  }

  // lightning_fusedsgd::sgd_step over bucket `b` (after gather()), with this step's table and step row, and where
  // it reports its gradient norm the sum to add it to.
  void sgd_step(int64_t b, const at::Tensor& group_hparams, const OptionalTensors& step,
                const std::optional<at::Tensor>& unscaled_grad_sq_sum) {
    // Straight to the CPU or CUDA kernel: the autograd and in-place fallbacks of a custom op box every argument
    // (thousands of tensors on large models). The step runs under no_grad.
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    Bucket& kept = bucket(b);
    sgd_step_.call(kept.params, kept.grads, kept.state, kept.state_slots, group_hparams, kept.tensor_group, step,
                   unscaled_grad_sq_sum);
    kept.grads.clear();  // the bucket's last use of them this step: the next backward may free them
  }

 private:
  struct Bucket {
    std::vector<at::Tensor> params;
    std::vector<at::Tensor> state;
    std::vector<int64_t> state_slots;  // no slot seeded by the kernel: a kept plan creates no state
    std::vector<int64_t> tensor_group;
    std::vector<int64_t> positions;
    std::vector<at::Tensor> state_layouts;  // the state as recorded
    std::vector<at::Tensor> grads;          // this step's, from gather()
  };

  Bucket& bucket(int64_t b) {
    TORCH_CHECK(b >= 0 && b < static_cast<int64_t>(buckets_.size()), "PlanArguments: no bucket ", b);
    return buckets_[b];
  }

  template <typename GradOf>
  bool collect(const std::vector<at::Tensor>& params, GradOf grad_of) {
    std::vector<at::Tensor> grads;
    grads.reserve(layouts_.size());
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor grad = grad_of(i);
      if (grad.defined() != has_grad_[i]) return false;
      if (!grad.defined()) continue;
      if (grads.size() >= layouts_.size()) return false;
      const at::Tensor& layout = layouts_[grads.size()];
      // A param moved to other memory (`p.data = ...`) is planned again: its overlap check must rerun.
      if (!same_layout(layout, params[i]) || params[i].data_ptr() != layout.data_ptr() ||
          !same_layout(layout, grad)) {
        return false;
      }
      // Complex params are stepped as their real views (as torch.optim.SGD does).
      grads.push_back(grad.is_complex() ? at::view_as_real(grad) : grad);
    }
    if (grads.size() != layouts_.size()) return false;
    for (const Bucket& bucket : buckets_) {
      if (!state_unchanged(bucket)) return false;
    }
    for (Bucket& bucket : buckets_) {
      bucket.grads.clear();
      for (int64_t position : bucket.positions) bucket.grads.push_back(grads[position]);
    }
    return true;
  }

  static bool same_layout(const at::Tensor& a, const at::Tensor& b) {
    return b.layout() == at::kStrided && b.scalar_type() == a.scalar_type() && b.device() == a.device() &&
           b.sizes() == a.sizes() && b.strides() == a.strides();
  }

  static bool state_unchanged(const Bucket& bucket) {
    for (size_t i = 0; i < bucket.state.size(); ++i) {
      if (!same_layout(bucket.state_layouts[i], bucket.state[i])) return false;
    }
    return true;
  }

  std::vector<at::Tensor> params_;
  std::vector<bool> has_grad_;
  std::vector<at::Tensor> layouts_;
  c10::TypedOperatorHandle<at::Tensor(at::TensorList)> grad_sq_sum_;
  c10::TypedOperatorHandle<SgdStepFunction> sgd_step_;
  std::vector<Bucket> buckets_;
};

inline void register_plan_arguments(torch::Library& m) {
  m.class_<PlanArguments>("PlanArguments")
      .def(torch::init<std::vector<at::Tensor>, c10::List<bool>, std::vector<at::Tensor>, std::string>())
      .def("add_bucket", &PlanArguments::add_bucket)
      .def("gather", &PlanArguments::gather)
      .def("take", &PlanArguments::take)
      .def("grads", &PlanArguments::grads)
      .def("grad_sq_sum", &PlanArguments::grad_sq_sum)
      .def("sgd_step", &PlanArguments::sgd_step);
}

}  // namespace lfsgd
