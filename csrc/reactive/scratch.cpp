// Scratch memory of the sweep fast path (Engine::evaluate_patched).
//
// A cone's intermediate values never leave one evaluate_patched call: the cached values are put
// back afterwards, and only the graph's outputs are handed out. So each intermediate that has an
// out= overload (ir::find_out_variant) is written by that overload into one engine-wide scratch
// tensor, at an offset planned once per patched node by the memory planner's algorithms
// (passes/memory_algorithms.h) over the values' lifetimes within the cone order, and checked by
// ir::verify_plan. A sweep then reuses the same hot memory at every site instead of allocating
// each value afresh (for large tensors the allocator returns freed blocks to the system, and every
// recomputed node faulted in cold pages). The same kernels run on the same inputs, so the values
// are bit for bit those of the functional kernels. Every out= call is checked, as the arena executor
// checks its own (runtime/arena_executor.h): a kernel that fails on its scratch view or leaves it
// resized or re-pointed (using `out` as scratch of another shape, as torch 2.9's CPU mse_loss.out does)
// runs its functional kernel instead, from that call on (Engine::run_scratch_step, scratch_fallbacks()),
// and later plans leave the operator out of the scratch (ir::mark_out_kernel_unusable).
//
// A value stays allocated by its kernel (as before) when it is an output, when a value that may
// alias it (a schema view, a getitem, _unsafe_view, a higher-order op's result) reaches an output,
// when it is not a single strided tensor with non-negative strides, or when it lives on another
// device than the first scratch value. A buffer lives from its producer to the last read of it or
// of any value that may alias it.
//
// A composite op (no kernel of its own, it runs other ops) may hand back an input although its schema
// declares a fresh result (aten::dropout with train=False, aten::type_as with the dtype it has), but
// most never do (aten::linear, aten::matmul, aten::layer_norm): planning every one of them as an
// alias keeps its input's buffer alive as long as its own value. So a composite op with a tensor
// result is planned as the fresh result its schema declares, and checked where it runs: a value it
// returns inside the scratch memory (an input's buffer, or a view of it) is copied out at once
// (Engine::unalias_scratch), before any later step can reuse that buffer, so no value outside the plan
// ever points into the scratch. The copy has the same bits. A composite op with another result type
// (a tuple of tensors) is still planned as an alias of its inputs.
//
// A pointwise node whose one input is a scratch value that dies at it (nothing reads that value, or
// any value that may alias it, afterwards) and whose own value may live in the scratch runs its
// in-place variant on that input's buffer instead of its out= overload into a buffer of its own: the
// executor's rule (ir::find_overwrite, the same in-place kernels the executor runs), and one buffer
// fewer live at that step. The buffer then lives until the last read of the node's value, and a chain
// of such nodes (sin(sin(sin(x)))) runs in one buffer, as in the executor. It runs in place only while
// the input is still in its planned buffer (an out= step that fell back to its functional kernel left
// it elsewhere: the node then runs its functional kernel too).
//
// A node left out of the scratch (no out= kernel of its own: aten::relu) whose one tensor input is a
// cone intermediate that its own kernel (or a composite op's, planned as fresh) allocated, that is planned
// as no alias of another value, that is no output, that
// nothing reads after this node and that the node reads through one argument only, may run its
// in-place variant on that input instead of allocating (the same rule, ir::find_overwrite): the input
// dies there, so its memory is the node's. The plan is not enough on its own: an op whose schema
// declares a fresh result may hand back its input's tensor (aten::dropout with train=False,
// aten::type_as with the dtype it has), which can be the site's value (the caller's tensor) or a
// cached value from outside the cone. So the step runs in place only when, at that moment, its
// input slot holds the one reference to a dense tensor and to its storage (runtime::sole_owner):
// nobody else can read what it overwrites. Otherwise the functional kernel runs. A pointwise in-place
// variant applies the same function to the same elements, so the bits are those of the functional
// kernel (tests/cpp/test_reactive.cpp, Reactive.PointwiseInplaceVariantsGiveTheFunctionalBits).
#include "reactive/engine.h"

