// One-shot dispatcher executor: runs every call node of a graph in order
// through its BoundKernel and frees each value right after its last use. The
// optimizer updates' fresh results come from a ResultPool, so the state a run
// returns is recycled by a later run once the caller drops it; every other CPU
// block the run allocates comes from a CallPool, so the next run reuses it warm.
//
// Inputs are given in placeholder order. Tensor inputs are checked against the
// placeholder's dtype and shape (a clear error names the placeholder), and one
// laid out otherwise than traced runs as a copy in the traced strides
// (to_traced_layout), unless a call writes it in place; the graph is verified
// once at construction.
#pragma once

#include "ir/graph.h"
#include "runtime/call_pool.h"
#include "runtime/kernel.h"
#include "runtime/result_pool.h"
#include "runtime/run_loop.h"

#include <functional>
#include <memory>
#include <vector>

namespace torch_ext::runtime {

class Executor {
 public:
  // Takes a private copy of `graph`, verifies it and binds every node.
  explicit Executor(const ir::Graph& graph);

  std::vector<c10::IValue> run(std::vector<c10::IValue> inputs) const;

  const ir::Graph& graph() const { return *graph_; }
  size_t num_inputs() const { return placeholders_.size(); }
  // The memory the optimizer updates' results are recycled through (result_pool.h).
  const ResultPool& result_pool() const { return *pool_; }
  // The memory every other CPU allocation of a run is recycled through (call_pool.h).
  const CallPool& call_pool() const { return *call_pool_; }
  // Steps that may run their in-place variant on an input that dies there (each checked, when it
  // runs, to hold the input's only reference; else its functional kernel runs).
  size_t inplace_steps() const { return inplace_kernels_.size(); }

 private:
  std::unique_ptr<ir::Graph> graph_;
  std::vector<const ir::Node*> placeholders_;
  std::vector<bool> restride_;                // per placeholder: taken in its traced strides (none written in place)
  std::vector<BoundKernel> kernels_;          // one per call node, in order
  std::vector<Step> steps_;                   // one per kernel: its slot and the slots dead after it
  std::vector<BoundKernel> inplace_kernels_;  // in-place variants some steps run (see the constructor)
  std::vector<int64_t> release_inputs_;       // placeholder slots no call reads
  std::vector<ir::Arg> outputs_;
  std::unique_ptr<ResultPool> pool_ = std::make_unique<ResultPool>();
  std::unique_ptr<CallPool> call_pool_ = std::make_unique<CallPool>();
};

// Checks a runtime value against a placeholder's type; throws naming `what`.
void check_input(const ir::Node& placeholder, const c10::IValue& value, size_t position);

// A checked tensor input in the strides its placeholder was traced with: left as it is when they agree
// in every dimension of size > 1, else replaced by a copy in those strides (contiguous where they
// overlap or leave gaps, as an expanded example's do). The program's views and kernels were traced on
// that layout: a state entry in others (the channels-last state an AOTInductor package returns) failed
// with "view size is not compatible", and a convolution on channels-last weights rounds otherwise than
// eager's on contiguous ones. Returns whether it copied.
bool to_traced_layout(const ir::Node& placeholder, c10::IValue& value);

// The values of an output node's list: graph values through `value_of`, constants as themselves.
std::vector<c10::IValue> output_values(const std::vector<ir::Arg>& outputs,
                                       const std::function<const c10::IValue&(const ir::Node*)>& value_of);

}  // namespace torch_ext::runtime
