// The device interface (device.h) emulated on the CPU: CUDA's execution model, for exactly what the CUDA library
// (fused_sgd_cuda.cu, its kernels and launches) uses, so that a host compiler builds it as it is and it runs on CPU
// tensors (tests only).
//
// - A launch runs its blocks one after another, and each block's threads as fibers (stackful coroutines, fibers.h)
//   on the calling OS thread: a thread runs until it reaches __syncthreads, a warp shuffle or its end, then
//   another runs.
// - __syncthreads is a real barrier among the block's threads, and __shfl_down_sync one among the 32 lanes of a
//   warp, each lane reading what its source lane passed to the same call (warp-synchronous).
// - Blocks, and the threads between two barriers, run in an order a seed chooses (set_schedule): in order (0),
//   reversed (1), or shuffled (any other seed, anew for each block and at each barrier). The scheduler always
//   resumes the first thread in that order that can run, so the first threads run as far ahead of the others as
//   the barriers let them (a warp through its shuffles, up to the next __syncthreads). A kernel whose result
//   depends on that order has a race.
// - Shared arrays (LFSGD_SHARED) are mapped once per declaration and kernel instance, shared by the threads of the
//   running block, filled with 0xff bytes before each block, and end before an inaccessible page; device memory
//   is closed to host code outside launches (emulated_memory.h, which says how both are checked).
// - A barrier or a shuffle that not every thread of the block (lane of the warp) reaches is an error, where CUDA
//   would hang or be undefined; so is a shuffle of less than a full warp.
// - capturing() is a switch of the tests (set_capturing), so that the capture path's host code runs too; every
//   launch and copy completes before it returns.
// - A launch of more threads per block than the kernel's __launch_bounds__ fails, as on a GPU.
// - The math functions are the host's (glibc): a device's pow, cos or exp differs from them in the last bits, which
//   no emulated test can see (tests/test_device_claims.py runs the claims that meet this on CUDA).
//
// Fibers rather than an OS thread per CUDA thread: a 512-thread block would create and join hundreds of OS threads
// and wake them all through the kernel at each barrier; fibers switch in user space (a few nanoseconds, no system
// call on x86-64), and running one at a time makes the order of the threads the scheduler's choice, which is what
// makes races show.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "emulated_memory.h"
#include "fibers.h"

#define LFSGD_DEVICE_LIBRARY lightning_fusedsgd_cuda_emulated
// The emulated device's key: the ops' CPU kernels are the runtime's side of a call (call_on_device), which runs
// the kernels registered here.
#define LFSGD_DEVICE_DISPATCH PrivateUse1

// CUDA's spellings.
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
// __launch_bounds__(n): the largest block a kernel may be launched with (a GPU refuses a larger one). GCC keeps no
// attribute's value where code can read it back but this one: n NOPs at the function's entry, which the launch
// counts (declared_block_bound).
#define __launch_bounds__(max_threads, ...) __attribute__((patchable_function_entry((max_threads), 0)))
#define __shared__ static_assert(false, "declare shared arrays with LFSGD_SHARED (device.h)");
#define LFSGD_SHARED(T, name, count)                            \
  static ::lfsgd::emulation::SharedArray lfsgd_shared_##name; \
  T* const name = lfsgd_shared_##name.get<T>(count, ::lfsgd::emulation::settings.stats.blocks)

namespace lfsgd::emulation {

struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
};

// The running thread's indices and its launch's shape, set by the scheduler before it resumes a fiber.
inline thread_local Dim3 thread_idx, block_idx, block_dim, grid_dim;

#define threadIdx (::lfsgd::emulation::thread_idx)
#define blockIdx (::lfsgd::emulation::block_idx)
#define blockDim (::lfsgd::emulation::block_dim)
#define gridDim (::lfsgd::emulation::grid_dim)

constexpr size_t kStackBytes = 64 * 1024;  // a kernel's frames: a few KB (write_bytes_kernel's 4 KB parameter)
constexpr unsigned kWarp = 32;

// A CUDA thread of the running block.
struct Fiber {
  enum State { kReady, kAtBarrier, kAtShuffle, kDone };
  Context context;
  unsigned tid = 0;
  State state = kReady;
  unsigned shuffles = 0;  // shuffles this lane made: their parity picks the warp's slot buffer
};