#include "ir/memory_plan.h"
#include "ir/out_variant.h"
#include "ir/printer.h"
#include "ir/schema.h"
#include "passes/memory_algorithms.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <unordered_map>

namespace torch_ext::reactive {
namespace {

// How `reader`'s value may share storage with one of its inputs.
enum class Alias {
  Never,      // a fresh result by its schema, computed by the op's own kernel
  Checked,    // a composite op with a tensor result: fresh by its schema, checked where it runs
  Possible,   // a view, a getitem, an unknown op ...: planned as an alias of its inputs
};

Alias alias_of_input(const ir::Node& reader) {
  if (reader.target().is_builtin() || ir::is_higher_order(reader.target())) return Alias::Possible;
  if (ir::is_view_op(reader) || ir::returns_input_storage(reader)) return Alias::Possible;
  const std::optional<c10::OperatorHandle> op = ir::find_op(reader.target());
  if (!op.has_value()) return Alias::Possible;
  for (const auto& r : op->schema().returns())
    if (r.alias_info() != nullptr) return Alias::Possible;
  // A composite op (no kernel of its own: it runs other ops) may hand back an input although its
  // schema declares a fresh result: aten::dropout with train=False, aten::type_as with the dtype it
  // has, aten::einsum("ij->ji") a view. torch.export's default IR keeps them (dropout in eval mode).
  if (!op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd)) return Alias::Never;
  return reader.type().kind == ir::Type::Kind::Tensor ? Alias::Checked : Alias::Possible;
}

// The in-place steps' conservative rule: any composite op may alias (the run-time sole_owner check
// guards them as well).
bool may_alias_input(const ir::Node& reader) { return alias_of_input(reader) != Alias::Never; }

}  // namespace

