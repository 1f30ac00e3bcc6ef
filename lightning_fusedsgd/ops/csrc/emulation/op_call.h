// An emulated op's call (call_on_device, its CPU kernel): its arguments copied into device memory (emulated_memory.h),
// its kernel run with device memory closed to its host code, and the faults of both its kernels' threads
// (device_emulated.h) and its host code taken by one SIGSEGV handler; the arguments copied back.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <c10/core/CPUAllocator.h>
#include <setjmp.h>
#include <signal.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "device_emulated.h"
#include "emulated_memory.h"

namespace lfsgd::emulation {

// SIGSEGV: a kernel's fault ends its launch with an error; a fault of the op's host code in device memory jumps
// back to call_on_device; anything else goes to the previous handler (the instruction faults again there).
inline void on_fault(int, siginfo_t* info, void*) {
  Call* running = call;
  if (running != nullptr && pthread_equal(pthread_self(), running->thread)) {
    Fault fault{reinterpret_cast<uintptr_t>(info->si_addr), memory.find(reinterpret_cast<uintptr_t>(info->si_addr))};
    if (fiber_running()) end_fiber_with_fault(fault);
    if (running->opened == 0 && running->host_code_fault != nullptr && fault.region.has_value() &&
        fault.region->device) {
      running->fault = fault;
      siglongjmp(*running->host_code_fault, 1);
    }
  }
  struct sigaction fallback {};
  fallback.sa_handler = SIG_DFL;
  sigaction(SIGSEGV, running != nullptr ? &running->previous_handler : &fallback, nullptr);
}

// ATen ops of the call's thread open device memory while they run; one of the op's reading a device value on the
// host (whichever ATen op it calls does so) is noted.
inline std::unique_ptr<at::ObserverContext> on_aten_op_start(const at::RecordFunction& function) {
  if (on_call_thread() && call->op_running && std::strcmp(function.name(), "aten::_local_scalar_dense") == 0) {
    call->synchronized = "aten::_local_scalar_dense (.item(), or an ATen op reading a value on the host)";
  }
  open_device_memory();
  return nullptr;
}
inline void on_aten_op_end(const at::RecordFunction&, at::ObserverContext*) { close_device_memory(); }

// The tensor arguments (of a stack's slot) that are device memory: all but the hyperparameter table, which the ops
// read on the host (lightning_fusedsgd/ops/__init__.py).
inline bool is_host_argument(const c10::Argument& argument) { return argument.name() == "group_hparams"; }

// The copies of the arguments' storages in device memory, by the original storage (views of one storage share it).
class DeviceCopies {
 public:
  c10::IValue to_device(const c10::IValue& value) {
    if (value.isTensor()) return to_device(value.toTensor());
    if (value.isTensorList()) {
      c10::List<at::Tensor> copies;
      for (const at::Tensor& tensor : value.toTensorList().vec()) copies.push_back(to_device(tensor));
      return copies;
    }
    if (value.isList() && value.toList().elementType()->isSubtypeOf(*c10::OptionalType::ofTensor())) {
      c10::List<std::optional<at::Tensor>> copies;  // Tensor?[]: the step row, its absent values kept
      for (const c10::IValue& element : value.toListRef()) {
        copies.push_back(element.isNone() ? std::nullopt : std::optional<at::Tensor>(to_device(element.toTensor())));
      }
      return copies;
    }
    return value;
  }

  // Writes the device copies back to the original storages.
  void copy_back() const {
    for (const auto& [original, copy] : storages_) {
      if (copy.nbytes() > 0) std::memcpy(original.mutable_data(), copy.data(), copy.nbytes());
    }
  }

