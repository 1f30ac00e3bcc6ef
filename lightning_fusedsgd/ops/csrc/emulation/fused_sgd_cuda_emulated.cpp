// The CUDA library's source, fused_sgd_cuda.cu, built by the host compiler: device.h then takes the emulation of
// CUDA's execution model (emulation/device_emulated.h), and the ops run on CPU tensors under their own names
// (torch.ops.lightning_fusedsgd_cuda_emulated), for the tests.
//
// Blocks of 2560 elements (5 x 512 threads) rather than 65536, so that small tensors cross every loop's
// boundaries: the update's unrolled loop (2048 elements a pass) makes a full and a partial pass over a chunk, and
// a tensor has more chunks than a block has threads (the LARS rows' loop) from 1.3M elements rather than 34M.
#define LFSGD_BLOCK_CHUNK_ELEMS 2560
#include "fused_sgd_cuda.cu"
#include "op_call.h"

namespace lfsgd::emulation {

// Kernels that do what a GPU faults on, for the tests of the emulation's checks (faulty_access).
__global__ void write_shared_kernel() {
  LFSGD_SHARED(double, values, 8);
  values[threadIdx.x] = 1.0;
}

__global__ void copy_element_kernel(float* data, int64_t from) { data[0] = data[from]; }

__global__ void __launch_bounds__(64) bounded_kernel(float* data) {
  if (threadIdx.x == 0) data[0] = static_cast<float>(blockDim.x);
}

void faulty_access(c10::string_view kind, const at::Tensor& data) {
  TORCH_CHECK(data.scalar_type() == at::kFloat && data.numel() > 0, "faulty_access: a float tensor");
  if (kind == "shared_past_end") {
    device::launch(&write_shared_kernel, 1, 32, 0);  // 32 threads, 8 elements
  } else if (kind == "device_past_end") {
    device::launch(&copy_element_kernel, 1, 1, 0, data.data_ptr<float>(), data.numel());
  } else if (kind == "wild_pointer") {
    device::launch(&copy_element_kernel, 1, 1, 0, reinterpret_cast<float*>(uintptr_t{64}), int64_t{1});
  } else if (kind == "past_launch_bounds") {
    device::launch(&bounded_kernel, 1, 128, 0, data.data_ptr<float>());  // declared for 64 threads
  } else if (kind == "host_read") {
    const volatile float* element = data.data_ptr<float>();
    data.fill_(*element);
  } else if (kind == "host_item") {
    const volatile float sum = data.sum().item<float>();
    static_cast<void>(sum);
  } else {
    TORCH_CHECK(kind == "device_in_bounds", "faulty_access: no kind ", kind);
    device::launch(&copy_element_kernel, 1, 1, 0, data.data_ptr<float>(), data.numel() - 1);
    device::launch(&bounded_kernel, 1, 64, 0, data.data_ptr<float>() + 1);
  }
}

}  // namespace lfsgd::emulation

TORCH_LIBRARY_FRAGMENT(lightning_fusedsgd_cuda_emulated, m) {
  m.def("launch_geometry() -> int[]",
        [] { return std::vector<int64_t>{lfsgd::kThreads, lfsgd::kUnroll, lfsgd::kBlockChunkElems}; });
  m.def("faulty_access(str kind, Tensor(a!) data) -> ()");
}

TORCH_LIBRARY_IMPL(lightning_fusedsgd_cuda_emulated, PrivateUse1, m) {
  m.impl("faulty_access", &lfsgd::emulation::faulty_access);
}

// Each op's CPU kernel is the host side of its call (emulated_memory.h).
TORCH_LIBRARY_IMPL(lightning_fusedsgd_cuda_emulated, CPU, m) {
  for (const char* op : {"sgd_step", "grad_sq_sum", "lars_sq_sums", "schedule_lrs", "schedule_free_scalars",
                         "schedule_free_switch", "faulty_access"}) {
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&lfsgd::emulation::call_on_device>());
  }
}
