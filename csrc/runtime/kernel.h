// The one kernel abstraction shared by every runtime (Executor, ArenaExecutor,
// reactive Engine): a call node prepared once into a BoundKernel.
//
// Preparation resolves the c10::OperatorHandle, converts constant args to
// IValues of the schema's types, fills schema defaults, and records which
// stack positions are fed from which value slots. At run time `invoke` copies
// the template, drops the slot values in, makes one boxed call and returns the
// node's value (a Tuple IValue for multi-return ops). Values live in a flat
// slot array indexed by node position; each runtime decides which slots hold
// what and for how long.
#pragma once

#include "ir/graph.h"
#include "ir/higher_order.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace torch_ext::runtime {

class Executor;

using ValueSlots = std::vector<c10::IValue>;

// A while_loop that runs more iterations than this fails with an error naming the node, so no
// graph can hang a runtime. The default can be changed with the environment variable
// TORCH_EXT_MAX_LOOP_ITERATIONS (read once per process).
constexpr int64_t kDefaultMaxLoopIterations = 1000000;
int64_t max_loop_iterations();

class BoundKernel {
 public:
  // Maps a node to the value slot that holds it.
  using SlotOf = std::function<int64_t(const ir::Node*)>;
  // Throws c10::Error naming the node when the target or an argument is unsupported.
  // By default a node's slot is its position in the graph.
  static BoundKernel bind(const ir::Node& node, const SlotOf& slot_of = nullptr);
  // Binds `node`'s arguments, by name, to another operator with a compatible schema (its out=
  // or in-place variant). Formals the node does not give are taken from `extra` by name.
  static BoundKernel bind_as(const ir::Node& node, const c10::OperatorHandle& op, const SlotOf& slot_of,
                             const std::vector<std::pair<std::string, c10::IValue>>& extra);

  // Runs the node on `values` (indexed by ir::Node::index()) and returns its value.
  c10::IValue invoke(const ValueSlots& values, std::vector<c10::IValue>& scratch) const;

  const std::string& node_name() const { return node_name_; }
  bool is_getitem() const { return getitem_index_ >= 0; }
  // Operator handle; empty for builtins.
  const std::optional<c10::OperatorHandle>& op() const { return op_; }
  // True when the schema writes to an argument (Tensor(a!)).
  bool mutates() const { return mutates_; }
  // Value slots read by this kernel, each once.
  const std::vector<int64_t>& input_slots() const { return input_slots_; }

 private:
  enum class ListKind { Tensor, OptionalTensor, Int, Float };
  struct Direct {
    uint32_t stack_pos;
    uint32_t slot;
  };
  struct ListFill {
    uint32_t stack_pos;
    ListKind kind;
    std::vector<int64_t> slots;    // -1 where the element is a constant
    std::vector<c10::IValue> consts;
  };

  std::string node_name_;
  std::optional<c10::OperatorHandle> op_;
  std::vector<c10::IValue> stack_template_;
  std::vector<Direct> direct_;
  std::vector<ListFill> lists_;
  std::vector<int64_t> input_slots_;
  size_t num_returns_ = 1;
  bool mutates_ = false;
  bool reshape_if_not_viewable_ = false;  // aten::view / _unsafe_view (see bind_as)
  int64_t getitem_index_ = -1;  // builtin getitem when >= 0
  int64_t getitem_source_ = -1;

  // A higher-order op (ir/higher_order.h): its table entry runs it, each region in its own
  // executor on the gathered argument values.
  const ir::HigherOrderOp* hop_ = nullptr;
  std::vector<std::shared_ptr<const Executor>> regions_;
  std::vector<std::vector<int64_t>> hop_arg_slots_;  // per argument: the slots of its values
  c10::IValue invoke_higher_order(const ValueSlots& values) const;
};

}  // namespace torch_ext::runtime
