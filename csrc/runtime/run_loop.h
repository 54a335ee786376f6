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
};

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
    try {
      values[s.out] = s.kernel->invoke(values, stack);
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
