// The one run loop of every runtime (torch.fx Interpreter.run): a list of steps prepared once,
// each a bound kernel with the slot it writes and the slots it reads for the last time.
//
// Executor, ArenaExecutor and the reactive Engine's sweep path (evaluate_patched) differ only in
// which steps they prepare and where values live; how a node runs is written once, here:
// invoke the kernel on the slots, store its value, release the dead slots. Runtimes that must
// do something per step (an in-place update's value) pass `after`; the loop itself keeps no
// bookkeeping, so a caller that counts does it once per run, not per node.
#pragma once

#include "runtime/kernel.h"

#include <cstdint>
#include <exception>
#include <vector>

namespace torch_ext::runtime {

struct Step {
  const BoundKernel* kernel = nullptr;  // owned by the runtime, alive as long as the steps
  int64_t out = 0;                      // slot written with the kernel's value
  std::vector<int64_t> release;         // slots read for the last time by this step (or never read)
  // An in-place step (the reactive sweep path, reactive/scratch.cpp): `kernel` overwrites the tensor
  // in slot `overwrites`. It runs only when that slot holds the one reference to a dense tensor and
  // to its storage, so that nothing else can see the write; otherwise `fallback` (the functional
  // kernel) runs. -1: a plain step.
  int64_t overwrites = -1;
  const BoundKernel* fallback = nullptr;
};

// Whether `v` is a dense tensor that nothing but this IValue references (no other handle, no view
// of its storage): writing it in place changes no value anyone else can read.
inline bool sole_owner(const c10::IValue& v) {
  if (!v.isTensor()) return false;
  const at::Tensor& t = v.toTensor();
  return t.use_count() == 1 && t.has_storage() && t.storage().use_count() == 1 && !t.is_inference() &&
         t.is_non_overlapping_and_dense();
}

// Per step i, after its value is stored and before its dead slots are released.
struct NoAfter {
  void operator()(size_t) const {}
};

// Runs `steps` in order on `values`. When step i throws, `on_error(i, e)` is called (steps [0, i)
// have completed; it must throw, naming the node), so the loop never swallows an error.
template <class OnError, class After = NoAfter>
void run_steps(const std::vector<Step>& steps, ValueSlots& values, std::vector<c10::IValue>& stack,
               OnError&& on_error, After&& after = After{}) {
  for (size_t i = 0; i < steps.size(); ++i) {
    const Step& s = steps[i];
    const BoundKernel* kernel = s.kernel;
    if (s.overwrites >= 0 && !sole_owner(values[s.overwrites])) kernel = s.fallback;
    try {
      values[s.out] = kernel->invoke(values, stack);
    } catch (const std::exception& e) {
      on_error(i, e);
      throw;  // on_error must throw; never continue past a failed node
    }
    after(i);
    for (int64_t r : s.release) values[r] = c10::IValue();
  }
}

// "while executing node %name: <message>" for an error from running `kernel` (c10::Error without
// its backtrace; kernels also throw std::length_error, std::bad_alloc ...).
[[noreturn]] void rethrow_executing(const BoundKernel& kernel, const std::exception& e);

}  // namespace torch_ext::runtime