void Engine::plan_scratch(PatchPlan& plan) {
  const size_t n = plan.order.size();
  std::unordered_map<int64_t, size_t> pos;
  for (size_t i = 0; i < n; ++i) pos[plan.order[i]] = i;
  // Readers first: end[i] is the last position that may read order[i]'s storage; escapes[i] says
  // whether that storage may reach an output.
  std::vector<int64_t> end(n, 0);
  std::vector<bool> escapes(n, false);
  for (size_t i = n; i-- > 0;) {
    int64_t e = static_cast<int64_t>(i);
    bool esc = false;
    for (const ir::Node* user : states_[plan.order[i]].node->users()) {
      if (user->kind() == ir::NodeKind::Output) {
        esc = true;
        continue;
      }
      auto p = pos.find(ids_.at(user));
      if (p == pos.end()) continue;  // a pinned user: it keeps its pinned value and reads nothing
      const size_t j = p->second;
      e = std::max(e, static_cast<int64_t>(j));
      if (alias_of_input(*user) == Alias::Possible) {  // Checked: copied out if it aliases the scratch
        e = std::max(e, end[j]);
        esc = esc || escapes[j];
      }
    }
    end[i] = e;
    escapes[i] = esc;
  }
  std::vector<ir::BufferLife> lives;
  std::vector<size_t> life_of;             // per scratch entry: the buffer it writes (its index in lives)
  std::vector<int32_t> entry_of(n, -1);    // per position: its scratch entry, -1
  std::optional<c10::Device> device;
  for (size_t i = 0; i < n; ++i) {
    const NodeState& st = states_[plan.order[i]];
    const ir::Node& node = *st.node;
    if (escapes[i] || node.type().kind != ir::Type::Kind::Tensor || node.target().is_builtin() ||
        ir::is_higher_order(node.target()))
      continue;
    const ir::TensorMeta& m = node.type().tensor;
    if (m.numel() == 0 || m.strides.size() != m.sizes.size() ||
        std::any_of(m.strides.begin(), m.strides.end(), [](int64_t s) { return s < 0; }))
      continue;
    if (device.has_value() && *device != m.device) continue;
    // In place on a dying scratch input (the executor's rule, ir::find_overwrite): the node's one input is
    // a scratch value that nothing reads after this step (through any alias), so the node's value takes
    // over that buffer, which then lives as long as this value (and its aliases) may be read.
    if (!may_alias_input(node) && st.kernel->input_slots().size() == 1) {
      const auto w = ir::find_overwrite(node);
      const auto p = w ? pos.find(ids_.at(w->input)) : pos.end();
      if (p != pos.end() && p->second < i && entry_of[p->second] >= 0 && end[p->second] == static_cast<int64_t>(i) &&
          st.kernel->input_slots()[0] == plan.order[p->second]) {
        const int32_t k = entry_of[p->second];
        entry_of[i] = static_cast<int32_t>(plan.scratch.size());
        plan.scratch.push_back({i, w->op, "", 0, false, k});
        life_of.push_back(life_of[k]);
        lives[life_of[k]].last = std::max(lives[life_of[k]].last, end[i]);
        continue;
      }
    }
    const std::string key = node.target().str() + "|" + c10::toString(m.dtype) + "|" + m.device.str();
    auto it = out_variants_.find(key);
    if (it == out_variants_.end()) it = out_variants_.emplace(key, ir::find_out_variant(node)).first;
    if (!it->second.has_value() || it->second->out_args.size() != 1) continue;
    device = m.device;
    entry_of[i] = static_cast<int32_t>(plan.scratch.size());
    plan.scratch.push_back({i, it->second->op, it->second->out_args[0], 0});
    life_of.push_back(lives.size());
    lives.push_back({ir::align_up(m.nbytes()), static_cast<int64_t>(i), end[i]});
  }
  plan_inplace(plan, end, escapes);
  if (lives.empty()) return;
  // The composite steps planned as fresh results that do not write into the scratch themselves: their
  // value is checked after they run (unalias_scratch).
  std::vector<bool> in_scratch(n, false);
  plan.scratch_of.assign(n, -1);
  for (size_t k = 0; k < plan.scratch.size(); ++k) {
    in_scratch[plan.scratch[k].step] = true;
    plan.scratch_of[plan.scratch[k].step] = static_cast<int32_t>(k);
  }
  for (size_t i = 0; i < n; ++i)
    if (!in_scratch[i] && alias_of_input(*states_[plan.order[i]].node) == Alias::Checked) {
      if (plan.alias_checks.empty()) plan.alias_checks.assign(n, 0);
      plan.alias_checks[i] = 1;
    }
  const ir::ArenaPlan arena = passes::plan_best(lives);
  ir::verify_plan(lives, arena);  // no two buffers live at once share a byte
  for (size_t k = 0; k < plan.scratch.size(); ++k) plan.scratch[k].offset = arena.offsets[life_of[k]];
  plan.scratch_bytes = std::max<int64_t>(arena.arena_bytes, 1);
}

void Engine::plan_inplace(PatchPlan& plan, const std::vector<int64_t>& end, const std::vector<bool>& escapes) {
  const size_t n = plan.order.size();
  std::unordered_map<int64_t, size_t> pos;
  for (size_t i = 0; i < n; ++i) pos[plan.order[i]] = i;
  std::vector<bool> in_scratch(n, false);
  for (const ScratchOut& s : plan.scratch) in_scratch[s.step] = true;
  for (size_t i = 0; i < n; ++i) {
    if (in_scratch[i]) continue;  // written into the scratch already
    const ir::Node& node = *states_[plan.order[i]].node;
    if (node.type().kind != ir::Type::Kind::Tensor || node.target().is_builtin() || ir::is_higher_order(node.target()) ||
        may_alias_input(node))
      continue;
    const auto& inputs = states_[plan.order[i]].kernel->input_slots();
    if (inputs.size() != 1) continue;  // one tensor input: nothing else the kernel reads can overlap it
    auto p = pos.find(inputs[0]);
    if (p == pos.end()) continue;  // the site's value (the caller's tensor) or a value outside the cone: never written
    const size_t j = p->second;
    const ir::Node& input = *states_[plan.order[j]].node;
    // The input: computed in this cone by a kernel that allocates it (not in the scratch, no planned alias
    // of another value), read by nothing after this step (through any alias), and not an output. A
    // composite op with a tensor result (Alias::Checked: aten::linear, whose out= overload has no CPU
    // kernel of its own, so it is never in the scratch) is planned as the fresh result its schema declares;
    // if it handed back another value's tensor (dropout in eval mode), that value's slot, the caller's
    // site value or a cached value still holds it, and the run-time sole_owner check runs the functional
    // kernel instead, as the executor does. Excluding it had every relu after a linear allocate (the
    // overhead chain: 64 Linear + ReLU, 1.09x the executor's instructions, its relus in place there).
    if (in_scratch[j] || escapes[j] || end[j] != static_cast<int64_t>(i) || input.target().is_builtin() ||
        ir::is_higher_order(input.target()) || alias_of_input(input) == Alias::Possible)
      continue;
    const auto w = ir::find_overwrite(node);  // the executor's rule
    if (!w || w->input != &input) continue;
    plan.inplace_steps.push_back(i);
    plan.inplace_inputs.push_back(inputs[0]);
    plan.inplace_kernels.push_back(runtime::BoundKernel::bind_as(
        node, w->op, [this](const ir::Node* x) { return ids_.at(x); }, {}));
  }
}