// What the scheduler counts, for the tests: launches, blocks, threads run, barriers and shuffles passed.
struct Stats {
  int64_t launches = 0, blocks = 0, threads = 0, barriers = 0, shuffles = 0;
};

// The scheduling seed, the capture switch and the counts of this process.
struct Settings {
  int64_t seed = 0;
  bool capturing = false;
  Stats stats;
};
inline Settings settings;

// One launch being run: its block's fibers, the state of their barriers, and the scheduling order.
struct Launch {
  struct Warp {
    uint64_t slots[2][kWarp];
    unsigned arrived[2] = {0, 0};
  };
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  unsigned at_barrier = 0;
  std::vector<unsigned> order;     // the threads in scheduling order
  std::vector<unsigned> position;  // each thread's place in it
  std::vector<uint64_t> ready;     // a bit per place: its thread can run
  Fiber* running = nullptr;        // the fiber running, while one is
  std::string error;
  std::optional<Fault> fault;      // what a kernel's memory fault hit, and the thread that faulted
  unsigned fault_thread = 0;
  void (*invoke)(void*) = nullptr;  // runs the kernel with the launch's arguments
  void* body = nullptr;
  Context scheduler;  // where a fiber that waits or ends switches to
  std::mt19937_64 random;
};
inline thread_local Launch* current = nullptr;

// Fiber stacks, kept for the next launches of this OS thread.
inline thread_local std::vector<std::unique_ptr<char[]>> stacks;

// Back to the scheduler, from the running fiber.
inline void yield() {
  Launch& launch = *current;
  switch_context(launch.running->context, launch.scheduler);
}

// Ends the running fiber with an error the launch reports once the block stops.
[[noreturn]] inline void fail(const std::string& message) {
  Launch& launch = *current;
  if (launch.error.empty()) launch.error = message;
  launch.running->state = Fiber::kDone;
  yield();
  __builtin_unreachable();
}

// A fiber's life (`fiber`: its Fiber): the kernel, then back to the scheduler for good.
[[noreturn]] inline void run_fiber(void* fiber) {
  current->invoke(current->body);
  static_cast<Fiber*>(fiber)->state = Fiber::kDone;
  yield();
  __builtin_unreachable();
}

// Runs `fiber` until it waits or ends.
inline void resume(Launch& launch, Fiber& fiber) {
  launch.running = &fiber;
  thread_idx = Dim3{fiber.tid, 0, 0};
  switch_context(launch.scheduler, fiber.context);
  launch.running = nullptr;
}

inline bool fiber_running() { return current != nullptr && current->running != nullptr; }

// From the fault handler (op_call.h), on the faulting fiber's stack, which is left for good.
[[noreturn]] inline void end_fiber_with_fault(const Fault& fault) {
  Launch& launch = *current;
  if (!launch.fault.has_value()) {
    launch.fault = fault;
    launch.fault_thread = launch.running->tid;
  }
  launch.running->state = Fiber::kDone;
  yield();
  __builtin_unreachable();
}

// The order in which `count` things run: in order (seed 0), reversed (1), or shuffled.
inline std::vector<unsigned> schedule_order(Launch& launch, unsigned count) {
  std::vector<unsigned> order(count);
  std::iota(order.begin(), order.end(), 0u);
  if (settings.seed == 1) {
    std::reverse(order.begin(), order.end());
  } else if (settings.seed != 0) {
    std::shuffle(order.begin(), order.end(), launch.random);
  }
  return order;
}

inline void set_ready(Launch& launch, unsigned tid) {
  launch.fibers[tid].state = Fiber::kReady;
  const unsigned place = launch.position[tid];
  launch.ready[place / 64] |= uint64_t{1} << (place % 64);
}

// Orders the block's threads anew (a shuffled schedule draws a new order at each barrier).
inline void reorder(Launch& launch) {
  launch.order = schedule_order(launch, static_cast<unsigned>(launch.fibers.size()));
  for (unsigned place = 0; place < launch.order.size(); ++place) launch.position[launch.order[place]] = place;
  std::fill(launch.ready.begin(), launch.ready.end(), 0);
  for (Fiber& fiber : launch.fibers) {
    if (fiber.state == Fiber::kReady) set_ready(launch, fiber.tid);
  }
}

