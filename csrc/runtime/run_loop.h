// The one run loop of every runtime (torch.fx Interpreter.run with run_node): a list of steps,
// each a bound kernel with the slot it writes and the slots it reads for the last time.
//
// Executor, ArenaExecutor and the reactive Engine (its demand path, evaluate_nodes, and its sweep
// path, evaluate_patched) differ only in which steps they prepare, where values live and what they
// do around a node; how a node runs is written once, here: invoke the kernel on the slots, store
// its value, release the dead slots. What a runtime does around a node goes into a Hooks object
// (NoHooks's members, hidden in a derived struct): the loop is a template, so a hook a runtime does
// not define compiles to nothing, and the executor's loop is the plain one.
//
// Not folded in: the token-granular row loop (Engine::evaluate_patched_rows, reactive/rows.cpp).
// Per node it narrows inputs to row ranges and swaps them into their slots (joining a cached tail
// on first read), replaces the kernel by row kernels (offset-masked SDPA, column-picked
// linear/matmul, row-sized reshape/expand), counts fractional evaluations, and may stop half way
// for the whole-cone fallback. Through hooks, every line of that would move into them and the loop
// would keep only the `for`: no clearer, so it keeps its own loop.
#pragma once

#include "runtime/kernel.h"

#include <cstdint>
#include <exception>
#include <utility>
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

// What a runtime does around each step, beyond running it. A runtime derives from NoHooks and
// hides the members it needs; the defaults inline to nothing.
struct NoHooks {
  // Before step i runs; `current` is the value in its slot, the one the step would replace. false
  // skips the step: no kernel runs and nothing is stored (its dead slots are still released). May
  // throw; the node has then not run and the error is the hook's own.
  bool before(size_t /*i*/, const c10::IValue& /*current*/) { return true; }
  // Stores step i's value `v` into `slot`, which still holds the value `v` replaces.
  void store(size_t /*i*/, c10::IValue& slot, c10::IValue&& v) { slot = std::move(v); }
  // Per step i that ran, after its value is stored and before its dead slots are released.
  void after(size_t /*i*/) {}
};

// NoHooks with `f(i)` as `after`.
template <class F>
struct AfterEach : NoHooks {
  F f;
  explicit AfterEach(F fn) : f(std::move(fn)) {}
  void after(size_t i) { f(i); }
};
template <class F>
AfterEach<F> after_each(F f) {
  return AfterEach<F>(std::move(f));
}

// Runs `steps` in order on `values`. When step i's kernel throws, `on_error(i, e)` is called (steps
// [0, i) have completed; it must throw, naming the node), so the loop never swallows an error.
template <class OnError, class Hooks = NoHooks>
void run_steps(const std::vector<Step>& steps, ValueSlots& values, std::vector<c10::IValue>& stack,
               OnError&& on_error, Hooks&& hooks = Hooks{}) {
  for (size_t i = 0; i < steps.size(); ++i) {
    const Step& s = steps[i];
    c10::IValue& slot = values[s.out];  // `values` is never resized while the loop runs
    if (hooks.before(i, slot)) {
      const BoundKernel* kernel = s.kernel;
      if (s.overwrites >= 0 && !sole_owner(values[s.overwrites])) kernel = s.fallback;
      c10::IValue v;
      try {
        v = kernel->invoke(values, stack);
      } catch (const std::exception& e) {
        on_error(i, e);
        throw;  // on_error must throw; never continue past a failed node
      }
      hooks.store(i, slot, std::move(v));
      hooks.after(i);
    }
    for (int64_t r : s.release) values[r] = c10::IValue();
  }
}

// "while executing node %name: <message>" for an error from running `kernel` (c10::Error without
// its backtrace; kernels also throw std::length_error, std::bad_alloc ...).
[[noreturn]] void rethrow_executing(const BoundKernel& kernel, const std::exception& e);

}  // namespace torch_ext::runtime