void Engine::unalias_scratch(c10::IValue& v) const {
  if (!scratch_.defined() || !v.isTensor()) return;
  const at::Tensor& t = v.toTensor();
  if (!t.defined() || !t.has_storage()) return;
  const auto* data = static_cast<const uint8_t*>(t.storage().data());
  const auto* base = static_cast<const uint8_t*>(scratch_.const_data_ptr());
  if (data == nullptr || data < base || data >= base + scratch_.numel()) return;
  v = t.clone();  // an input's scratch buffer handed back: later steps may reuse that buffer
}

c10::IValue Engine::run_scratch_step(PatchPlan& plan, size_t i) {
  ScratchOut& s = plan.scratch[plan.scratch_of[i]];
  const at::Tensor& view = plan.scratch_views[plan.scratch_of[i]];
  const NodeState& st = states_[plan.order[i]];
  const ir::TensorMeta& m = st.node->type().tensor;
  auto* planned_data = static_cast<uint8_t*>(scratch_.data_ptr()) + s.offset;
  const auto in_place = [&](const at::Tensor& t) {
    return t.defined() && t.has_storage() && t.storage().data() == planned_data && t.storage_offset() == 0 &&
           t.sizes() == c10::IntArrayRef(m.sizes) && t.strides() == c10::IntArrayRef(m.strides);
  };
  c10::IValue v;
  if (s.overwrites >= 0) {
    // In place on the input's buffer, when the input is still there (its own step may have fallen back
    // to its functional kernel: then this one runs its functional kernel too, into fresh memory).
    const c10::IValue& input = values_[plan.order[plan.scratch[s.overwrites].step]];
    const bool there = input.isTensor() && in_place(input.toTensor());
    try {
      v = there ? plan.scratch_kernels[plan.scratch_of[i]].invoke(values_, stack_) : st.kernel->invoke(values_, stack_);
    } catch (const std::exception& e) {
      count_plan(plan, i);  // the nodes before it did run
      rethrow_evaluating(st, e);
    }
    TORCH_INTERNAL_ASSERT(!there || (v.isTensor() && in_place(v.toTensor())), "in-place step %", st.node->name(),
                          " did not return the tensor it overwrote");
    return v;
  }
  bool planned = true;
  try {
    v = plan.scratch_kernels[plan.scratch_of[i]].invoke(values_, stack_);
  } catch (const std::exception&) {
    planned = false;  // the functional kernel below raises the inputs' own error, if any
  }
  if (planned && v.isTensor() && v.toTensor().is_same(view) && in_place(view)) return v;  // (a(!) returns `out`)
  // The kernel left its view resized or re-pointed (or failed trying): run the functional kernel from now
  // on. The view is not put back: this plan never runs that out= kernel again (bind_scratch binds a fresh
  // view for each scratch tensor, and leaves a fallen-back step on its functional kernel).
  v = c10::IValue();
  c10::IValue functional;
  try {
    functional = st.kernel->invoke(values_, stack_);
  } catch (const std::exception& e) {
    count_plan(plan, i);  // the nodes before it did run; the out= kernel is tried again next call
    rethrow_evaluating(st, e);
  }
  s.fell_back = true;
  plan.steps[i].kernel = &*st.kernel;
  ir::mark_out_kernel_unusable(s.op.operator_name());
  const std::string key = st.node->target().str() + "|" + c10::toString(m.dtype) + "|" + m.device.str();
  out_variants_[key] = std::nullopt;  // plans built from now on leave the node to its kernel
  scratch_fallbacks_.push_back(st.node->name());
  return functional;
}

