#include "runtime/executor.h"

#include "ir/printer.h"
#include "ir/verifier.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/util/Exception.h>

#include <exception>

namespace torch_ext::runtime {

void check_input(const ir::Node& ph, const c10::IValue& v, size_t position) {
  const ir::Type& t = ph.type();
  const auto where = [&] { return "input #" + std::to_string(position) + " ('" + ph.name() + "')"; };
  if (t.kind == ir::Type::Kind::Tensor) {
    TORCH_CHECK(v.isTensor(), where(), ": expected a tensor ", ir::print_type(t), ", got ", v.tagKind());
    const at::Tensor& x = v.toTensor();
    TORCH_CHECK(x.scalar_type() == t.tensor.dtype, where(), ": expected dtype ",
                ir::dtype_torch_name(t.tensor.dtype), ", got ", x.scalar_type());
    TORCH_CHECK(x.sizes() == c10::IntArrayRef(t.tensor.sizes), where(), ": expected shape ", c10::IntArrayRef(t.tensor.sizes),
                ", got ", x.sizes());
    TORCH_CHECK(x.device() == t.tensor.device, where(), ": expected device ", t.tensor.device, ", got ",
                x.device());
    return;
  }
  if (t.kind == ir::Type::Kind::Int) TORCH_CHECK(v.isInt(), where(), ": expected an int, got ", v.tagKind());
  if (t.kind == ir::Type::Kind::Float)
    TORCH_CHECK(v.isDouble() || v.isInt(), where(), ": expected a float, got ", v.tagKind());
  if (t.kind == ir::Type::Kind::Bool) TORCH_CHECK(v.isBool(), where(), ": expected a bool, got ", v.tagKind());
}

std::vector<c10::IValue> output_values(const std::vector<ir::Arg>& outputs,
                                       const std::function<const c10::IValue&(const ir::Node*)>& value_of) {
  std::vector<c10::IValue> results;
  results.reserve(outputs.size());
  for (const ir::Arg& a : outputs) {
    if (a.kind == ir::Arg::Kind::Node) {
      results.push_back(value_of(a.node));
    } else if (a.kind == ir::Arg::Kind::Int) {
      results.emplace_back(a.i);
    } else if (a.kind == ir::Arg::Kind::Float) {
      results.emplace_back(a.f);
    } else {
      TORCH_CHECK(a.kind == ir::Arg::Kind::None, "unsupported output value ", ir::print_arg(a));
      results.emplace_back();
    }
  }
  return results;
}

Executor::Executor(const ir::Graph& graph) : graph_(graph.clone()) {
  ir::verify(*graph_);
  const auto& nodes = graph_->nodes();
  const ir::Node* out = graph_->output();
  std::vector<int64_t> last_use(nodes.size(), -1);  // kernel position of the last read
  std::vector<bool> is_output(nodes.size(), false);
  out->args()[0].for_each_node([&](ir::Node* n) { is_output[n->index()] = true; });
  outputs_ = out->args()[0].list;
  for (const auto& n : nodes) {
    if (n->kind() == ir::NodeKind::Placeholder) placeholders_.push_back(n.get());
    if (n->kind() != ir::NodeKind::Call) continue;
    kernels_.push_back(BoundKernel::bind(*n));
    for (int64_t s : kernels_.back().input_slots()) last_use[s] = static_cast<int64_t>(kernels_.size()) - 1;
  }
  steps_.resize(kernels_.size());
  std::vector<int64_t> step_of(nodes.size(), -1);  // the step that writes each slot
  for (size_t k = 0, i = 0; i < nodes.size(); ++i) {
    if (nodes[i]->kind() != ir::NodeKind::Call) continue;
    steps_[k].kernel = &kernels_[k];  // kernels_ is complete: the pointers stay valid
    steps_[k].out = static_cast<int64_t>(i);
    step_of[i] = static_cast<int64_t>(k++);
  }
  for (size_t s = 0; s < nodes.size(); ++s) {
    if (is_output[s] || nodes[s]->kind() == ir::NodeKind::Output) continue;
    if (last_use[s] >= 0) {
      steps_[last_use[s]].release.push_back(static_cast<int64_t>(s));
    } else if (nodes[s]->kind() == ir::NodeKind::Call) {
      // Produced but never read (e.g. an unused multi-output): free right away.
      steps_[step_of[s]].release.push_back(static_cast<int64_t>(s));
    } else {
      release_inputs_.push_back(static_cast<int64_t>(s));
    }
  }
}

std::vector<c10::IValue> Executor::run(std::vector<c10::IValue> inputs) const {
  // Graph values are data, never autograd history: skip the autograd kernels.
  at::AutoDispatchBelowAutograd no_autograd;
  TORCH_CHECK(inputs.size() == placeholders_.size(), "expected ", placeholders_.size(), " inputs, got ",
              inputs.size());
  ValueSlots values(graph_->size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_input(*placeholders_[i], inputs[i], i);
    values[placeholders_[i]->index()] = std::move(inputs[i]);
  }
  for (int64_t s : release_inputs_) values[s] = c10::IValue();
  std::vector<c10::IValue> stack;
  stack.reserve(16);
  ResultPool::Run results(*pool_);
  optim::ResultAllocatorGuard recycle(&results);
  run_steps(steps_, values, stack, [this](size_t k, const std::exception& e) { rethrow_executing(kernels_[k], e); });
  return output_values(outputs_, [&](const ir::Node* n) -> const c10::IValue& { return values[n->index()]; });
}

}  // namespace torch_ext::runtime
