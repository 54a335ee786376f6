// Runs a scheduled pure step inside one preallocated arena, following a memory plan it is given.
//
// It never plans. It takes the plan (ir::MemoryPlan, from passes::plan_memory) and the graph that
// plan was made for, lowered by passes::lower_out_variants, checks the plan
// (ir::verify_memory_plan), allocates the arena once and binds every call node by its target's
// schema:
//   * an out= node (kwarg-only Tensor(a!) arguments the node leaves out) writes its results into
//     their arena views, which the plan's buffers give, in result order;
//   * an in-place node (Tensor(a!) arguments, no returns) overwrites its donated state inputs, so
//     W_t and W_{t+1} (and M_t, M_{t+1}) share storage; its value is those inputs;
//   * everything else runs as in the plain Executor ("fallback": it allocates its result; the plan
//     counts such buffers in dynamic_bytes).
// Every out= call is checked: its results must still be the planned views (same storage, offset,
// sizes and strides). An out= kernel that uses `out` as scratch of another shape (torch 2.9's CPU
// mse_loss, huber_loss, soft_margin_loss and binary_cross_entropy resize it to the input's shape
// first: "Trying to resize storage that is not resizable" on an arena view), or that resizes or
// re-points it otherwise, runs its functional kernel instead, from that call on: the node joins
// fallbacks() and its arena buffer stays unused. Its views are put back as planned. plan() then counts
// the kernel's allocation: the node's buffers join plan().dynamic and dynamic_bytes (and peak_bytes())
// is recomputed, while they stay in plan().buffers (the arena holds their bytes, unused). The out=
// overload is marked unusable (ir::mark_out_kernel_unusable): later plans leave such nodes to their
// kernels.
// Results are bit-exact with runtime::Executor: the same kernels run on the same values.
//
// Donation (JAX donate_argnums semantics): with donate=True the first `num_state` inputs are
// consumed; the step overwrites them in place and returns them as outputs 1..num_state. The
// caller must not use the old values afterwards. Donated inputs must not share storage.
#pragma once

#include "ir/graph.h"
#include "ir/memory_plan.h"
#include "runtime/kernel.h"
#include "runtime/result_pool.h"
#include "runtime/run_loop.h"

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

namespace torch_ext::runtime {

class ArenaExecutor {
 public:
  // `plan`'s nodes must be `lowered`'s own.
  ArenaExecutor(std::unique_ptr<ir::Graph> lowered, ir::MemoryPlan plan, size_t num_state, bool donate);

  std::vector<c10::IValue> run(std::vector<c10::IValue> inputs);
  // Runs out= step k checked (see the header comment) and returns its value.
  c10::IValue run_out_step(size_t k, const ValueSlots& values, std::vector<c10::IValue>& stack);

  // The plan it was given, with the allocations of nodes whose out= kernel fell back at run time
  // counted in `dynamic` and `dynamic_bytes` (see the header comment).
  const ir::MemoryPlan& plan() const { return plan_; }
  const ir::Graph& graph() const { return *graph_; }
  int64_t num_out_variant() const { return num_out_; }
  int64_t num_inplace_updates() const { return num_inplace_; }
  // Allocating nodes that had no usable out= overload (their names).
  const std::vector<std::string>& fallbacks() const { return fallbacks_; }

 private:
  // An out= step's planned results and the functional kernel it falls back to (see above).
  struct OutGuard {
    std::vector<at::Tensor> views;  // the tensors bound as out= arguments, in result order
    std::vector<c10::Storage> storages;
    std::vector<int64_t> offsets;
    std::vector<std::vector<int64_t>> sizes, strides;
    std::unique_ptr<BoundKernel> functional;  // null when the operator has no functional overload
    bool use_functional = false;
  };
  struct Bound {
    BoundKernel kernel;
    std::unique_ptr<OutGuard> out;  // out= steps only
    std::vector<int64_t> inplace_results;  // for in-place updates: slots forming the result
    bool tuple_result = false;
  };

  std::unique_ptr<ir::Graph> graph_;
  ir::MemoryPlan plan_;
  size_t num_state_;
  bool donate_;
  std::vector<at::Tensor> arenas_;  // one per device the plan's buffers are on
  std::vector<const ir::Node*> placeholders_;
  std::vector<Bound> bound_;  // per step of the plan's order
  std::vector<Step> steps_;   // the shared run loop's steps (run_loop.h) over bound_
  std::vector<ir::Arg> outputs_;
  // Step k's out= kernel fell back: count its allocation in plan_ and mark the overload unusable.
  void count_allocated(size_t k);
  int64_t num_out_ = 0;
  int64_t num_inplace_ = 0;
  std::vector<std::string> fallbacks_;
  // Fresh results of functional updates the plan did not put in place (no donation), as in Executor.
  std::unique_ptr<ResultPool> pool_ = std::make_unique<ResultPool>();
};

}  // namespace torch_ext::runtime
