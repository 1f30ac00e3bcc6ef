// Fibers: stackful coroutines that one OS thread switches between in user space, for the emulation's CUDA threads
// (device_emulated.h, which schedules them). A fiber's Context is where it continues when switched to; start()
// makes a context run a function on a stack of its own, and switch_context() saves the running context and
// continues another. Knows nothing of CUDA or of what the fibers run.
//
// On x86-64 a switch is a dozen instructions of assembly (the callee-saved registers, MXCSR and the x87 control word,
// as the System V ABI keeps them across a call; no system call, a few nanoseconds); elsewhere, ucontext, which also
// saves the signal mask (a system call).
#pragma once

#include <cstddef>
#include <cstdint>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#if defined(__x86_64__)
// Saves the callee-saved registers, MXCSR and the x87 control word on the current stack, stores the stack pointer in
// *save and continues on the stack `load` (whose top holds the same). lfsgd_emulation_entry starts a fiber: it calls
// the function in r12 with the argument in rbx.
extern "C" void lfsgd_emulation_switch(void** save, void* load);
extern "C" void lfsgd_emulation_entry();
asm(R"(
  .pushsection .text
  .p2align 4
  .globl lfsgd_emulation_switch
  .hidden lfsgd_emulation_switch
  .type lfsgd_emulation_switch, @function
lfsgd_emulation_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size lfsgd_emulation_switch, .-lfsgd_emulation_switch
  .p2align 4
  .globl lfsgd_emulation_entry
  .hidden lfsgd_emulation_entry
  .type lfsgd_emulation_entry, @function
lfsgd_emulation_entry:
  movq %rbx, %rdi
  callq *%r12
  ud2
  .size lfsgd_emulation_entry, .-lfsgd_emulation_entry
  .popsection
)");
#endif

namespace lfsgd::emulation {

// Where a fiber, or the code that switches to fibers, continues when switched to.
struct Context {
#if defined(__x86_64__)
  void* sp = nullptr;
#else
  ucontext_t context;
#endif
};

// A fiber's function: it never returns (it ends by switching away for good).
using FiberFunction = void (*)(void*);

// Saves the running context in `save` and continues `load`.
inline void switch_context(Context& save, Context& load) {
#if defined(__x86_64__)
  lfsgd_emulation_switch(&save.sp, load.sp);
#else
  swapcontext(&save.context, &load.context);
#endif
}

#if !defined(__x86_64__)
// makecontext passes ints: the function and its argument, each in two halves.
inline void start_trampoline(unsigned function_high, unsigned function_low, unsigned argument_high,
                             unsigned argument_low) {
  const auto function = (static_cast<uintptr_t>(function_high) << 32) | function_low;
  const auto argument = (static_cast<uintptr_t>(argument_high) << 32) | argument_low;
  reinterpret_cast<FiberFunction>(function)(reinterpret_cast<void*>(argument));
}
#endif

// Makes `context` run function(argument) on `stack` (of `bytes` bytes) when it is switched to.
inline void start(Context& context, char* stack, size_t bytes, FiberFunction function, void* argument) {
#if defined(__x86_64__)
  const uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + bytes) & ~uintptr_t{15};
  auto* frame = reinterpret_cast<uintptr_t*>(top - 80);  // what lfsgd_emulation_switch pops, in its order
  uint32_t mxcsr;
  uint16_t control;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(control));
  frame[0] = mxcsr | (static_cast<uintptr_t>(control) << 32);
  frame[1] = frame[2] = frame[3] = 0;                                  // r15, r14, r13
  frame[4] = reinterpret_cast<uintptr_t>(function);                    // r12
  frame[5] = reinterpret_cast<uintptr_t>(argument);                    // rbx
  frame[6] = 0;                                                        // rbp
  frame[7] = reinterpret_cast<uintptr_t>(&lfsgd_emulation_entry);      // return address
  context.sp = frame;
#else
  getcontext(&context.context);
  context.context.uc_stack.ss_sp = stack;
  context.context.uc_stack.ss_size = bytes;
  context.context.uc_link = nullptr;
  const auto f = reinterpret_cast<uintptr_t>(function);
  const auto a = reinterpret_cast<uintptr_t>(argument);
  makecontext(&context.context, reinterpret_cast<void (*)()>(&start_trampoline), 4, static_cast<unsigned>(f >> 32),
              static_cast<unsigned>(f), static_cast<unsigned>(a >> 32), static_cast<unsigned>(a));
#endif
}

}  // namespace lfsgd::emulation
