#include "runtime/executor.h"

#include "ir/out_variant.h"
#include "ir/printer.h"
#include "ir/schema.h"
#include "ir/verifier.h"

#include <ATen/ATen.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/util/Exception.h>

#include <exception>
#include <string>

namespace torch_ext::runtime {
namespace {

// Placeholders a call writes in place (a Tensor(a!) argument, the placeholder itself or a view of
// it: a BatchNorm's num_batches_tracked.add_): the write must reach the caller's tensor, so those keep
// the layout they are given (to_traced_layout would hand the kernel a copy).
std::vector<bool> written_placeholders(const ir::Graph& graph) {
  std::vector<bool> written(graph.size(), false);
  for (const auto& n : graph.nodes()) {
    if (n->kind() != ir::NodeKind::Call || n->target().is_builtin() || ir::is_higher_order(n->target())) continue;
    const c10::FunctionSchema* schema = ir::find_schema(n->target());
    if (schema == nullptr) continue;
    const auto& formals = schema->arguments();
    for (size_t i = 0; i < formals.size(); ++i) {
      if (formals[i].alias_info() == nullptr || !formals[i].alias_info()->isWrite()) continue;
      const ir::Arg* a = i < n->args().size() ? &n->args()[i] : n->kwarg(formals[i].name());
      if (a == nullptr) continue;
      a->for_each_node([&](const ir::Node* m) {
        while (m->kind() == ir::NodeKind::Call && ir::is_view_op(*m) && !m->args().empty() &&
               m->args()[0].kind == ir::Arg::Kind::Node)
          m = m->args()[0].node;
        if (m->kind() == ir::NodeKind::Placeholder) written[m->index()] = true;
      });
    }
  }
  return written;
}

}  // namespace

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

bool to_traced_layout(const ir::Node& ph, c10::IValue& v) {
  const ir::Type& t = ph.type();
  if (!t.is_tensor() || !v.isTensor()) return false;
  const at::Tensor& x = v.toTensor();
  const std::vector<int64_t>& want = t.tensor.strides;
  const c10::IntArrayRef sizes = x.sizes();
  const c10::IntArrayRef strides = x.strides();
  if (want.size() != strides.size()) return false;  // another rank: check_input's to refuse
  bool same = true;
  for (size_t d = 0; d < want.size() && same; ++d) same = sizes[d] <= 1 || strides[d] == want[d];
  if (same) return false;
  if (!at::empty_strided(sizes, want, x.options().device(c10::kMeta)).is_non_overlapping_and_dense()) {
    v = x.contiguous();
    return true;
  }
  v = at::empty_strided(sizes, want, x.options()).copy_(x);
  return true;
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
  const std::vector<bool> written = written_placeholders(*graph_);
  for (const auto& n : nodes) {
    if (n->kind() == ir::NodeKind::Placeholder) {
      placeholders_.push_back(n.get());
      restride_.push_back(!written[n->index()]);
    }
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
  // Pointwise steps whose input dies there write into it, as eager's in-place modules do
  // (nn.ReLU(inplace=True), a residual `out += identity`): no fresh activation-sized buffer, and the
  // write goes to memory the step has just read.
  struct Overwrite {
    size_t step;
    const ir::Node* input;
    c10::OperatorHandle op;
  };
  std::vector<Overwrite> inplace;
  for (size_t k = 0; k < steps_.size(); ++k) {
    const ir::Node& node = *nodes[steps_[k].out];
    if (node.target().is_builtin() || ir::is_higher_order(node.target())) continue;
    // ir::find_overwrite: pointwise ops only, so the bits are the functional kernel's. Aliasing is
    // checked where the step runs (runtime::sole_owner): a view, a tuple element still held or anything
    // else sharing the storage sends the step to its functional kernel.
    const auto w = ir::find_overwrite(node);
    if (!w || is_output[w->input->index()] || last_use[w->input->index()] != static_cast<int64_t>(k)) continue;
    inplace.push_back({k, w->input, w->op});
  }
  inplace_kernels_.reserve(inplace.size());  // the steps point into it
  for (const auto& [k, input, op] : inplace) {
    const ir::Node& node = *nodes[steps_[k].out];
    inplace_kernels_.push_back(BoundKernel::bind_as(node, op, nullptr, {}));
    steps_[k].fallback = steps_[k].kernel;
    steps_[k].kernel = &inplace_kernels_.back();
    steps_[k].overwrites = input->index();
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
    if (restride_[i]) to_traced_layout(*placeholders_[i], inputs[i]);
    values[placeholders_[i]->index()] = std::move(inputs[i]);
  }
  for (int64_t s : release_inputs_) values[s] = c10::IValue();
  std::vector<c10::IValue> stack;
  stack.reserve(16);
  ResultPool::Run results(*pool_);
  optim::ResultAllocatorGuard recycle(&results);
  // The kernels' results and scratch too: without it, glibc handed the memory a run freed back to
  // the OS (its heap top, its large blocks), and a ResNet-18 step first-touched 3,400-8,600 fresh pages
  // a call in convolution_backward, about 5% of the step (eager in the same process: none).
  CallPool::Scope pooled(*call_pool_);
  run_steps(steps_, values, stack, [this](size_t k, const std::exception& e) { rethrow_executing(kernels_[k], e); });
  return output_values(outputs_, [&](const ir::Node* n) -> const c10::IValue& { return values[n->index()]; });
}

}  // namespace torch_ext::runtime