int64_t Engine::inplace_steps(const std::string& node) {
  const PatchPlan& plan = plan_for(id_of(node));
  const auto on_scratch = std::count_if(plan.scratch.begin(), plan.scratch.end(),
                                        [](const ScratchOut& s) { return s.overwrites >= 0; });
  return static_cast<int64_t>(plan.inplace_steps.size()) + static_cast<int64_t>(on_scratch);
}

void Engine::set_scratch(bool enabled) {
  scratch_enabled_ = enabled;
  if (!enabled) {
    scratch_ = at::Tensor();  // plans go back to their own kernels at their next use
    row_pool_->clear();       // the row path's free pooled storages too
  }
}

void Engine::bind_scratch(PatchPlan& plan) {
  if (plan.inplace_bound != scratch_enabled_) {
    for (size_t k = 0; k < plan.inplace_steps.size(); ++k) {
      const size_t step = plan.inplace_steps[k];
      const runtime::BoundKernel* functional = &*states_[plan.order[step]].kernel;
      plan.steps[step].kernel = scratch_enabled_ ? &plan.inplace_kernels[k] : functional;
      plan.steps[step].overwrites = scratch_enabled_ ? plan.inplace_inputs[k] : -1;
      plan.steps[step].fallback = functional;
    }
    plan.inplace_bound = scratch_enabled_;
  }
  if (plan.scratch.empty()) return;
  if (!scratch_enabled_) {
    if (plan.scratch_generation == 0) return;
    for (const ScratchOut& s : plan.scratch) plan.steps[s.step].kernel = &*states_[plan.order[s.step]].kernel;
    plan.scratch_kernels.clear();
    plan.scratch_generation = 0;
    return;
  }
  const c10::Device device = states_[plan.order[plan.scratch[0].step]].node->type().tensor.device;
  if (!scratch_.defined() || scratch_.device() != device || scratch_.numel() < plan.scratch_bytes) {
    // Grown to this plan's need (never shrunk on its device), or moved to this plan's device (a graph
    // with values on two devices): plans bound to the old tensor rebind at their next use.
    scratch_ = at::empty({plan.scratch_bytes}, at::TensorOptions().dtype(at::kByte).device(device));
    ++scratch_generation_;
  }
  if (plan.scratch_generation == scratch_generation_) return;
  std::vector<runtime::BoundKernel> kernels;
  std::vector<at::Tensor> views;
  kernels.reserve(plan.scratch.size());
  views.reserve(plan.scratch.size());
  auto* base = static_cast<uint8_t*>(scratch_.data_ptr());
  for (const ScratchOut& s : plan.scratch) {
    const ir::Node& node = *states_[plan.order[s.step]].node;
    const ir::TensorMeta& m = node.type().tensor;
    views.push_back(at::from_blob(base + s.offset, m.sizes, m.strides,
                                  at::TensorOptions().dtype(m.dtype).device(m.device)));
    const auto slot_of = [this](const ir::Node* x) { return ids_.at(x); };
    if (s.overwrites >= 0)  // the in-place variant takes the node's own arguments: no out= view
      kernels.push_back(runtime::BoundKernel::bind_as(node, s.op, slot_of, {}));
    else
      kernels.push_back(runtime::BoundKernel::bind_as(node, s.op, slot_of, {{s.arg, c10::IValue(views.back())}}));
  }
  plan.scratch_kernels = std::move(kernels);  // the new buffer: the old kernels' addresses are gone
  plan.scratch_views = std::move(views);
  for (size_t k = 0; k < plan.scratch.size(); ++k)
    if (!plan.scratch[k].fell_back) plan.steps[plan.scratch[k].step].kernel = &plan.scratch_kernels[k];
  plan.scratch_generation = scratch_generation_;
}

}  // namespace torch_ext::reactive
