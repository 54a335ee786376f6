#include "ir/out_variant.h"

#include "ir/schema.h"

#include <ATen/core/enum_tag.h>
#include <c10/core/DispatchKey.h>
#include <c10/core/TensorOptions.h>

#include <algorithm>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_set>
#include <unordered_map>

namespace torch_ext::ir {
namespace {

// Every overload name of each operator with a schema, kept by a dispatcher registration listener (told
// of every operator already defined, then of each one defined or removed later: a library loaded
// afterwards), so it never misses one. It replaces a copy of the dispatcher's whole name table per
// lookup (getAllOpNames, thousands of names): plan_memory looks up every node, and the memory-budget
// search plans hundreds of candidate graphs, so that copy dominated a budgeted compile of a
// 3,000-node GRU step (minutes).
class OverloadIndex {
 public:
  void add(const c10::OperatorName& n) {
    std::lock_guard<std::mutex> lock(mutex_);
    ++overloads_[n.name][n.overload_name];
    ++generation_;
  }
  void remove(const c10::OperatorName& n) {
    std::lock_guard<std::mutex> lock(mutex_);
    ++generation_;
    auto it = overloads_.find(n.name);
    if (it == overloads_.end()) return;
    auto o = it->second.find(n.overload_name);
    if (o != it->second.end() && --o->second == 0) it->second.erase(o);
  }
  std::vector<std::string> of(const std::string& qualified_name) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::string> out;
    auto it = overloads_.find(qualified_name);
    if (it != overloads_.end())
      for (const auto& [overload, count] : it->second) out.push_back(overload);  // sorted: a std::map
    return out;
  }

  // Moves at every operator defined or removed: what was derived from the registered operators stays
  // valid while it stays the same.
  uint64_t generation() {
    std::lock_guard<std::mutex> lock(mutex_);
    return generation_;
  }

 private:
  std::mutex mutex_;
  std::unordered_map<std::string, std::map<std::string, int>> overloads_;
  uint64_t generation_ = 0;
};

// The dispatcher owns its listener: this one forwards to the index, which outlives it.
class ListenerRef final : public c10::OpRegistrationListener {
 public:
  explicit ListenerRef(OverloadIndex* index) : index_(index) {}
  void onOperatorRegistered(const c10::OperatorHandle& op) override { index_->add(op.operator_name()); }
  void onOperatorDeregistered(const c10::OperatorHandle& op) override { index_->remove(op.operator_name()); }

