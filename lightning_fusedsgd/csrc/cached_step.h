// A validated step kept in C++ for reuse, shared by the CPU and CUDA modules: every param, whether it had a
// grad, views of the stepped params taken when the plan was made (their layouts), and each bucket's kernel
// arguments. A step then converts no tensor lists from Python: run() gathers this step's grads, checks
// them, and runs every bucket through `kStep` (the module's sgd_step).
#pragma once

#include <torch/extension.h>

#include <optional>
#include <utility>
#include <vector>

namespace lfsgd {

using StepFunction = void (*)(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                              const std::vector<std::optional<at::Tensor>>& momentum_buffers,
                              const std::vector<at::Tensor>& master_params, const at::Tensor& group_hparams,
                              const std::vector<int64_t>& tensor_group, const std::vector<bool>& first_step,
                              const std::optional<at::Tensor>& grad_scale,
                              const std::optional<at::Tensor>& found_inf);

template <StepFunction kStep>
class CachedStep {
 public:
  CachedStep(std::vector<at::Tensor> params, std::vector<bool> has_grad, std::vector<at::Tensor> layouts)
      : params_(std::move(params)), has_grad_(std::move(has_grad)), layouts_(std::move(layouts)) {
    TORCH_CHECK(params_.size() == has_grad_.size(), "CachedStep: one has_grad entry per param");
  }

  // `slots`: each tensor's position among the stepped params (the order of `layouts`).
  void add_bucket(std::vector<at::Tensor> params, std::vector<std::optional<at::Tensor>> momentum_buffers,
                  std::vector<at::Tensor> master_params, std::vector<int64_t> tensor_group,
                  std::vector<int64_t> slots) {
    for (int64_t slot : slots) TORCH_CHECK(slot >= 0 && slot < static_cast<int64_t>(layouts_.size()));
    buckets_.push_back({std::move(params), std::move(momentum_buffers), std::move(master_params),
                        std::move(tensor_group), std::move(slots)});
  }

  // Runs the step and returns true, or returns false having changed nothing when the plan no longer holds:
  // a param gained or lost its grad, or a param or grad is laid out differently from what was recorded.
  bool run(const at::Tensor& group_hparams, const std::optional<at::Tensor>& grad_scale,
           const std::optional<at::Tensor>& found_inf) const {
    std::vector<at::Tensor> grads;
    grads.reserve(layouts_.size());
    for (size_t i = 0; i < params_.size(); ++i) {
      const at::Tensor& grad = params_[i].grad();
      if (grad.defined() != has_grad_[i]) return false;
      if (!grad.defined()) continue;
      if (grads.size() >= layouts_.size()) return false;
      const at::Tensor& layout = layouts_[grads.size()];
      if (!same_layout(layout, params_[i]) || !same_layout(layout, grad)) return false;
      grads.push_back(grad);
    }
    if (grads.size() != layouts_.size()) return false;
    for (const Bucket& bucket : buckets_) {
      std::vector<at::Tensor> bucket_grads;
      bucket_grads.reserve(bucket.slots.size());
      for (int64_t slot : bucket.slots) bucket_grads.push_back(grads[slot]);
      kStep(bucket.params, bucket_grads, bucket.momentum_buffers, bucket.master_params, group_hparams,
            bucket.tensor_group, std::vector<bool>(bucket.params.size(), false), grad_scale, found_inf);
    }
    return true;
  }

 private:
  struct Bucket {
    std::vector<at::Tensor> params;
    std::vector<std::optional<at::Tensor>> momentum_buffers;
    std::vector<at::Tensor> master_params;
    std::vector<int64_t> tensor_group;
    std::vector<int64_t> slots;
  };

  static bool same_layout(const at::Tensor& a, const at::Tensor& b) {
    return b.layout() == at::kStrided && b.scalar_type() == a.scalar_type() && b.device() == a.device() &&
           b.sizes() == a.sizes() && b.strides() == a.strides();
  }

  std::vector<at::Tensor> params_;
  std::vector<bool> has_grad_;
  std::vector<at::Tensor> layouts_;
  std::vector<Bucket> buckets_;
};

// Binds CachedStep<kStep> as the module's `CachedStep`.
template <StepFunction kStep, typename Module>
void bind_cached_step(Module& m) {
  using Step = CachedStep<kStep>;
  pybind11::class_<Step>(m, "CachedStep")
      .def(pybind11::init<std::vector<at::Tensor>, std::vector<bool>, std::vector<at::Tensor>>())
      .def("add_bucket", &Step::add_bucket)
      .def("run", &Step::run, "Run the cached step; false (nothing changed) if it no longer holds");
}

}  // namespace lfsgd
