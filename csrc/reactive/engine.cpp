#include "reactive/engine.h"

#include "ir/printer.h"
#include "ir/verifier.h"
#include "passes/eliminate_dead_code.h"
#include "runtime/executor.h"

#include <ATen/ATen.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <numeric>

namespace torch_ext::reactive {
namespace {

int64_t numel_of(const ir::Type& t) {
  if (t.kind == ir::Type::Kind::Tensor) return t.tensor.numel();
  int64_t n = 0;
  for (const auto& e : t.elems) n += numel_of(e);
  return n;
}

const ir::TensorMeta* arg_meta(const ir::Node& n, size_t i) {
  if (i >= n.args().size() || n.args()[i].kind != ir::Arg::Kind::Node) return nullptr;
  const ir::Type& t = n.args()[i].node->type();
  return t.kind == ir::Type::Kind::Tensor ? &t.tensor : nullptr;
}

bool values_equal(const c10::IValue& a, const c10::IValue& b) {
  if (a.isTensor() && b.isTensor()) return same_input(a.toTensor(), b.toTensor());
  const bool seq_a = a.isTuple() || a.isList();
  const bool seq_b = b.isTuple() || b.isList();
  if (seq_a || seq_b) {
    if (!(seq_a && seq_b)) return false;
    const auto xs = a.isTuple() ? a.toTupleRef().elements().vec() : a.toListRef().vec();
    const auto ys = b.isTuple() ? b.toTupleRef().elements().vec() : b.toListRef().vec();
    if (xs.size() != ys.size()) return false;
    for (size_t i = 0; i < xs.size(); ++i)
      if (!values_equal(xs[i], ys[i])) return false;
    return true;
  }
  if (a.isTensor() || b.isTensor()) return false;
  if (a.isInt() || a.isDouble() || a.isBool() || a.isNone() || a.isString()) return a == b;
  return false;  // unknown kinds never count as unchanged
}

}  // namespace

// A contiguous strided CPU tensor whose bytes are its elements (no conjugate or negative bit, no Python
// subclass dispatch).
static bool plain_dense_cpu(const at::Tensor& t) {
  return t.is_cpu() && t.layout() == at::kStrided && t.is_contiguous() && t.has_storage() && !t.is_conj() &&
         !t.is_neg() && !t.unsafeGetTensorImpl()->is_python_dispatch();
}

bool same_layout(const at::Tensor& x, const at::Tensor& y) {
  if (x.dim() != y.dim()) return false;
  for (int64_t d = 0; d < x.dim(); ++d)
    if (x.size(d) > 1 && x.stride(d) != y.stride(d)) return false;
  return true;
}

// Early cutoff's equality: the same bits, not the same numbers. Under `==`, -0.0 equals 0.0 (and NaN
// differs from itself), but a consumer can tell the zeros apart (1/x, atan2, copysign, signbit): a
// node whose recomputed value flipped a zero's sign must not be cut off, or its cone keeps values
// computed from the other zero. Floating and complex tensors are compared as integers of their width.
bool same_bits(const at::Tensor& x, const at::Tensor& y) {
  if (x.sizes() != y.sizes() || x.scalar_type() != y.scalar_type() || x.device() != y.device()) return false;
  // Two dense CPU tensors of one dtype (not bool: a bool's byte is not its value): one memcmp, which stops
  // at the first differing byte. The same answer as the element-wise compare below, without its two views
  // and a TensorIterator (a sweep asks this once per site).
  if (x.scalar_type() != at::kBool && plain_dense_cpu(x) && plain_dense_cpu(y))
    return x.numel() == 0 || std::memcmp(x.const_data_ptr(), y.const_data_ptr(), x.nbytes()) == 0;
  if (!(x.is_floating_point() || x.is_complex())) return x.equal(y);
  at::ScalarType as;
  switch (x.element_size()) {
    case 1: as = at::kByte; break;
    case 2: as = at::kShort; break;
    case 4: as = at::kInt; break;
    case 8: as = at::kLong; break;
    case 16: return same_bits(at::view_as_real(x), at::view_as_real(y));  // complex128: two float64 each
    default: return false;  // an unknown width never counts as unchanged
  }
  return x.view(as).equal(y.view(as));
}

// Whether two values share memory (a tensor each, or tuples with such a pair). A view of an input or a weight
// (`ids.view(...)`, `W.t()`) aliases it: after an in-place edit of that input, its old cached value holds the new
// bits too, so comparing it with the recomputed one says nothing about whether the value changed.
static bool shares_memory(const c10::IValue& a, const c10::IValue& b) {
  if (a.isTensor() && b.isTensor()) {
    const at::Tensor& x = a.toTensor();
    const at::Tensor& y = b.toTensor();
    return x.defined() && y.defined() && x.has_storage() && y.has_storage() && x.storage().is_alias_of(y.storage());
  }
  if (a.isTuple() && b.isTuple()) {
    const auto& xs = a.toTupleRef().elements();
    const auto& ys = b.toTupleRef().elements();
    for (size_t i = 0; i < xs.size() && i < ys.size(); ++i)
      if (shares_memory(xs[i], ys[i])) return true;
  }
  return false;
}

// The version counter of a tensor value, or -1 when it is not tracked (non-tensors, inference tensors).
int64_t version_of(const c10::IValue& v) {
  if (!v.isTensor()) return -1;
  const at::Tensor& t = v.toTensor();
  if (!t.defined() || t.is_inference()) return -1;
  return static_cast<int64_t>(t.unsafeGetTensorImpl()->version_counter().current_version());
}

void check_no_dead_code(const ir::Graph& g, const std::string& what) {
  std::vector<bool> live(g.size(), false);
  const auto& nodes = g.nodes();
  for (size_t i = nodes.size(); i-- > 0;) {
    const ir::Node& n = *nodes[i];
    if (n.kind() == ir::NodeKind::Output) live[i] = true;
    if (!live[i]) {
      TORCH_CHECK(n.kind() != ir::NodeKind::Call, what, ": node %", n.name(), " (", n.target().str(),
                  ") does not reach an output; remove dead code first");
      continue;
    }
    for (ir::Node* in : n.inputs()) live[in->index()] = true;
  }
}

double node_cost(const ir::Node& n) {
  const double out = static_cast<double>(std::max<int64_t>(numel_of(n.type()), 1));
  if (n.kind() != ir::NodeKind::Call || n.target().is_builtin()) return out;
  const std::string& op = n.target().name;
  if (op == "mm" || op == "bmm" || op == "matmul" || op == "linear") {
    if (const auto* a = arg_meta(n, 0); a && !a->sizes.empty()) return 2.0 * out * static_cast<double>(a->sizes.back());
  }
  if (op == "addmm" || op == "baddbmm") {
    if (const auto* a = arg_meta(n, 1); a && !a->sizes.empty()) return 2.0 * out * static_cast<double>(a->sizes.back());
  }
  if (op == "convolution" || op == "conv1d" || op == "conv2d" || op == "conv3d") {
    if (const auto* w = arg_meta(n, 1); w && w->sizes.size() > 1) {
      double k = 1;
      for (size_t d = 1; d < w->sizes.size(); ++d) k *= static_cast<double>(w->sizes[d]);
      return 2.0 * out * k;
    }
  }
  if (op.find("scaled_dot_product") != std::string::npos) {
    const auto* q = arg_meta(n, 0);
    const auto* k = arg_meta(n, 1);
    if (q && k && q->sizes.size() >= 2 && k->sizes.size() >= 2) {
      double bhl = 1;
      for (size_t d = 0; d + 1 < q->sizes.size(); ++d) bhl *= static_cast<double>(q->sizes[d]);
      return 4.0 * bhl * static_cast<double>(k->sizes[k->sizes.size() - 2]) * static_cast<double>(q->sizes.back());
    }
  }
  return out;
}

Engine::Engine(const ir::Graph& graph, bool infer_results) : graph_(graph.clone()) {
  ir::verify(*graph_, infer_results);
  // Side-effect-free nodes that reach no output (export's _assert_tensor_metadata for every .to(),
  // _assert_scalar, unused views) can never matter to a demand: drop them from the private copy.
  passes::eliminate_dead_code(*graph_);
  check_no_dead_code(*graph_, "reactive engine");
  for (const auto& n : graph_->nodes()) add_state(n.get());
  for (size_t id = 0; id < states_.size(); ++id) {
    if (!states_[id].countable) continue;
    bind(static_cast<int64_t>(id));
    const ir::Node& n = *states_[id].node;
    TORCH_CHECK(!states_[id].kernel->mutates(), "reactive engine: node %", n.name(), " (", n.target().str(),
                ") mutates its inputs; cached values need a functional graph "
                "(export, then ExportedProgram.run_decompositions())");
    dirty_.insert({n.index(), static_cast<int64_t>(id)});
  }
}

int64_t Engine::add_state(ir::Node* node) {
  NodeState st;
  st.node = node;
  st.countable = node->kind() == ir::NodeKind::Call;
  st.cost = st.countable ? node_cost(*node) : 0.0;
  st.valid = node->kind() != ir::NodeKind::Call;
  states_.push_back(std::move(st));
  values_.emplace_back();
  versions_.push_back(-1);
  const auto id = static_cast<int64_t>(states_.size()) - 1;
  ids_[node] = id;
  if (states_.back().countable) ++num_countable_;
  if (node->kind() == ir::NodeKind::Placeholder) input_ids_.push_back(id);
  return id;
}

void Engine::bind(int64_t id) {
  states_[id].kernel = runtime::BoundKernel::bind(*states_[id].node, [this](const ir::Node* n) { return ids_.at(n); });
}

int64_t Engine::id_of(const std::string& name) const {
  const ir::Node* n = graph_->find(name);
  TORCH_CHECK(n != nullptr && n->kind() != ir::NodeKind::Output, "unknown node '", name, "'");
  return ids_.at(n);
}

void Engine::check_id(int64_t id, const char* what) const {
  TORCH_CHECK(id >= 0 && id < static_cast<int64_t>(states_.size()), what, ": no node has id ", id, " (ids 0 to ",
              static_cast<int64_t>(states_.size()) - 1, ")");
}

void Engine::mark_invalid(int64_t id) {
  NodeState& st = states_[id];
  if (!st.countable || !st.valid || st.pinned) return;
  journal(id);
  st.valid = false;
  dirty_.insert({st.node->index(), id});
  ++stats_.invalidated;
}

template <class Enter>
void Engine::walk_users(int64_t seed, Enter&& enter) const {
  std::vector<int64_t> work{seed};
  while (!work.empty()) {
    const int64_t v = work.back();
    work.pop_back();
    for (const ir::Node* user : states_[v].node->users()) {
      if (user->kind() == ir::NodeKind::Output) continue;
      const int64_t u = ids_.at(user);
      if (enter(u)) work.push_back(u);
    }
  }
}

void Engine::invalidate_users(int64_t seed) {
  walk_users(seed, [this](int64_t u) {
    const NodeState& st = states_[u];
    if (!st.valid || st.pinned) return false;  // I3: an invalid node's cone is already invalid
    mark_invalid(u);
    return true;
  });
}

void Engine::save_baseline(int64_t id) {
  if (pinned_.empty() || overlay_.count(id)) return;
  overlay_.emplace(id, Baseline{values_[id], states_[id].changed_at, versions_[id]});
  if (txn_) txn_->overlay_added.push_back(id);
}

void Engine::store(int64_t id, c10::IValue value) {
  values_[id] = std::move(value);
  versions_[id] = version_of(values_[id]);
}

void Engine::journal(int64_t id) {
  if (!txn_ || txn_->journal.count(id)) return;
  const NodeState& st = states_[id];
  txn_->journal.emplace(id, JournalEntry{values_[id], st.changed_at, st.verified_at, versions_[id], st.valid, st.pinned});
}

void Engine::refuse_in_transaction(const char* what) const {
  TORCH_CHECK(!txn_, what, " is not allowed inside a sweep transaction; rollback() first");
}

void Engine::check_intact(int64_t id) {
  const int64_t recorded = versions_[id];
  if (recorded < 0) return;
  const int64_t now = version_of(values_[id]);
  if (now == recorded) return;
  NodeState& st = states_[id];
  const char* next = "";
  if (st.countable && !st.pinned) {
    retire_written(id);
    next = "the engine marked it stale, so the next demand recomputes it";
  } else if (st.pinned) {
    next = "patch it again with a fresh tensor, or restore()";
  } else {
    next = "it is an input of the graph, so call run() again with fresh inputs";
  }
  TORCH_CHECK(false, "cached value of %", st.node->name(), " was modified in place after the engine handed it out ",
              "(tensor version ", now, ", stored at version ", recorded,
              "): a patch function, metric or other caller wrote into it. Return a new tensor instead ",
              "(e.g. x = x.clone() first); ", next);
}

void Engine::check_intact(const std::string& name) {
  const int64_t id = id_of(name);
  settle();
  auto it = overlay_.find(id);
  if (it != overlay_.end() && it->second.version >= 0 && version_of(it->second.value) != it->second.version) {
    baseline_stale_.insert(id);  // restore() recomputes it instead of putting the written tensor back
    TORCH_CHECK(false, "baseline value of %", name, " was modified in place after the engine handed it out: ",
                "a patch function, metric or other caller wrote into it. Return a new tensor instead ",
                "(e.g. x = x.clone() first); restore() recomputes it");
  }
  check_intact(id);
}

Engine::PatchPlan& Engine::plan_for(int64_t id) {
  auto it = plans_.find(id);
  if (it != plans_.end() && it->second.pins_version == pins_version_) return it->second;
  PatchPlan plan;
  plan.pins_version = pins_version_;
  // The cone that invalidate_users would mark: users reached without passing a pinned node.
  const std::set<int64_t> seen = downstream(id, /*stop_at_pins=*/true);
  plan.order.assign(seen.begin(), seen.end());
  std::sort(plan.order.begin(), plan.order.end(),
            [this](int64_t a, int64_t b) { return states_[a].node->index() < states_[b].node->index(); });
  std::unordered_map<int64_t, size_t> last_read;  // cone value -> position of its last reader
  std::set<int64_t> external;
  for (size_t i = 0; i < plan.order.size(); ++i)
    for (int64_t in : states_[plan.order[i]].kernel->input_slots()) {
      if (seen.count(in))
        last_read[in] = i;
      else if (in != id)
        external.insert(in);
    }
  std::set<int64_t> outputs;
  for (const ir::Arg& a : graph_->output()->args()[0].list)
    if (a.kind == ir::Arg::Kind::Node) outputs.insert(ids_.at(a.node));
  plan.steps.resize(plan.order.size());
  for (size_t i = 0; i < plan.order.size(); ++i) {
    // Plans are dropped before a graft adds states, so the kernel stays where it is.
    plan.steps[i].kernel = &*states_[plan.order[i]].kernel;
    plan.steps[i].out = plan.order[i];
  }
  for (const auto& [v, i] : last_read)
    if (!outputs.count(v)) plan.steps[i].release.push_back(v);
  for (size_t i = 0; i < plan.order.size(); ++i)  // computed but never read: dead within the plan
    if (!last_read.count(plan.order[i]) && !outputs.count(plan.order[i])) plan.steps[i].release.push_back(plan.order[i]);
  plan.external.assign(external.begin(), external.end());
  plan_scratch(plan);
  ++plans_built_;
  return plans_[id] = std::move(plan);
}

std::vector<c10::IValue> Engine::evaluate_patched(const std::string& name, c10::IValue value) {
  return evaluate_patched_at(id_of(name), std::move(value));
}

std::vector<c10::IValue> Engine::evaluate_patched_at(int64_t id, c10::IValue value) {
  check_id(id, "evaluate_patched");
  const std::string& name = states_[id].node->name();
  take_written_inputs("evaluate_patched");  // the caller's patch function ran since the last read
  settle_pending();              // settle() without scanning the inputs again
  TORCH_CHECK(has_run_, "evaluate_patched %", name, ": call run() first");
  TORCH_CHECK(dirty_.empty(), "evaluate_patched %", name, ": ", dirty_.size(),
              " nodes are stale; demand() first, so that only the patch's cone is evaluated");
  TORCH_CHECK(!txn_, "evaluate_patched %", name, ": a transaction is open");
  TORCH_CHECK(!cutoff_, "evaluate_patched %", name, ": not available with early cutoff on");
  TORCH_CHECK(!states_[id].pinned, "evaluate_patched %", name, ": the node is pinned by a standing patch; ",
              "use patch()/demand() with a transaction instead");
  check_value_type(*states_[id].node, value);
  return evaluate_cone_whole(id, std::move(value));
}

// Whether `value`, given for node `id`, lays its elements out otherwise than the node's current value does. Such a
// value is another input to the cone (a reduction reads it in another order), and eager's kernels carry its
// layout downstream (an elementwise op's result follows its input's strides), where the scratch's out= steps
// write into the layout the trace gave and the row path keeps rows computed from the current layout.
//
// The cone is taken off its traced layout as well when the node's current value, or a cone node's, is not in the
// layout the trace gave (a standing patch upstream in another layout, as `rg.patch(hook, torch.randn(shape))` of a
// transposed node gives, carried on by the functional kernels): a site value in that current layout still meets the
// out= steps, which write the traced one, and a transpose's reader downstream then reduced in another order than
// eager (2e-8 relative off on a Conv1d after such a patch, with positions off).
bool Engine::other_layout(int64_t id, const c10::IValue& value) const {
  const c10::IValue& current = values_[id];
  if (value.isTensor() && current.isTensor() && !same_layout(value.toTensor(), current.toTensor())) return true;
  // Only a standing patch puts a value off its traced strides upstream (inputs keep the example's layout): without
  // one, the per-site walk below is skipped, so a plain sweep's loop pays nothing for it.
  if (pinned_.empty()) return false;
  const auto off_trace = [&](int64_t n) {
    const c10::IValue& v = values_[n];
    const ir::Type& t = states_[n].node->type();
    if (!v.isTensor() || !t.is_tensor()) return false;
    const at::Tensor& x = v.toTensor();
    if (x.dim() != static_cast<int64_t>(t.tensor.strides.size())) return false;
    for (int64_t d = 0; d < x.dim(); ++d)
      if (x.size(d) > 1 && x.stride(d) != t.tensor.strides[d]) return true;
    return false;
  };
  if (off_trace(id)) return true;
  const auto plan = plans_.find(id);
  if (plan != plans_.end() && plan->second.pins_version == pins_version_) {
    for (int64_t n : plan->second.order)
      if (off_trace(n)) return true;
    return false;
  }
  for (int64_t n : downstream(id, true))
    if (off_trace(n)) return true;
  return false;
}

std::vector<c10::IValue> Engine::evaluate_cone_whole(int64_t id, c10::IValue value) {
  PatchPlan& plan = plan_for(id);
  bind_scratch(plan);
  const bool other = other_layout(id, value);
  // The state afterwards is exactly the state before. Every step writes its slot before any step reads it (the
  // plan is in topological order, and a cone node reads only earlier cone nodes and values outside the cone), so
  // the cached values are taken out of their slots, not copied.
  HeldCone held(*this, id, plan, std::move(value), /*take=*/true);
  // The executor's loop: values are released at their last use, and nothing else happens per node
  // (but for the composite steps scratch.cpp checks).
  const auto on_error = [&](size_t i, const std::exception& e) {
    count_plan(plan, i);  // the nodes before it did run
    rethrow_evaluating(states_[plan.order[i]], e);
  };
  if (other) {
    // A site value in another layout: every step on its functional kernel, which carries that layout on as
    // eager's does (the plan's out= steps write the layout the trace gave, its in-place steps reuse buffers).
    std::vector<runtime::Step> functional = plan.steps;
    for (size_t i = 0; i < functional.size(); ++i) {
      functional[i].kernel = &*states_[plan.order[i]].kernel;
      functional[i].overwrites = -1;
    }
    runtime::run_steps(functional, values_, stack_, on_error);
  } else if (plan.scratch_generation != 0) {  // out= steps write into the scratch: each runs checked (scratch.cpp)
    struct Hooks : runtime::NoHooks {
      Engine* self;
      PatchPlan* plan;
      bool before(size_t i, const c10::IValue&) {
        if (plan->scratch_of[i] < 0 || plan->scratch[plan->scratch_of[i]].fell_back) return true;
        self->values_[plan->order[i]] = self->run_scratch_step(*plan, i);
        return false;
      }
      void after(size_t i) {
        if (!plan->alias_checks.empty() && plan->alias_checks[i]) self->unalias_scratch(self->values_[plan->order[i]]);
      }
    };
    Hooks hooks;
    hooks.self = this;
    hooks.plan = &plan;
    runtime::run_steps(plan.steps, values_, stack_, on_error, hooks);
  } else if (plan.alias_checks.empty() || !scratch_.defined()) {
    runtime::run_steps(plan.steps, values_, stack_, on_error);
  } else {
    runtime::run_steps(plan.steps, values_, stack_, on_error, runtime::after_each([&](size_t i) {
                         if (plan.alias_checks[i]) unalias_scratch(values_[plan.order[i]]);
                       }));
  }
  count_plan(plan, plan.order.size());
  return runtime::output_values(graph_->output()->args()[0].list,
                                [&](const ir::Node* n) -> const c10::IValue& { return values_[ids_.at(n)]; });
}

Engine::HeldCone::HeldCone(Engine& engine, int64_t site, const PatchPlan& plan, c10::IValue value, bool take)
    : engine_(engine), site_(site), plan_(plan) {
  for (int64_t in : plan.external) engine.check_intact(in);  // I8: never compute from a written value
  saved_.reserve(plan.order.size());
  if (take) {
    for (int64_t n : plan.order) saved_.push_back(std::move(engine.values_[n]));
  } else {
    for (int64_t n : plan.order) saved_.push_back(engine.values_[n]);
  }
  saved_site_ = std::move(engine.values_[site]);
  engine.values_[site] = std::move(value);
}

Engine::HeldCone::~HeldCone() {
  for (size_t i = 0; i < plan_.order.size(); ++i) engine_.values_[plan_.order[i]] = std::move(saved_[i]);
  engine_.values_[site_] = std::move(saved_site_);
}

void Engine::count_evaluation(NodeState& st, int64_t rows, int64_t of, double cost_fraction) {
  ++st.evaluations;
  ++stats_.evaluations;
  const double fraction = rows >= of ? 1.0 : static_cast<double>(rows) / static_cast<double>(of);
  stats_.cost += st.cost * fraction * cost_fraction;
  stats_.row_evaluations.add(rows, of);
}

double RowEvaluations::value() const {
  // sum = whole + num / den, num and den integers (den the least common multiple of the row counts).
  constexpr int64_t kExact = int64_t{1} << 53;
  __int128 num = 0, den = 1;
  bool exact = true;
  for (const auto& [T, k] : partial) {
    const __int128 lcm = den / std::gcd(static_cast<int64_t>(den), T) * T;
    if (lcm >= kExact) {
      exact = false;
      break;
    }
    num = num * (lcm / den) + static_cast<__int128>(k) * (lcm / T);
    den = lcm;
  }
  const __int128 total = num + static_cast<__int128>(whole) * den;
  if (exact && total < kExact) return static_cast<double>(total) / static_cast<double>(den);
  long double sum = static_cast<long double>(whole);  // beyond 53 bits: as close as long double gets
  for (const auto& [T, k] : partial) sum += static_cast<long double>(k) / static_cast<long double>(T);
  return static_cast<double>(sum);
}

void Engine::count_plan(const PatchPlan& plan, size_t done) {
  // Node by node, in order, as count_evaluation adds them: the same cost sum bit for bit.
  for (size_t i = 0; i < done; ++i) {
    NodeState& st = states_[plan.order[i]];
    ++st.evaluations;
    stats_.cost += st.cost;
    stats_.row_evaluations.whole += 1;
  }
  stats_.evaluations += static_cast<int64_t>(done);
}

void Engine::rethrow_evaluating(const NodeState& st, const std::exception& e, const std::string& where) {
  TORCH_CHECK(false, "while evaluating node %", st.node->name(), where, ": ",
              dynamic_cast<const c10::Error*>(&e) ? static_cast<const c10::Error&>(e).what_without_backtrace()
                                                  : e.what());
}

void Engine::begin_transaction(bool restore_counts) {
  settle();
  TORCH_CHECK(has_run_, "begin_transaction: call run() first");
  TORCH_CHECK(!txn_, "begin_transaction: a transaction is already open (transactions do not nest)");
  Transaction t;
  t.pinned_before = pinned_;
  t.structural_before = structural_dirty_;
  t.baseline_stale_before = baseline_stale_;
  if (restore_counts) {
    t.stats_before = stats_;
    t.node_evaluations_before.reserve(states_.size());
    for (const auto& st : states_) t.node_evaluations_before.push_back(st.evaluations);
  }
  txn_.emplace(std::move(t));
}

void Engine::commit() {
  TORCH_CHECK(txn_, "commit: no transaction is open");
  txn_.reset();
}

void Engine::rollback() {
  TORCH_CHECK(txn_, "rollback: no transaction is open");
  // A batch inside the transaction: its marks are journaled, then undone. An input written in place
  // meanwhile is not refused here (rollback runs on the error path too): the next read takes it (I15).
  settle_pending();
  Transaction t = std::move(*txn_);
  txn_.reset();
  std::vector<int64_t> written;  // entries whose saved value was written in place meanwhile (I8)
  for (auto& [id, e] : t.journal) {
    NodeState& st = states_[id];
    if (st.countable && !st.valid) dirty_.erase({st.node->index(), id});
    values_[id] = std::move(e.value);
    versions_[id] = e.version;
    st.changed_at = e.changed_at;
    st.verified_at = e.verified_at;
    st.valid = e.valid;
    st.pinned = e.pinned;
    if (st.countable && !st.valid) dirty_.insert({st.node->index(), id});
    if (st.valid && st.countable && !st.pinned && e.version >= 0 && version_of(values_[id]) != e.version)
      written.push_back(id);
  }
  if (pinned_ != t.pinned_before) ++pins_version_;
  pinned_ = std::move(t.pinned_before);
  for (int64_t id : t.overlay_added) overlay_.erase(id);
  std::set<int64_t> structural = std::move(t.structural_before);
  for (int64_t id : structural_dirty_)
    if (!states_[id].valid) structural.insert(id);  // found written in place during the transaction
  structural_dirty_ = std::move(structural);
  baseline_stale_ = std::move(t.baseline_stale_before);
  if (t.stats_before) {  // the counters as at begin_transaction(true): nothing was grafted meanwhile (refused)
    stats_ = *t.stats_before;
    for (size_t i = 0; i < t.node_evaluations_before.size(); ++i) states_[i].evaluations = t.node_evaluations_before[i];
  }
  for (int64_t id : written) retire_written(id);
}

// Demand's loop is the executor's (runtime/run_loop.h) with two hooks: before a node runs, its
// inputs are checked (I8) and early cutoff may skip it; its value then replaces the cached one with
// the ledger, the overlay and the revisions kept. A node leaves the dirty set only once it is valid,
// so an error (a written input, a failing kernel) leaves it and every later node stale (I2).
void Engine::evaluate_nodes(const std::vector<int64_t>& ids) {
  // Graph values are data, never autograd history: skip the autograd kernels.
  at::AutoDispatchBelowAutograd no_autograd;
  demand_steps_.resize(ids.size());  // kept across demands: no allocation per demand
  for (size_t i = 0; i < ids.size(); ++i) {
    demand_steps_[i].kernel = &*states_[ids[i]].kernel;
    demand_steps_[i].out = ids[i];
  }
  struct Hooks : runtime::NoHooks {
    Engine& e;
    explicit Hooks(Engine& engine) : e(engine) {}
    bool before(size_t i, const c10::IValue& current) { return e.begin_evaluation(e.demand_steps_[i].out, current); }
    void store(size_t i, c10::IValue& slot, c10::IValue&& v) {
      e.finish_evaluation(e.demand_steps_[i].out, slot, std::move(v));
    }
  };
  runtime::run_steps(
      demand_steps_, values_, stack_,
      [this](size_t i, const std::exception& e) { rethrow_evaluating(states_[demand_steps_[i].out], e); }, Hooks(*this));
}

bool Engine::begin_evaluation(int64_t id, const c10::IValue& current) {
  NodeState& st = states_[id];
  TORCH_INTERNAL_ASSERT(st.countable && !st.valid && !st.pinned);
  journal(id);
  for (int64_t in : st.kernel->input_slots()) check_intact(in);  // I8: never compute from a written value
  // A graft changed this node's inputs: its pre-graft value is no baseline; if a patch is active,
  // restore() must recompute it.
  if (!structural_dirty_.empty() && structural_dirty_.erase(id) && !pinned_.empty()) baseline_stale_.insert(id);
  if (!cutoff_ || current.isNone()) return true;
  for (int64_t in : st.kernel->input_slots())
    if (states_[in].changed_at > st.verified_at) return true;
  // Early cutoff: no input changed since the node was last verified, so its value stands.
  dirty_.erase({st.node->index(), id});
  st.valid = true;
  st.verified_at = revision_;
  ++stats_.cutoffs;
  return false;
}

void Engine::finish_evaluation(int64_t id, c10::IValue& slot, c10::IValue&& out) {
  NodeState& st = states_[id];
  count_evaluation(st);
  save_baseline(id);  // `slot` still holds the value `out` replaces
  // Early cutoff compares with the old value, unless the two share memory: a view of an input written in place
  // (GPT-2's `input_ids.view(-1, T)`, a weight's `W.t()`) then looked unchanged, and its cone kept the values of
  // the old tokens, silently (fuzz_sweep seed 77: GPT-2 logits 0.33 off after a token was edited in place).
  const bool unchanged = cutoff_ && !shares_memory(out, slot) && values_equal(out, slot);
  store(id, std::move(out));  // `slot` is values_[id]
  dirty_.erase({st.node->index(), id});
  st.valid = true;
  st.verified_at = revision_;
  if (!unchanged) st.changed_at = revision_;
}

void Engine::rekey_dirty() {
  std::set<std::pair<int64_t, int64_t>> rekeyed;
  for (const auto& entry : dirty_) rekeyed.insert({states_[entry.second].node->index(), entry.second});
  dirty_.swap(rekeyed);
}

void Engine::run(std::vector<c10::IValue> inputs) {
  const auto placeholders = graph_->placeholders();
  refuse_in_transaction("run");
  settle();  // run() marks every node invalid: grafted blocks must be in the dirty set first
  TORCH_CHECK(inputs.size() == placeholders.size(), "run: expected ", placeholders.size(), " inputs, got ",
              inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) runtime::check_input(*placeholders[i], inputs[i], i);
  for (int64_t id : pinned_) states_[id].pinned = false;
  pinned_.clear();
  ++pins_version_;
  overlay_.clear();
  baseline_stale_.clear();
  structural_dirty_.clear();
  ++revision_;
  for (size_t i = 0; i < inputs.size(); ++i) {
    NodeState& st = states_[ids_.at(placeholders[i])];
    store(ids_.at(placeholders[i]), std::move(inputs[i]));
    st.changed_at = st.verified_at = revision_;
  }
  for (size_t id = 0; id < states_.size(); ++id) {
    mark_invalid(static_cast<int64_t>(id));
    states_[id].verified_at = 0;  // a full evaluation: early cutoff must not skip anything
  }
  has_run_ = true;
  try {
    demand();
  } catch (...) {
    has_run_ = false;
    throw;
  }
}

std::vector<c10::IValue> Engine::demand() {
  TORCH_CHECK(has_run_, "demand: the engine has no values yet; call run(inputs) first");
  settle();
  if (!dirty_.empty()) {
    std::vector<int64_t> ids;  // topological order: dirty_ is keyed by index
    ids.reserve(dirty_.size());
    for (const auto& entry : dirty_) ids.push_back(entry.second);
    evaluate_nodes(ids);
  }
  for (const ir::Arg& a : graph_->output()->args()[0].list)
    if (a.kind == ir::Arg::Kind::Node) check_intact(ids_.at(a.node));
  return runtime::output_values(graph_->output()->args()[0].list,
                                [&](const ir::Node* n) -> const c10::IValue& { return values_[ids_.at(n)]; });
}

c10::IValue Engine::value(const std::string& name) { return value_at(id_of(name)); }

c10::IValue Engine::value_at(int64_t target) {
  check_id(target, "value");
  const std::string& name = states_[target].node->name();
  TORCH_CHECK(has_run_, "value %", name, ": the engine has no values yet; call run(inputs) first");
  settle();
  if (states_[target].valid) {  // I3: nothing upstream is stale (the common case: no walk, no allocation)
    check_intact(target);
    return values_[target];
  }
  std::vector<int64_t> needed;
  std::vector<int64_t> work{target};
  std::set<int64_t> seen{target};
  while (!work.empty()) {
    const int64_t v = work.back();
    work.pop_back();
    const NodeState& st = states_[v];
    if (st.valid) continue;  // I3: a valid node's ancestors are valid
    needed.push_back(v);
    for (int64_t in : st.kernel->input_slots())
      if (seen.insert(in).second) work.push_back(in);
  }
  std::sort(needed.begin(), needed.end(),
            [this](int64_t a, int64_t b) { return states_[a].node->index() < states_[b].node->index(); });
  evaluate_nodes(needed);
  check_intact(target);
  return values_[target];
}

c10::IValue Engine::baseline(const std::string& name) {
  const int64_t id = id_of(name);
  TORCH_CHECK(has_run_, "baseline %", name, ": the engine has no values yet; call run(inputs) first");
  settle();
  auto it = overlay_.find(id);
  if (it != overlay_.end() && !baseline_stale_.count(id)) {
    check_intact(name);
    return it->second.value;
  }
  if (pinned_.empty() || (!baseline_stale_.count(id) && states_[id].valid)) return value(name);
  // Invalidated by a patch upstream but not recomputed since: it still holds its baseline (I6: a
  // recomputation would have saved it in the overlay), which restore() revives as it is.
  const bool kept = !states_[id].valid && !baseline_stale_.count(id) && !structural_dirty_.count(id) &&
                    values_[id].isTensor();
  TORCH_CHECK(kept, "baseline of %", name, " is not cached while patches are active (a graft or an in-place write "
              "displaced it, or it was recomputed under a patch without a saved copy); restore() first, then patch "
              "it (a patch function receives the baseline, never the patched upstream value)");
  check_intact(id);
  return values_[id];
}

void Engine::check_value_type(const ir::Node& node, const c10::IValue& v) const {
  const ir::Type& t = node.type();
  TORCH_CHECK(t.kind == ir::Type::Kind::Tensor, "patch %", node.name(), ": only tensor-valued nodes can be patched (",
              "node type ", ir::print_type(t), ")");
  TORCH_CHECK(v.isTensor(), "patch %", node.name(), ": expected a tensor, got ", v.tagKind());
  const at::Tensor& x = v.toTensor();
  TORCH_CHECK(x.scalar_type() == t.tensor.dtype, "patch %", node.name(), ": expected dtype ",
              ir::dtype_torch_name(t.tensor.dtype), ", got ", x.scalar_type());
  TORCH_CHECK(x.sizes() == c10::IntArrayRef(t.tensor.sizes), "patch %", node.name(), ": expected shape ",
              c10::IntArrayRef(t.tensor.sizes), ", got ", x.sizes());
  TORCH_CHECK(x.device() == t.tensor.device, "patch %", node.name(), ": expected device ", t.tensor.device,
              ", got ", x.device());
}

std::set<int64_t> Engine::downstream(int64_t seed, bool stop_at_pins) const {
  std::set<int64_t> seen;
  walk_users(seed, [&](int64_t u) {
    if (stop_at_pins && (states_[u].pinned || !states_[u].countable)) return false;
    return seen.insert(u).second;
  });
  return seen;
}

std::vector<std::string> Engine::cone(const std::string& name, bool stop_at_pins) const {
  const std::set<int64_t> seen = downstream(id_of(name), stop_at_pins);
  std::vector<const ir::Node*> nodes;
  for (int64_t id : seen) nodes.push_back(states_[id].node);
  std::sort(nodes.begin(), nodes.end(), [](const ir::Node* a, const ir::Node* b) { return a->index() < b->index(); });
  std::vector<std::string> out;
  for (const ir::Node* n : nodes) out.push_back(n->name());
  return out;
}

double Engine::cone_cost(const std::string& name) const {
  double total = 0.0;
  for (int64_t id : downstream(id_of(name), /*stop_at_pins=*/false)) total += states_[id].cost;
  return total;
}

bool Engine::is_valid(const std::string& name) {
  const int64_t id = id_of(name);
  settle();
  return states_[id].valid;
}

std::vector<std::string> Engine::pinned() const {
  std::vector<std::string> out;
  for (int64_t id : pinned_) out.push_back(states_[id].node->name());
  return out;
}

void Engine::reset_stats() {
  settle();  // the counts reset are those of every mutation made so far
  stats_ = Stats{};
  for (auto& st : states_) st.evaluations = 0;
}

void Engine::check_invariants() {
  settle();  // I14: what is checked is the settled state
  TORCH_CHECK(pending_.empty() && batch_depth_ >= 0, "I14 pending: ", pending_.size(),
              " mutations not settled, batch depth ", batch_depth_);
  TORCH_CHECK(!rekey_pending_, "I2 dirty: keys not rebuilt after a graft");
  TORCH_CHECK(ids_.size() == states_.size() && values_.size() == states_.size() && versions_.size() == states_.size(),
              "id map out of sync: ", ids_.size(), " ids, ", states_.size(), " states, ", values_.size(), " values");
  int64_t evaluations = 0;
  int64_t countable = 0;
  size_t dirty_count = 0;
  size_t pinned_count = 0;
  for (size_t id = 0; id < states_.size(); ++id) {
    const NodeState& st = states_[id];
    const ir::Node& n = *st.node;
    const std::string where = "invariant violated at %" + n.name() + ": ";
    TORCH_CHECK(ids_.at(&n) == static_cast<int64_t>(id), where, "id map out of sync");
    for (const ir::Node* in : n.inputs())
      TORCH_CHECK(in->index() < n.index(), "I1 ", where, "input %", in->name(), " comes later");
    const bool in_dirty = dirty_.count({n.index(), static_cast<int64_t>(id)}) > 0;
    TORCH_CHECK(in_dirty == (st.countable && !st.valid), "I2 dirty ", where, "valid=", st.valid,
                " but in_dirty=", in_dirty);
    dirty_count += in_dirty;
    countable += st.countable;
    if (!st.countable) TORCH_CHECK(st.valid, "I4 ", where, "placeholders are always valid");
    TORCH_CHECK(st.changed_at <= revision_ && st.verified_at <= revision_, "I13 revision ", where, "changed at ",
                st.changed_at, ", verified at ", st.verified_at, ", but the revision is ", revision_);
    if (st.pinned) {
      ++pinned_count;
      TORCH_CHECK(st.valid, "I4 ", where, "pinned nodes are valid");
      TORCH_CHECK(overlay_.count(static_cast<int64_t>(id)), "I10 pinned ", where, "no overlay entry for its baseline");
    }
    if (!st.valid) {
      for (const ir::Node* user : n.users()) {
        if (user->kind() == ir::NodeKind::Output) continue;
        const NodeState& us = states_[ids_.at(user)];
        TORCH_CHECK(!us.valid || us.pinned, "I3 ", where, "invalid, but its user %", user->name(), " is valid");
      }
    } else if (has_run_) {
      TORCH_CHECK(!values_[id].isNone() || n.type().kind == ir::Type::Kind::None, "I5 ", where, "valid without value");
      TORCH_CHECK(versions_[id] < 0 || version_of(values_[id]) == versions_[id], "I8 ", where,
                  "cached tensor was modified in place (version ", version_of(values_[id]), ", stored at ",
                  versions_[id], ")");
      if (st.countable && !st.pinned)
        for (int64_t in : st.kernel->input_slots())
          TORCH_CHECK(st.verified_at >= states_[in].changed_at, "I4 ", where, "verified at ", st.verified_at,
                      " but input %", states_[in].node->name(), " changed at ", states_[in].changed_at);
    }
    evaluations += st.evaluations;
  }
  TORCH_CHECK(countable == num_countable_, "countable count out of sync: ", num_countable_, " vs ", countable);
  TORCH_CHECK(dirty_count == dirty_.size(), "I2 dirty set holds stale entries: ", dirty_.size(), " vs ", dirty_count);
  const auto known = [this](int64_t id) { return id >= 0 && id < static_cast<int64_t>(states_.size()); };
  for (int64_t id : structural_dirty_)
    TORCH_CHECK(known(id) && (!states_[id].valid || states_[id].pinned), "I11 structural_dirty node ",
                known(id) ? "%" + states_[id].node->name() : std::to_string(id),
                " is valid (or unknown), so restore() would keep a value of its old function");
  TORCH_CHECK(!pinned_.empty() || baseline_stale_.empty(), "I12 baseline_stale holds ", baseline_stale_.size(),
              " nodes with no patch active");
  for (int64_t id : baseline_stale_)
    TORCH_CHECK(known(id), "I12 baseline_stale holds ", id, ", which is no node of the engine");
  for (const auto& entry : overlay_)
    TORCH_CHECK(known(entry.first), "I6 overlay holds ", entry.first, ", which is no node of the engine");
  TORCH_CHECK(pinned_count == pinned_.size() && std::set<int64_t>(pinned_.begin(), pinned_.end()).size() == pinned_.size(),
              "I10 pinned list out of sync: ", pinned_.size(), " entries for ", pinned_count, " pinned nodes");
  TORCH_CHECK(!pinned_.empty() || overlay_.empty(), "I6 overlay is non-empty with no patch active");
  for (const auto& [id, b] : overlay_)
    TORCH_CHECK(baseline_stale_.count(id) || b.version < 0 || version_of(b.value) == b.version,
                "I8 invariant violated at %", states_[id].node->name(), ": overlay baseline was modified in place");
  for (size_t k = 0; k < grafts_.size(); ++k) {
    TORCH_CHECK(grafts_[k].revision <= revision_ && (k == 0 || grafts_[k - 1].revision < grafts_[k].revision),
                "I13 revision: graft ", k, " recorded at revision ", grafts_[k].revision, " (now ", revision_, ")");
    for (int64_t id : grafts_[k].nodes)
      TORCH_CHECK(id >= 0 && id < static_cast<int64_t>(states_.size()) && states_[id].countable &&
                      graph_->find(states_[id].node->name()) == states_[id].node,
                  "I13 grafts: graft ", k, " lists node ", id, ", which is not a countable node of the graph");
  }
  TORCH_CHECK(evaluations == stats_.evaluations, "I7 ledger drift: per-node sum ", evaluations, " vs ",
              stats_.evaluations);
}

}  // namespace torch_ext::reactive