 private:
  OverloadIndex* index_;
};

OverloadIndex& overload_index() {
  static OverloadIndex* const index = [] {
    auto* idx = new OverloadIndex();  // never freed: the dispatcher may call it until the process ends
    auto listener = std::unique_ptr<c10::OpRegistrationListener>(new ListenerRef(idx));
    // The handle is kept alive forever (deregistering at exit could run after the dispatcher is gone).
    new c10::RegistrationHandleRAII(c10::Dispatcher::singleton().addRegistrationListener(std::move(listener)));
    return idx;
  }();
  return *index;
}

std::vector<std::string> overloads_of(const std::string& qualified_name) {
  return overload_index().of(qualified_name);
}

// `c` has `f`'s arguments (names and types, in order), with write annotations only on those it
// returns in place; the indices of its written arguments.
std::optional<std::vector<size_t>> written_args_if_inplace_of(const c10::FunctionSchema& f,
                                                              const c10::FunctionSchema& c) {
  const auto& fa = f.arguments();
  const auto& ca = c.arguments();
  if (fa.size() != ca.size()) return std::nullopt;
  std::vector<size_t> written;
  for (size_t i = 0; i < fa.size(); ++i) {
    if (fa[i].name() != ca[i].name() || fa[i].kwarg_only() != ca[i].kwarg_only() || *fa[i].type() != *ca[i].type())
      return std::nullopt;
    if (fa[i].alias_info() && fa[i].alias_info()->isWrite()) return std::nullopt;  // `f` is not functional
    if (ca[i].alias_info() && ca[i].alias_info()->isWrite()) written.push_back(i);
  }
  const auto& rets = c.returns();
  if (!rets.empty() && rets.size() != written.size()) return std::nullopt;
  for (const auto& r : rets)
    if (!r.alias_info() || !r.alias_info()->isWrite()) return std::nullopt;
  return written;
}

// Reductions whose out= kernel uses `out` as scratch of the input's shape before reducing into it
// (torch 2.9, CPU): given a planned arena view, which cannot grow, they failed with "Trying to resize
// storage that is not resizable" (a step with accumulate=2 or process_group and one of these
// losses). Found by calling every loss's out= kernel on a [] view inside a sentinel-filled buffer.
// They run functionally instead. Correctness no longer depends on this list: the arena executor and the
// reactive sweep's scratch check every out= call and fall back to the functional kernel
// (runtime/arena_executor.h, reactive/scratch.cpp), and mark the overload unusable for later plans
// (mark_out_kernel_unusable). It is kept because it saves, per process, the wasted first call (a thrown
// c10::Error with its backtrace) and, in a planned step, an arena buffer that would stay reserved unused.
// The out= overloads a runtime found resizing or re-pointing a planned buffer (mark_out_kernel_unusable).
std::mutex unusable_mutex;
std::unordered_set<c10::OperatorName>& unusable_out_kernels() {
  static std::unordered_set<c10::OperatorName> names;
  return names;
}

bool marked_unusable(const c10::OperatorName& out) {
  std::lock_guard<std::mutex> lock(unusable_mutex);
  return unusable_out_kernels().count(out) > 0;
}

bool out_kernel_writes_scratch(const Target& t) {
  static const char* const kOps[] = {"mse_loss", "huber_loss", "soft_margin_loss", "binary_cross_entropy"};
  return t.ns == "aten" && std::any_of(std::begin(kOps), std::end(kOps), [&](const char* op) { return t.name == op; });
}

// Batch norm's CPU out= kernels (torch 2.9) compute the result of an input that is not contiguous (transposed,
// channels-last, sliced) into tensors of their own and leave `out` and `save_mean` as they were, in training and
// (native_batch_norm) in eval: no resize, so no runtime check sees it. A planned step whose budget put a
// transposed BatchNorm1d's result into the arena trained on stale arena bytes (the loss 0.02 to 0.1 off eager,
// varying per call, silently; found by scripts/fuzz_step.py seed 18). Such a node runs functionally.
bool out_kernel_ignores_out(const Node& node) {
  static const char* const kOps[] = {"native_batch_norm", "_native_batch_norm_legit", "_batch_norm_with_update",
                                     "_native_batch_norm_legit_no_training"};
  const Target& t = node.target();
  if (t.ns != "aten" || std::none_of(std::begin(kOps), std::end(kOps), [&](const char* op) { return t.name == op; }))
    return false;
  if (node.args().empty() || node.args()[0].kind != Arg::Kind::Node) return true;
  const Type& input = node.args()[0].node->type();
  return !input.is_tensor() || !input.tensor.is_contiguous();
}

}  // namespace

