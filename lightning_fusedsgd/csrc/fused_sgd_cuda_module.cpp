// Python bindings of the CUDA kernel (fused_sgd_cuda.cu). Same contract as the CPU module's sgd_step.
#include <torch/extension.h>

#include <optional>
#include <vector>

#include "cached_step.h"

namespace lfsgd {
void sgd_step_cuda(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                   const std::vector<std::optional<at::Tensor>>& momentum_buffers,
                   const std::vector<at::Tensor>& master_params, const at::Tensor& group_hparams,
                   const std::vector<int64_t>& tensor_group, const std::vector<bool>& first_step,
                   const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf);
}  // namespace lfsgd

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sgd_step", &lfsgd::sgd_step_cuda,
        "Fused SGD/LARS step over one (device, dtype) bucket of CUDA tensors, with no host synchronization");
  lfsgd::bind_cached_step<&lfsgd::sgd_step_cuda>(m);
}
