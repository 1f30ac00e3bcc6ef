// The CUDA library's source, fused_sgd_cuda.cu, built by the host compiler: device.h then takes the emulation of
// CUDA's execution model (device_emulated.h), and the ops run on CPU tensors under their own names
// (torch.ops.lightning_fusedsgd_cuda_emulated), for the tests.
#include "fused_sgd_cuda.cu"