 private:
  at::Tensor to_device(const at::Tensor& tensor) {
    if (!tensor.defined() || !tensor.has_storage()) return tensor;
    const c10::Storage& original = tensor.storage();
    auto found = index_.find(original.unsafeGetStorageImpl());
    if (found == index_.end()) {
      const size_t bytes = original.nbytes();
      c10::Storage copy(c10::Storage::use_byte_size_t(), bytes, device_allocator.allocate(bytes), &device_allocator,
                        /*resizable=*/false);
      if (bytes > 0) std::memcpy(copy.mutable_data(), original.data(), bytes);
      found = index_.emplace(original.unsafeGetStorageImpl(), storages_.size()).first;
      storages_.emplace_back(original, std::move(copy));
    }
    return at::empty({0}, tensor.options())
        .set_(storages_[found->second].second, tensor.storage_offset(), tensor.sizes(), tensor.strides());
  }

  std::vector<std::pair<c10::Storage, c10::Storage>> storages_;  // (original, device copy)
  std::unordered_map<const c10::StorageImpl*, size_t> index_;
};

// The emulated runtime's part of an op call, set up and torn down around it.
class CallScope {
 public:
  CallScope() {
    TORCH_INTERNAL_ASSERT(!fiber_running(), "CUDA emulation: an op called from a kernel");
    call = &state_;
    state_.host_allocator = c10::GetCPUAllocator();
    // c10 keeps the highest priority it was given; the previous allocator comes back with it.
    c10::SetCPUAllocator(&device_allocator, /*priority=*/UINT8_MAX);
    struct sigaction handler {};
    handler.sa_sigaction = &on_fault;
    handler.sa_flags = SA_SIGINFO | SA_NODEFER;  // a kernel's fault leaves the handler by a fiber switch
    sigemptyset(&handler.sa_mask);
    sigaction(SIGSEGV, &handler, &state_.previous_handler);
    callbacks_ = at::addThreadLocalCallback(
        at::RecordFunctionCallback(&on_aten_op_start, &on_aten_op_end).scopes({at::RecordScope::FUNCTION}));
  }
  ~CallScope() {
    at::removeCallback(callbacks_);
    sigaction(SIGSEGV, &state_.previous_handler, nullptr);
    c10::SetCPUAllocator(state_.host_allocator, UINT8_MAX);
    call = nullptr;
  }
  CallScope(const CallScope&) = delete;
  CallScope& operator=(const CallScope&) = delete;

  Call& state() { return state_; }

 private:
  Call state_;
  at::CallbackHandle callbacks_ = 0;
};

inline std::mutex one_call_at_a_time;

// An emulated op's CPU kernel: its arguments copied to device memory, its kernel (PrivateUse1) run with device
// memory closed to its host code, the arguments copied back.
inline void call_on_device(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const std::lock_guard<std::mutex> one_call(one_call_at_a_time);
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  CallScope scope;
  Call& state = scope.state();
  DeviceCopies copies;
  const auto& arguments = op.schema().arguments();
  const size_t first = stack->size() - arguments.size();
  for (size_t i = 0; i < arguments.size(); ++i) {
    if (!is_host_argument(arguments[i])) (*stack)[first + i] = copies.to_device((*stack)[first + i]);
  }
  sigjmp_buf host_code_fault;
  bool faulted = false;
  try {
    if (sigsetjmp(host_code_fault, /*savemask=*/1) == 0) {
      state.host_code_fault = &host_code_fault;
      state.op_running = true;
      close_device_memory();
      op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), stack);
    } else {
      faulted = true;
    }
  } catch (...) {
    state.host_code_fault = nullptr;
    state.op_running = false;
    open_device_memory();
    copies.copy_back();
    throw;
  }
  state.host_code_fault = nullptr;
  state.op_running = false;
  open_device_memory();
  copies.copy_back();
  TORCH_CHECK(!faulted, "CUDA emulation: the host code of ", op.schema().name(), " touched device memory outside a ",
              "kernel, at ", describe(state.fault), ": on a GPU that is no host memory. Read and write device ",
              "memory in kernels, or through ATen ops (copies, fills, reductions) on device tensors.");
  TORCH_CHECK(state.synchronized == nullptr, "CUDA emulation: the host code of ", op.schema().name(), " read a ",
              "device value on the host, through ", state.synchronized, ", which waits for the device: the ops ",
              "keep their values on the device");
}

}  // namespace lfsgd::emulation
