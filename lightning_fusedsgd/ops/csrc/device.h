// What the CUDA kernels' host code needs from a device runtime, behind one small interface (namespace
// lfsgd::device) with two implementations: CUDA's (device_cuda.h, under nvcc) and an emulation of CUDA's execution
// model on the CPU (emulation/device_emulated.h, under a host compiler), which runs the same kernels and host code on CPU
// tensors, for the tests. The interface:
//   LFSGD_DEVICE_LIBRARY, LFSGD_DEVICE_DISPATCH  the op library and dispatch key the kernels register under
//   kName, on_device(tensor)                     the device's name, and whether a tensor lives there
//   Stream, current_stream(), Guard              the stream kernels are queued on, and the device guard
//   capturing()                                  whether the current stream is being captured into a graph
//   host_buffer(bytes, pinned)                   host memory that tables are staged in, pinned where asked (CUDA)
//   launch(kernel, blocks, threads, stream, args...)  kernel<<<blocks, threads, 0, stream>>>(args...)
//   LFSGD_SHARED(T, name, count);                a kernel's __shared__ T name[count]
#pragma once

#ifdef __CUDACC__
#include "device_cuda.h"
#else
#include "emulation/device_emulated.h"
#endif