namespace {

// find_inplace_variant's scan of every registered operator of the node's namespace.
std::optional<InplaceVariant> scan_inplace_variant(const Node& node) {
  const auto functional = find_op(node.target());
  if (!functional) return std::nullopt;
  const size_t results = node.type().kind == Type::Kind::Tuple ? node.type().elems.size() : 1;
  const std::string prefix = node.target().ns + "::";
  std::vector<std::pair<c10::OperatorName, std::vector<size_t>>> found;
  for (const c10::OperatorName& name : c10::Dispatcher::singleton().getAllOpNames()) {
    if (name.name.compare(0, prefix.size(), prefix) != 0) continue;
    const auto op = c10::Dispatcher::singleton().findOp(name);
    if (!op || !op->hasSchema() || op->operator_name() == functional->operator_name()) continue;
    auto written = written_args_if_inplace_of(functional->schema(), op->schema());
    if (written && written->size() == results)
      found.emplace_back(name, std::move(*written));
  }
  if (found.size() > 1) {
    // Same arguments, several ops (aten::neg_, aten::abs_ ... for aten::neg): keep those whose name
    // extends this one's, and of those the shortest (aten::neg_ over aten::negative_).
    const std::string base = prefix + node.target().name;
    found.erase(std::remove_if(found.begin(), found.end(),
                               [&](const auto& f) { return f.first.name.compare(0, base.size(), base) != 0; }),
                found.end());
    std::sort(found.begin(), found.end(),
              [](const auto& x, const auto& y) { return x.first.name.size() < y.first.name.size(); });
    if (found.size() > 1 && found[0].first.name.size() == found[1].first.name.size()) return std::nullopt;
  }
  if (found.empty()) return std::nullopt;
  return InplaceVariant{*c10::Dispatcher::singleton().findOp(found[0].first), std::move(found[0].second)};
}

}  // namespace

std::optional<InplaceVariant> find_inplace_variant(const Node& node) {
  if (node.kind() != NodeKind::Call || node.target().is_builtin()) return std::nullopt;
  // The scan copies the dispatcher's whole name table (thousands of names): once per target and result
  // count while no operator is defined or removed, not once per node (lower_out_variants asks for every
  // state update of a step: a 200-layer Adam step's plan spent most of its time in these copies).
  static std::mutex mutex;
  static std::unordered_map<std::string, std::optional<InplaceVariant>> cache;
  static uint64_t cached_generation = 0;
  const size_t results = node.type().kind == Type::Kind::Tuple ? node.type().elems.size() : 1;
  const std::string key = node.target().str() + "#" + std::to_string(results);
  const uint64_t generation = overload_index().generation();
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (generation != cached_generation) {
      cache.clear();
      cached_generation = generation;
    }
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  auto found = scan_inplace_variant(node);
  std::lock_guard<std::mutex> lock(mutex);
  if (overload_index().generation() == generation) cache.emplace(key, found);
  return found;
}

std::vector<std::string> overload_names(const std::string& qualified_name) { return overloads_of(qualified_name); }

const Node* overwritten_input(const Node& node, const InplaceVariant& variant) {
  if (variant.written_args.size() != 1 || variant.op.schema().returns().size() != 1) return nullptr;
  const size_t w = variant.written_args[0];
  if (w >= node.args().size() || node.args()[w].kind != Arg::Kind::Node) return nullptr;
  const Node* input = node.args()[w].node;
  int64_t uses = 0;
  for (const Arg& a : node.args()) a.for_each_node([&](const Node* x) { uses += x == input; });
  for (const auto& kv : node.kwargs()) kv.second.for_each_node([&](const Node* x) { uses += x == input; });
  if (uses != 1 || !input->type().is_tensor() || !node.type().is_tensor()) return nullptr;
  const TensorMeta& in = input->type().tensor;
  const TensorMeta& out = node.type().tensor;
  if (in.sizes != out.sizes || in.strides != out.strides || in.dtype != out.dtype || in.device != out.device ||
      out.numel() == 0)
    return nullptr;
  return input;
}