// The thread to resume: the first in the order that can run, or none (-1).
inline int next_ready(const Launch& launch) {
  for (size_t word = 0; word < launch.ready.size(); ++word) {
    if (launch.ready[word] != 0) return launch.order[word * 64 + __builtin_ctzll(launch.ready[word])];
  }
  return -1;
}

// Runs one block: always the first thread in the scheduling order that can run, until it waits or ends, until all
// have ended; none able to run before that is an error (a barrier or shuffle that not every thread reaches).
inline void run_block(Launch& launch, unsigned threads) {
  for (unsigned t = 0; t < threads; ++t) {
    launch.fibers[t] = Fiber{};
    launch.fibers[t].tid = t;
    start(launch.fibers[t].context, stacks[t].get(), kStackBytes, &run_fiber, &launch.fibers[t]);
  }
  launch.warps.assign((threads + kWarp - 1) / kWarp, Launch::Warp{});
  launch.at_barrier = 0;
  launch.position.resize(threads);
  launch.ready.assign((threads + 63) / 64, 0);
  reorder(launch);
  settings.stats.threads += threads;
  unsigned done = 0;
  while (done < threads && launch.error.empty()) {
    const int t = next_ready(launch);
    if (t < 0) {
      launch.error = "__syncthreads or a warp shuffle is not reached by every thread of block " +
                     std::to_string(block_idx.x) + " (CUDA would hang here)";
      break;
    }
    Fiber& fiber = launch.fibers[t];
    resume(launch, fiber);
    if (launch.fault.has_value()) {
      launch.error = "thread " + std::to_string(launch.fault_thread) + " of block " + std::to_string(block_idx.x) +
                     " accessed " + describe(*launch.fault) +
                     " (on a GPU: an illegal memory access, or another array's memory)";
    }
    if (fiber.state != Fiber::kReady) {
      const unsigned place = launch.position[fiber.tid];
      launch.ready[place / 64] &= ~(uint64_t{1} << (place % 64));
    }
    if (fiber.state == Fiber::kDone) ++done;
  }
  TORCH_CHECK(launch.error.empty(), "CUDA emulation: ", launch.error);
}

template <typename Body>
void invoke(void* body) {
  (*static_cast<Body*>(body))();
}

// The block size a kernel declared with __launch_bounds__: the NOPs at its entry (after the branch-target marker
// of a build with control-flow protection), or CUDA's limit of 1024 threads where it declared none.
inline int declared_block_bound(const void* kernel) {
  int nops = 0;
#if defined(__x86_64__)
  const auto* code = static_cast<const unsigned char*>(kernel);
  if (std::memcmp(code, "\xf3\x0f\x1e\xfa", 4) == 0) code += 4;  // endbr64
  while (code[nops] == 0x90) ++nops;
#elif defined(__aarch64__)
  const auto* code = static_cast<const uint32_t*>(kernel);
  if ((code[0] & 0xFFFFFF3Fu) == 0xD503241Fu) ++code;  // bti
  while (code[nops] == 0xD503201Fu) ++nops;
#endif  // elsewhere no bound is read: CUDA's limit alone applies
  return nops > 0 ? nops : 1024;
}

// A launch: `body` runs each thread of `blocks` blocks of `threads` threads.
template <typename Body>
void run_grid(int64_t blocks, int threads, Body& body) {
  TORCH_CHECK(threads > 0 && threads <= 1024 && blocks >= 0 && blocks < (int64_t{1} << 31),
              "CUDA emulation: a launch of ", blocks, " blocks of ", threads, " threads");
  TORCH_CHECK(current == nullptr, "CUDA emulation: a kernel launched from a kernel");
  const DeviceMemoryOpen device_memory;
  while (stacks.size() < static_cast<size_t>(threads)) stacks.push_back(std::make_unique<char[]>(kStackBytes));
  Launch launch;
  launch.fibers.resize(threads);
  launch.invoke = &invoke<Body>;
  launch.body = &body;
  launch.random.seed(static_cast<uint64_t>(settings.seed) * 0x9E3779B97F4A7C15ull + settings.stats.launches);
  ++settings.stats.launches;
  grid_dim = Dim3{static_cast<unsigned>(blocks), 1, 1};
  block_dim = Dim3{static_cast<unsigned>(threads), 1, 1};
  current = &launch;
  try {
    for (unsigned b : schedule_order(launch, static_cast<unsigned>(blocks))) {
      block_idx = Dim3{b, 0, 0};
      ++settings.stats.blocks;
      run_block(launch, static_cast<unsigned>(threads));
    }
  } catch (...) {
    current = nullptr;
    throw;
  }
  current = nullptr;
}

