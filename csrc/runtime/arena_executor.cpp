#include "runtime/arena_executor.h"

#include "ir/out_variant.h"
#include "ir/schema.h"
#include "runtime/executor.h"

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <unordered_map>
#include <unordered_set>

namespace torch_ext::runtime {

namespace {

// Arguments `node` writes through its target's schema: kwarg-only Tensor(a!) arguments the node
// leaves out (an out= overload: the runtime supplies them), or, when the operator returns
// nothing, the written arguments the node passes (an in-place variant).
struct Writes {
  std::vector<std::string> out_args;
  std::vector<size_t> inplace_args;
};

Writes writes_of(const ir::Node& node, const c10::FunctionSchema& schema) {
  Writes w;
  const auto& formals = schema.arguments();
  for (size_t i = 0; i < formals.size(); ++i) {
    const c10::Argument& f = formals[i];
    if (!f.alias_info() || !f.alias_info()->isWrite()) continue;
    if (f.kwarg_only() && !node.kwarg(f.name()))
      w.out_args.push_back(f.name());
    else if (schema.returns().empty())
      w.inplace_args.push_back(i);
  }
  return w;
}

// The functional overload `out` is the out= variant of (its arguments less the `k` trailing out=
// ones, by name and type, returning `k` results and writing nothing), if any.
std::optional<c10::OperatorHandle> functional_of(const c10::OperatorHandle& out, size_t k) {
  const auto& oa = out.schema().arguments();
  if (oa.size() < k) return std::nullopt;
  for (const std::string& overload : ir::overload_names(out.operator_name().name)) {
    const c10::OperatorName name{out.operator_name().name, overload};
    if (name == out.operator_name()) continue;
    const auto op = c10::Dispatcher::singleton().findOp(name);
    if (!op || !op->hasSchema()) continue;
    const auto& fa = op->schema().arguments();
    if (fa.size() + k != oa.size() || op->schema().returns().size() != k) continue;
    bool ok = true;
    for (size_t i = 0; i < fa.size() && ok; ++i)
      ok = fa[i].name() == oa[i].name() && *fa[i].type() == *oa[i].type() &&
           !(fa[i].alias_info() && fa[i].alias_info()->isWrite());
    if (ok) return op;
  }
  return std::nullopt;
}

bool same_layout(const at::Tensor& t, const c10::Storage& storage, int64_t offset, const std::vector<int64_t>& sizes,
                 const std::vector<int64_t>& strides) {
  return t.defined() && t.has_storage() && t.storage().is_alias_of(storage) && t.storage_offset() == offset &&
         t.sizes() == c10::IntArrayRef(sizes) && t.strides() == c10::IntArrayRef(strides);
}

}  // namespace

ArenaExecutor::ArenaExecutor(std::unique_ptr<ir::Graph> lowered, ir::MemoryPlan plan, size_t num_state, bool donate)
    : graph_(std::move(lowered)), plan_(std::move(plan)), num_state_(num_state), donate_(donate) {
  TORCH_CHECK(graph_ != nullptr, "ArenaExecutor: no graph");
  graph_->index();
  for (const ir::Node* n : plan_.order)
    TORCH_CHECK(graph_->find(n->name()) == n, "ArenaExecutor: the plan's node %", n->name(),
                " is not in the graph it was given (plan the graph, lower it, and pass both)");
  ir::verify_memory_plan(plan_);
  // The arena lives on the device of the values it holds: one per device, when a plan's buffers are on
  // several (a CUDA model's parameters and its optimizers' step counters, which stay on the CPU, as
  // torch.optim keeps them), each as long as the plan's offsets reach on it.
  std::vector<std::pair<c10::Device, int64_t>> ends;  // (device, bytes its buffers reach)
  auto meta_of = [&](const ir::PlannedBuffer& b) -> const ir::TensorMeta& {
    return (b.elem < 0 ? b.node->type() : b.node->type().elems.at(b.elem)).tensor;
  };
  for (size_t b = 0; b < plan_.buffers.size(); ++b) {
    const ir::TensorMeta& m = meta_of(plan_.buffers[b]);
    const int64_t end = plan_.arena.offsets.at(b) +
                        static_cast<int64_t>(at::detail::computeStorageNbytes(m.sizes, m.strides, c10::elementSize(m.dtype)));
    auto it = std::find_if(ends.begin(), ends.end(), [&](const auto& e) { return e.first == m.device; });
    if (it == ends.end()) {
      ends.emplace_back(m.device, end);
    } else {
      it->second = std::max(it->second, end);
    }
  }
  if (ends.empty()) ends.emplace_back(c10::Device(c10::kCPU), 0);
  for (const auto& [device, end] : ends)
    arenas_.push_back(at::empty({std::max<int64_t>(end, 1)}, at::TensorOptions().dtype(at::kByte).device(device)));
  auto arena_on = [&](const c10::Device& device) -> const at::Tensor& {
    for (const at::Tensor& a : arenas_)
      if (a.device() == device) return a;
    TORCH_INTERNAL_ASSERT(false, "ArenaExecutor: no arena on ", device);
  };
  std::map<const ir::Node*, std::vector<size_t>> planned;  // node -> its arena buffers, in result order
  for (size_t b = 0; b < plan_.buffers.size(); ++b) planned[plan_.buffers[b].node].push_back(b);
  std::unordered_set<const ir::Node*> dynamic;
  for (const auto& b : plan_.dynamic) dynamic.insert(b.node);
  std::unordered_set<const ir::Node*> aliased;
  for (const auto& d : plan_.aliases)
    if (d.applied) aliased.insert(d.update);

  for (const auto& n : graph_->nodes())
    if (n->kind() == ir::NodeKind::Placeholder) placeholders_.push_back(n.get());
  TORCH_CHECK(num_state_ <= placeholders_.size(), "ArenaExecutor: ", num_state_, " state entries but only ",
              placeholders_.size(), " inputs");
  const auto& nodes = graph_->nodes();
  std::vector<int64_t> last_use(nodes.size(), -1);
  for (const ir::Node* n : plan_.order) {
    Bound step;
    const auto op = n->target().is_builtin() ? std::nullopt : ir::find_op(n->target());
    const Writes w = op ? writes_of(*n, op->schema()) : Writes{};
    auto it = planned.find(n);
    if (!w.inplace_args.empty()) {
      TORCH_CHECK(aliased.count(n), "ArenaExecutor: node %", n->name(), " (", n->target().str(),
                  ") writes its inputs, but the plan applied no in-place alias to it");
      step.kernel = BoundKernel::bind_as(*n, *op, nullptr, {});
      step.tuple_result = n->type().kind == ir::Type::Kind::Tuple;
      for (size_t arg : w.inplace_args) step.inplace_results.push_back(n->args().at(arg).node->index());
      ++num_inplace_;
    } else if (!w.out_args.empty()) {
      TORCH_CHECK(it != planned.end() && it->second.size() == w.out_args.size(), "ArenaExecutor: node %", n->name(),
                  " (", n->target().str(), ") writes ", w.out_args.size(), " out= results but the plan gives it ",
                  it == planned.end() ? 0 : it->second.size(), " arena buffers");
      std::vector<std::pair<std::string, c10::IValue>> outs;
      step.out = std::make_unique<OutGuard>();
      for (size_t k = 0; k < it->second.size(); ++k) {
        const ir::PlannedBuffer& b = plan_.buffers[it->second[k]];
        const ir::TensorMeta& m = b.elem < 0 ? n->type().tensor : n->type().elems.at(b.elem).tensor;
        at::Tensor view = at::from_blob(static_cast<uint8_t*>(arena_on(m.device).data_ptr()) + plan_.arena.offsets[it->second[k]],
                                        m.sizes, m.strides, at::TensorOptions().dtype(m.dtype).device(m.device));
        outs.emplace_back(w.out_args[k], c10::IValue(view));
        step.out->views.push_back(view);
        step.out->storages.push_back(view.storage());
        step.out->offsets.push_back(view.storage_offset());
        step.out->sizes.push_back(m.sizes);
        step.out->strides.push_back(m.strides);
      }
      step.kernel = BoundKernel::bind_as(*n, *op, nullptr, outs);
      if (const auto functional = functional_of(*op, w.out_args.size()))
        step.out->functional = std::make_unique<BoundKernel>(BoundKernel::bind_as(*n, *functional, nullptr, {}));
      ++num_out_;
    } else {
      TORCH_CHECK(it == planned.end() && !aliased.count(n), "ArenaExecutor: the plan puts node %", n->name(), " (",
                  n->target().str(), ") in the arena or in place, but the graph is not lowered (passes::lower_out_variants)");
      step.kernel = BoundKernel::bind(*n);
      if (dynamic.count(n) ||
          (!n->target().is_getitem() && !ir::is_update_op(*n) && !ir::is_view_op(*n) && n->type().is_tensor()))
        fallbacks_.push_back(n->name());
    }
    for (int64_t s : step.kernel.input_slots()) last_use[s] = static_cast<int64_t>(bound_.size());
    bound_.push_back(std::move(step));
  }
  steps_.resize(bound_.size());
  for (size_t k = 0; k < bound_.size(); ++k) {
    steps_[k].kernel = &bound_[k].kernel;  // bound_ is complete: the pointers stay valid
    steps_[k].out = plan_.order[k]->index();
  }
  std::vector<bool> is_output(nodes.size(), false);
  graph_->output()->args()[0].for_each_node([&](ir::Node* n) { is_output[n->index()] = true; });
  outputs_ = graph_->output()->args()[0].list;
  for (size_t s = 0; s < nodes.size(); ++s)
    if (!is_output[s] && last_use[s] >= 0 && nodes[s]->kind() == ir::NodeKind::Call)
      steps_[last_use[s]].release.push_back(static_cast<int64_t>(s));
}

void ArenaExecutor::count_allocated(size_t k) {
  const ir::Node* n = plan_.order[k];
  if (const auto& op = bound_[k].kernel.op()) ir::mark_out_kernel_unusable(op->operator_name());
  // Its arena buffers stay (unused: the arena is allocated); the kernel's allocations add to the dynamic ones.
  for (const ir::PlannedBuffer& b : plan_.buffers)
    if (b.node == n) plan_.dynamic.push_back(b);
  std::vector<ir::BufferLife> lives;
  lives.reserve(plan_.dynamic.size());
  for (const ir::PlannedBuffer& b : plan_.dynamic) lives.push_back(b.life);
  plan_.dynamic_bytes = ir::lower_bound_bytes(lives);
}

c10::IValue ArenaExecutor::run_out_step(size_t k, const ValueSlots& values, std::vector<c10::IValue>& stack) {
  OutGuard& g = *bound_[k].out;
  if (!g.use_functional) {
    c10::IValue v;
    bool planned = true;
    try {
      v = bound_[k].kernel.invoke(values, stack);
    } catch (const std::exception& e) {
      if (!g.functional) rethrow_executing(bound_[k].kernel, e);
      planned = false;
    }
    for (size_t r = 0; r < g.views.size() && planned; ++r)
      planned = same_layout(g.views[r], g.storages[r], g.offsets[r], g.sizes[r], g.strides[r]);
    if (planned) return v;
    // The kernel left a planned view resized or re-pointed (or failed trying): put the views back, and
    // run the functional kernel from now on.
    for (size_t r = 0; r < g.views.size(); ++r)
      if (!same_layout(g.views[r], g.storages[r], g.offsets[r], g.sizes[r], g.strides[r]))
        g.views[r].set_(g.storages[r], g.offsets[r], g.sizes[r], g.strides[r]);
    TORCH_CHECK(g.functional != nullptr, "ArenaExecutor: node %", bound_[k].kernel.node_name(),
                ": its out= kernel changed its planned result (", c10::IntArrayRef(g.sizes[0]),
                " in the arena) and the operator has no functional overload to run instead");
    c10::IValue v2;
    try {
      v2 = g.functional->invoke(values, stack);
    } catch (const std::exception& e) {
      rethrow_executing(*g.functional, e);  // the inputs' own error (the out= kernel is tried again next call)
    }
    g.use_functional = true;
    fallbacks_.push_back(bound_[k].kernel.node_name());
    count_allocated(k);
    return v2;
  }
  try {
    return g.functional->invoke(values, stack);
  } catch (const std::exception& e) {
    rethrow_executing(*g.functional, e);
  }
}

std::vector<c10::IValue> ArenaExecutor::run(std::vector<c10::IValue> inputs) {
  // Graph values are data, never autograd history: skip the autograd kernels.
  at::AutoDispatchBelowAutograd no_autograd;
  TORCH_CHECK(inputs.size() == placeholders_.size(), "expected ", placeholders_.size(), " inputs, got ", inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_input(*placeholders_[i], inputs[i], i);
    // A donated entry in other strides is written into its copy, which the new state then holds.
    to_traced_layout(*placeholders_[i], inputs[i]);
  }
  if (donate_) {
    std::map<const void*, size_t> storages;
    for (size_t i = 0; i < num_state_; ++i) {
      const at::Tensor& t = inputs[i].toTensor();
      const void* key = t.storage().data();
      auto [it, fresh] = storages.emplace(key, i);
      TORCH_CHECK(fresh, "donated state inputs #", it->second, " ('", placeholders_[it->second]->state_name(),
                  "') and #", i, " ('", placeholders_[i]->state_name(),
                  "') share storage; donation needs every state tensor to own its memory (clone one of them)");
    }
  }
  ValueSlots values(graph_->size());
  for (size_t i = 0; i < inputs.size(); ++i) values[placeholders_[i]->index()] = inputs[i];
  std::vector<c10::IValue> stack;
  // An in-place update returns nothing: its value is the inputs it overwrote.
  const auto inplace_value = [&](size_t k) {
    const Bound& b = bound_[k];
    if (b.inplace_results.empty()) return;
    c10::IValue& v = values[steps_[k].out];
    if (!b.tuple_result) {
      v = values[b.inplace_results[0]];
      return;
    }
    std::vector<c10::IValue> elems;
    for (int64_t r : b.inplace_results) elems.push_back(values[r]);
    v = c10::ivalue::Tuple::create(std::move(elems));
  };
  ResultPool::Run pooled(*pool_);
  optim::ResultAllocatorGuard recycle(&pooled);
  // out= steps run checked here (run_out_step); the loop runs the others.
  struct Hooks : NoHooks {
    ArenaExecutor* self;
    ValueSlots* values;
    std::vector<c10::IValue>* stack;
    decltype(inplace_value)* after_step;
    bool before(size_t k, const c10::IValue&) {
      if (!self->bound_[k].out) return true;
      (*values)[self->steps_[k].out] = self->run_out_step(k, *values, *stack);
      return false;
    }
    void after(size_t k) { (*after_step)(k); }
  };
  Hooks hooks;
  hooks.self = this;
  hooks.values = &values;
  hooks.stack = &stack;
  hooks.after_step = &inplace_value;
  run_steps(
      steps_, values, stack, [this](size_t k, const std::exception& e) { rethrow_executing(bound_[k].kernel, e); },
      hooks);
  std::vector<c10::IValue> results =
      output_values(outputs_, [&](const ir::Node* n) -> const c10::IValue& { return values[n->index()]; });
  if (donate_) {
    // State outputs that were not written in place land in the donated storage.
    for (size_t i = 0; i < num_state_ && i + 1 < results.size(); ++i) {
      at::Tensor dst = inputs[i].toTensor();
      const at::Tensor& src = results[i + 1].toTensor();
      if (!src.is_same(dst)) dst.copy_(src);
      results[i + 1] = dst;
    }
  }
  // Values in the arena are overwritten by the next call: hand out copies.
  for (auto& r : results) {
    if (!r.isTensor()) continue;
    const at::Tensor& t = r.toTensor();
    const auto* p = static_cast<const uint8_t*>(t.storage().data());
    for (const at::Tensor& arena : arenas_) {
      const auto* base = static_cast<const uint8_t*>(arena.data_ptr());
      if (arena.device() == t.device() && p >= base && p < base + arena.numel()) {
        r = t.clone();
        break;
      }
    }
  }
  return results;
}

}  // namespace torch_ext::runtime
