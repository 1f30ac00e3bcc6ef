// GPU memory as the CUDA emulation models it: device memory that host code cannot touch outside a launch, and
// allocations and __shared__ arrays that end where an inaccessible page begins. It knows nothing of kernels:
// device_emulated.h runs them, and op_call.h runs an op's call (and takes its faults) with both.
//
// - An emulated op's call runs through call_on_device (op_call.h: its CPU kernel; the op's own kernel is registered
//   for PrivateUse1, the emulated device). It copies each tensor argument but the host table (group_hparams) into
//   device memory, runs the op's kernel and copies them back; what the op allocates (tables, partial sums, its
//   results) is device memory too: the CPU allocator, for the call's thread during the call, maps it.
// - While the op's host code runs, every device page is inaccessible. Launches open them, and so do the ATen ops
//   the host code calls (its copies, fills and reductions, which a GPU runs on the device). Host code that reads
//   or writes device memory itself, where a GPU would fault or read another address space, fails the op with an
//   error naming the address; an ATen op that reads a device value on the host (.item(), a synchronization)
//   fails it too.
// - Each device allocation ends at a page's end, before an inaccessible page, and so does each __shared__ array
//   (LFSGD_SHARED), which is filled with 0xff bytes (NaN in floating point) before each block: a GPU's shared
//   memory holds whatever the last block left. An access past the end fails the launch, as compute-sanitizer
//   would report it, and so does any other fault of a kernel (a wild pointer); before the start is not checked.
// - A fault of host code is caught on the call's thread outside ATen ops; the op's frames are abandoned (what they
//   held leaks: the process is a failing test's) and the call raises the error. One op call runs at a time.
#pragma once

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <c10/core/CPUAllocator.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace lfsgd::emulation {

inline const uintptr_t kPage = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));

// One mapping: `pages` pages holding an allocation of `bytes` bytes that ends at their end, then an inaccessible
// page (the guard).
struct Region {
  uintptr_t base = 0;
  uintptr_t pages = 0;
  uintptr_t bytes = 0;
  bool device = false;  // device memory, else a __shared__ array
  uintptr_t guard() const { return base + pages * kPage; }
  uintptr_t data() const { return guard() - bytes; }
};

