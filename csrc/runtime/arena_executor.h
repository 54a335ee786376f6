// Runs a scheduled pure step inside one preallocated arena.
//
// Construction plans memory (passes::plan_memory) for the graph's current order, allocates the
// arena once and binds every call node:
//   * a node whose results plan_memory put in the arena writes them into their fixed arena views
//     through its out= overload (ir::find_out_variant: one with a kernel of its own, so no copy);
//   * a torch_ext::*_update node whose alias was applied (donate=True) runs its in-place variant
//     on the donated state tensors, so W_t and W_{t+1} (and M_t, M_{t+1}) share storage;
//   * everything else runs as in the plain Executor ("fallback": it allocates its result; the plan
//     counts such buffers in dynamic_bytes).
// Results are bit-exact with runtime::Executor: the same kernels run on the same values.
//
// Donation (JAX donate_argnums semantics): with donate=True the first `num_state` inputs are
// consumed; the step overwrites them in place and returns them as outputs 1..num_state. The
// caller must not use the old values afterwards. Donated inputs must not share storage.
#pragma once

#include "ir/graph.h"
#include "passes/plan_memory.h"
#include "runtime/kernel.h"

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

namespace torch_ext::runtime {

class ArenaExecutor {
 public:
  ArenaExecutor(const ir::Graph& scheduled, size_t num_state, bool donate);

  std::vector<c10::IValue> run(std::vector<c10::IValue> inputs);

  const passes::MemoryPlan& plan() const { return plan_; }
  int64_t num_out_variant() const { return num_out_; }
  int64_t num_inplace_updates() const { return num_inplace_; }
  // Allocating nodes that had no usable out= overload (their names).
  const std::vector<std::string>& fallbacks() const { return fallbacks_; }

 private:
  struct Step {
    BoundKernel kernel;
    int64_t slot = 0;
    std::vector<int64_t> inplace_results;  // for in-place updates: slots forming the result
    bool tuple_result = false;
  };

  std::unique_ptr<ir::Graph> graph_;
  passes::MemoryPlan plan_;
  size_t num_state_;
  bool donate_;
  at::Tensor arena_;
  std::vector<const ir::Node*> placeholders_;
  std::vector<Step> steps_;
  std::vector<std::vector<int64_t>> release_after_;
  std::vector<ir::Arg> outputs_;
  int64_t num_out_ = 0;
  int64_t num_inplace_ = 0;
  std::vector<std::string> fallbacks_;
};

}  // namespace torch_ext::runtime