namespace {

// Whether `node`'s in-place variant rounds a Scalar argument to the tensor's dtype where the functional
// kernel computes with it unrounded: for a float16/bfloat16 result, torch 2.9.1's mul_.Scalar multiplies by
// the scalar rounded to that dtype first (0.9 -> 0.8984375 in bfloat16: 1.8125 * 0.9 gives 1.625, mul.Scalar
// 1.6328125), mul.Scalar (and mul.Scalar_out) by it in float. Found by running every aten pointwise overload
// with a Scalar argument and an in-place twin of the same arguments (37 in torch 2.9.1) on bfloat16 and
// float16 tensors with scalars 0.9, 0.1, 1/3, 1.7 and -2.3 against its in-place variant, bit for bit: only
// mul.Scalar differs. add.Scalar, sub.Scalar (alpha too), div.Scalar, div.Scalar_mode, add.Tensor and
// sub.Tensor with alpha, mul.Tensor/add.Tensor/div.Tensor with a number, addcmul/addcdiv (value), lerp.Scalar,
// pow.Tensor_Scalar, float_power.Tensor_Scalar, clamp/clamp_min/clamp_max/clip, hardtanh, elu, celu, threshold,
// fmod.Scalar, remainder.Scalar, copysign.Scalar, xlogy.Scalar_Other and masked_fill.Scalar give the same bits;
// float32 and float64 never differ.
bool inplace_rounds_scalar(const Node& node) {
  if (!node.type().is_tensor()) return false;
  const c10::ScalarType dtype = node.type().tensor.dtype;
  if (dtype != c10::ScalarType::Half && dtype != c10::ScalarType::BFloat16) return false;
  return node.target() == Target{"aten", "mul", "Scalar"};
}

}  // namespace

std::optional<Overwrite> find_overwrite(const Node& node) {
  if (node.kind() != NodeKind::Call || node.target().is_builtin()) return std::nullopt;
  const std::optional<InplaceVariant> variant = find_inplace_variant(node);  // cached per target
  if (!variant || inplace_rounds_scalar(node)) return std::nullopt;
  const auto functional = find_op(node.target());
  if (!functional || !functional->hasTag(at::Tag::pointwise) || functional->schema().is_mutable()) return std::nullopt;
  const Node* input = overwritten_input(node, *variant);
  if (input == nullptr || input->kind() != NodeKind::Call) return std::nullopt;
  return Overwrite{input, variant->op};
}

void mark_out_kernel_unusable(const c10::OperatorName& out) {
  std::lock_guard<std::mutex> lock(unusable_mutex);
  unusable_out_kernels().insert(out);
}

std::optional<OutVariant> find_out_variant(const Node& node) {
  if (node.kind() != NodeKind::Call || node.target().is_builtin()) return std::nullopt;
  if (out_kernel_writes_scratch(node.target()) || out_kernel_ignores_out(node)) return std::nullopt;
  std::vector<const TensorMeta*> results;
  if (node.type().is_tensor()) results.push_back(&node.type().tensor);
  if (node.type().kind == Type::Kind::Tuple)
    for (const Type& e : node.type().elems) {
      if (!e.is_tensor()) return std::nullopt;
      results.push_back(&e.tensor);
    }
  if (results.empty()) return std::nullopt;
  auto functional = find_op(node.target());
  if (!functional) return std::nullopt;
  const auto& fa = functional->schema().arguments();
  const size_t k = results.size();
  const TensorMeta& m = *results[0];
  const c10::DispatchKey backend = c10::computeDispatchKey(m.dtype, c10::kStrided, m.device);
  for (const std::string& overload : overloads_of(node.target().ns + "::" + node.target().name)) {
    Target t = node.target();
    t.overload = overload.empty() ? "default" : overload;
    if (t == node.target()) continue;
    auto out = find_op(t);
    if (!out) continue;
    const auto& oa = out->schema().arguments();
    if (oa.size() != fa.size() + k || out->schema().returns().size() != k) continue;
    bool ok = true;
    // Names and types: pow.Tensor_Scalar's arguments are named like pow.Scalar_out's, typed otherwise.
    for (size_t i = 0; i < fa.size() && ok; ++i) ok = fa[i].name() == oa[i].name() && *fa[i].type() == *oa[i].type();
    OutVariant v{*out, {}};
    for (size_t i = fa.size(); i < oa.size() && ok; ++i) {
      const c10::Argument& o = oa[i];
      ok = o.kwarg_only() && o.alias_info() != nullptr && o.alias_info()->isWrite() &&
           o.type()->isSubtypeOf(*c10::TensorType::get());
      v.out_args.push_back(o.name());
    }
    if (!ok || !out->hasKernelForDispatchKey(backend) || marked_unusable(out->operator_name())) continue;
    return v;
  }
  return std::nullopt;
}

}  // namespace torch_ext::ir