// The mappings, and whether device memory is open to whoever runs.
class Memory {
 public:
  void* map(uintptr_t bytes, bool device) {
    const uintptr_t pages = std::max<uintptr_t>(1, (bytes + kPage - 1) / kPage);
    void* base = mmap(nullptr, (pages + 1) * kPage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    TORCH_CHECK(base != MAP_FAILED, "CUDA emulation: cannot map ", bytes, " bytes of device memory");
    const Region region{reinterpret_cast<uintptr_t>(base), pages, bytes, device};
    const std::lock_guard<std::mutex> lock(mutex_);
    protect(region.guard(), kPage, PROT_NONE);
    if (device && !open_) protect(region.base, pages * kPage, PROT_NONE);
    regions_[region.base] = region;
    return reinterpret_cast<void*>(region.data());
  }

  void unmap(void* data) {
    const std::lock_guard<std::mutex> lock(mutex_);
    const auto found = containing(reinterpret_cast<uintptr_t>(data));
    TORCH_INTERNAL_ASSERT(found != regions_.end(), "CUDA emulation: freeing memory it did not map");
    munmap(reinterpret_cast<void*>(found->second.base), (found->second.pages + 1) * kPage);
    regions_.erase(found);
  }

  // Makes every device page accessible, or not.
  void set_open(bool open) {
    const std::lock_guard<std::mutex> lock(mutex_);
    open_ = open;
    for (const auto& [base, region] : regions_) {
      if (region.device) protect(base, region.pages * kPage, open ? PROT_READ | PROT_WRITE : PROT_NONE);
    }
  }

  // The mapping holding `address`, guard included. For the fault handler: it does not wait for the lock.
  std::optional<Region> find(uintptr_t address) {
    const std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
    if (!lock.owns_lock()) return std::nullopt;
    const auto found = containing(address);
    return found == regions_.end() ? std::nullopt : std::optional<Region>(found->second);
  }

 private:
  std::map<uintptr_t, Region>::iterator containing(uintptr_t address) {
    auto found = regions_.upper_bound(address);
    if (found == regions_.begin()) return regions_.end();
    --found;
    return address < found->second.guard() + kPage ? found : regions_.end();
  }

  static void protect(uintptr_t address, uintptr_t length, int protection) {
    TORCH_CHECK(mprotect(reinterpret_cast<void*>(address), length, protection) == 0,
                "CUDA emulation: mprotect failed: ", std::strerror(errno));
  }

  std::mutex mutex_;
  std::map<uintptr_t, Region> regions_;  // by base
  bool open_ = true;
};
inline Memory memory;

// What a fault hit: written by the signal handler, described afterwards.
struct Fault {
  uintptr_t address = 0;
  std::optional<Region> region;
};

inline std::string describe(const Fault& fault) {
  std::ostringstream out;
  out << "address 0x" << std::hex << fault.address << std::dec;
  if (!fault.region.has_value()) {
    out << ", which is no device memory (a wild pointer, or host memory)";
    return out.str();
  }
  const Region& r = *fault.region;
  const char* what = r.device ? "a device allocation" : "a __shared__ array";
  if (fault.address >= r.guard()) {
    out << ", " << fault.address - r.guard() << " bytes past the end of " << what << " of " << r.bytes << " bytes";
  } else {
    out << ", " << fault.address - r.data() << " bytes into " << what << " of " << r.bytes << " bytes";
  }
  return out.str();
}

// An op call in progress: its thread, whether the op's kernel (its host code and launches) runs, the launches and
// ATen ops holding device memory open (0 while host code runs: device memory is closed), where a fault of the
// host code jumps, and what it hit.
struct Call {
  pthread_t thread = pthread_self();
  bool op_running = false;
  int opened = 1;  // the call's own copies in and out
  sigjmp_buf* host_code_fault = nullptr;
  Fault fault;
  const char* synchronized = nullptr;  // an ATen op that read device memory on the host
  c10::Allocator* host_allocator = nullptr;
  struct sigaction previous_handler {};
};
inline Call* call = nullptr;

inline bool on_call_thread() { return call != nullptr && pthread_equal(pthread_self(), call->thread); }

// Device memory opened for a launch or an ATen op of the call's thread, and closed after it.
inline void open_device_memory() {
  if (on_call_thread() && call->opened++ == 0) memory.set_open(true);
}
inline void close_device_memory() {
  if (on_call_thread() && --call->opened == 0) memory.set_open(false);
}

struct DeviceMemoryOpen {
  DeviceMemoryOpen() { open_device_memory(); }
  ~DeviceMemoryOpen() { close_device_memory(); }
  DeviceMemoryOpen(const DeviceMemoryOpen&) = delete;
  DeviceMemoryOpen& operator=(const DeviceMemoryOpen&) = delete;
};

inline void unmap_device(void* data) { memory.unmap(data); }

// The CPU allocator during an op call: device memory for the call's thread, the previous allocator's memory for
// any other thread.
class DeviceAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t bytes) override {
    if (!on_call_thread()) return call_host_allocator()->allocate(bytes);
    if (bytes == 0) return {nullptr, c10::Device(c10::kCPU)};
    void* data = memory.map(bytes, /*device=*/true);
    return {data, data, &unmap_device, c10::Device(c10::kCPU)};
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }

 private:
  static c10::Allocator* call_host_allocator() {
    Call* running = call;
    return running != nullptr ? running->host_allocator : c10::GetDefaultCPUAllocator();
  }
};
inline DeviceAllocator device_allocator;

// Host memory, whatever allocator is current: what host code writes itself (staged tables).
inline at::Tensor host_bytes(int64_t bytes) {
  c10::Allocator* allocator = call != nullptr ? call->host_allocator : c10::GetCPUAllocator();
  return at::detail::empty_generic({bytes}, allocator, c10::DispatchKeySet(c10::DispatchKey::CPU), at::kByte,
                                   std::nullopt);
}

// A __shared__ array of one declaration (LFSGD_SHARED), mapped on first use, filled with 0xff before each block.
struct SharedArray {
  void* data = nullptr;
  int64_t block = -1;  // the block it was last filled for

  template <typename T>
  T* get(int64_t count, int64_t running_block) {
    const auto bytes = static_cast<uintptr_t>(count) * sizeof(T);
    if (data == nullptr) data = memory.map(bytes, /*device=*/false);
    if (block != running_block) {
      std::memset(data, 0xff, bytes);
      block = running_block;
    }
    return static_cast<T*>(data);
  }
};

}  // namespace lfsgd::emulation