inline void block_barrier() {
  Launch& launch = *current;
  Fiber& fiber = *launch.running;
  fiber.state = Fiber::kAtBarrier;
  if (++launch.at_barrier == launch.fibers.size()) {
    launch.at_barrier = 0;
    ++settings.stats.barriers;
    for (Fiber& other : launch.fibers) other.state = Fiber::kReady;  // all were at the barrier
    reorder(launch);
  }
  yield();
}

template <typename T>
T shuffle_down(unsigned mask, T value, unsigned delta, int width) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= sizeof(uint64_t));
  Launch& launch = *current;
  Fiber& fiber = *launch.running;
  if (mask != 0xffffffffu || width != static_cast<int>(kWarp) || launch.fibers.size() % kWarp != 0) {
    fail("only full-warp shuffles (mask 0xffffffff, width 32, whole warps) are emulated");
  }
  const unsigned lane = fiber.tid % kWarp;
  Launch::Warp& warp = launch.warps[fiber.tid / kWarp];
  const unsigned buffer = fiber.shuffles++ & 1u;
  std::memcpy(&warp.slots[buffer][lane], &value, sizeof(T));
  fiber.state = Fiber::kAtShuffle;
  if (++warp.arrived[buffer] == kWarp) {
    warp.arrived[buffer] = 0;
    ++settings.stats.shuffles;
    for (unsigned l = 0; l < kWarp; ++l) set_ready(launch, fiber.tid - lane + l);
  }
  yield();
  T result = value;
  if (lane + delta < kWarp) std::memcpy(&result, &warp.slots[buffer][lane + delta], sizeof(T));
  return result;
}

}  // namespace lfsgd::emulation

inline void __syncthreads() { ::lfsgd::emulation::block_barrier(); }

template <typename T>
inline T __shfl_down_sync(unsigned mask, T value, unsigned delta, int width = 32) {
  return ::lfsgd::emulation::shuffle_down(mask, value, delta, width);
}

namespace lfsgd::device {

constexpr const char* kName = "CPU (emulated CUDA)";

using Stream = int;  // a stand-in: the emulation runs one stream, in order

struct Guard {
  explicit Guard(const at::Device&) {}
};

inline bool on_device(const at::Tensor& tensor) { return tensor.is_cpu(); }

inline Stream current_stream() { return 0; }

inline bool capturing() { return emulation::settings.capturing; }

// Host memory, pinned or not: every emulated copy completes before it returns.
inline at::Tensor host_buffer(int64_t bytes, bool) { return emulation::host_bytes(bytes); }

template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), int64_t blocks, int threads, Stream, Args&&... args) {
  const int bound = emulation::declared_block_bound(reinterpret_cast<const void*>(kernel));
  TORCH_CHECK(threads <= bound, "CUDA emulation: a launch of ", threads, " threads per block of a kernel declared ",
              "with __launch_bounds__(", bound, ")");
  auto body = [&]() { kernel(args...); };
  emulation::run_grid(blocks, threads, body);
}

}  // namespace lfsgd::device

// The tests' controls of the emulation.
TORCH_LIBRARY_FRAGMENT(lightning_fusedsgd_cuda_emulated, m) {
  m.def("set_schedule(int seed) -> ()", [](int64_t seed) { lfsgd::emulation::settings.seed = seed; });
  m.def("set_capturing(bool capturing) -> ()",
        [](bool capturing) { lfsgd::emulation::settings.capturing = capturing; });
  m.def("stats() -> int[]", []() {
    const auto& s = lfsgd::emulation::settings.stats;
    return std::vector<int64_t>{s.launches, s.blocks, s.threads, s.barriers, s.shuffles};
  });
}
