// batch_cone: see batch_cone.h. Refusals throw before anything is returned; the input graph is
// only read.
#include "passes/batch_cone.h"

#include "ir/args.h"
#include "passes/batch_layout.h"

#include "ir/schema.h"
#include "ir/type_check.h"

#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>
#include <map>
#include <tuple>
#include <set>
#include <unordered_map>
#include <unordered_set>

namespace torch_ext::passes {
namespace {

using ir::Arg;
using ir::Node;
using batch_layout::first_tensor;
using batch_layout::Layout;
using batch_layout::layout_text;
using batch_layout::LayoutMove;
using batch_layout::move_from_chunks;
using batch_layout::move_to_chunks;
using batch_layout::norm_dim;
using batch_layout::out_layout;
using batch_layout::whole_chunks;

// Ops applied element by element with broadcasting: every tensor argument may be stacked, and an
// external one lined up with the output's dim 0 is tiled.
const std::set<std::string>& elementwise_ops() {
  static const std::set<std::string> ops = {
      "abs",        "add",         "sub",        "mul",         "div",        "rsub",       "neg",
      "pow",        "exp",         "exp2",       "log",         "log1p",      "log2",       "expm1",
      "sqrt",       "rsqrt",       "reciprocal", "sin",         "cos",        "tan",        "tanh",
      "sigmoid",    "relu",        "relu6",      "gelu",        "silu",       "mish",       "elu",
      "selu",       "leaky_relu",  "hardtanh",   "hardswish",   "hardsigmoid", "softplus",  "erf",
      "erfc",       "where",       "maximum",    "minimum",     "clamp",      "clamp_min",  "clamp_max",
      "masked_fill", "eq",         "ne",         "lt",          "le",         "gt",         "ge",
      "logical_not", "logical_and", "logical_or", "logical_xor", "bitwise_not", "bitwise_and",
      "bitwise_or", "square",      "lerp",       "addcmul",     "addcdiv",    "_to_copy",   "clone",
      "contiguous", "alias",       "detach",     "type_as",     "zeros_like", "ones_like",  "full_like",
      "sign",       "floor",       "ceil",       "round",       "trunc",      "frac",       "nan_to_num",
      "atan",       "asin",        "acos",       "sinh",        "cosh",       "asinh",      "atanh",
      "logit",      "fmod",        "remainder",  "floor_divide", "atan2",     "hypot",      "copysign",
      "xlogy",      "to",          "sgn",         "isnan",      "isinf",       "isfinite",   "dropout",    "lift_fresh_copy"};
  return ops;
}

// Ops that read dim 0 of argument `row` as independent rows (a batch) and every other tensor
// argument whole (weights, biases, tables); `min_rank` keeps dim 0 a batch dim (a rank-1 input of
// linear is a feature vector, whose dim 0 is contracted).
struct RowOp {
  size_t row;
  int64_t min_rank;
};
const std::unordered_map<std::string, RowOp>& row_ops() {
  static const std::unordered_map<std::string, RowOp> ops = {
      {"linear", {0, 2}},
      {"mm", {0, 2}},
      {"addmm", {1, 2}},
      {"embedding", {1, 1}},
      {"layer_norm", {0, 1}},
      {"native_layer_norm", {0, 1}},
      {"rms_norm", {0, 1}},
      {"_native_batch_norm_legit_no_training", {0, 2}},
      {"batch_norm", {0, 2}},  // eval mode only (checked in plan_node): running statistics, per element
      {"conv1d", {0, 3}},
      {"conv2d", {0, 4}},
      {"conv3d", {0, 5}},
      {"convolution", {0, 3}},
      {"max_pool1d", {0, 3}},
      {"max_pool2d", {0, 4}},
      {"avg_pool1d", {0, 3}},
      {"avg_pool2d", {0, 4}},
      {"adaptive_avg_pool1d", {0, 3}},
      {"adaptive_avg_pool2d", {0, 4}},
      {"_adaptive_avg_pool2d", {0, 4}},
      {"constant_pad_nd", {0, 1}},
      {"pad", {0, 1}},  // every mode pads only the trailing dims its list names (F.pad, causal convolutions)
      {"softmax", {0, 1}},
      {"_softmax", {0, 1}},
      {"log_softmax", {0, 1}},
      {"_log_softmax", {0, 1}},
      {"transpose", {0, 1}},
      {"permute", {0, 1}},
      {"select", {0, 1}},
      {"unsqueeze", {0, 1}},
      {"squeeze", {0, 1}},
      {"split", {0, 1}},
      {"split_with_sizes", {0, 1}},
      {"unsafe_split", {0, 1}},
      {"chunk", {0, 1}},
      {"unbind", {0, 1}},
      {"sum", {0, 1}},
      {"mean", {0, 1}},
      {"amax", {0, 1}},
      {"amin", {0, 1}},
      {"prod", {0, 1}},
      {"var", {0, 1}},
      {"std", {0, 1}},
      {"logsumexp", {0, 1}},
      {"argmax", {0, 1}},
      {"argmin", {0, 1}},
      {"cumsum", {0, 1}},
      {"cumprod", {0, 1}},
      {"flip", {0, 1}},
      {"roll", {0, 1}},
      {"narrow", {0, 1}},
      {"index_select", {0, 1}},
      {"slice", {0, 1}},
      {"flatten", {0, 1}},
      {"view", {0, 1}},
      {"reshape", {0, 1}},
      {"_unsafe_view", {0, 1}},
      {"unflatten", {0, 1}},
      {"expand", {0, 1}},
      {"t", {0, 1}},
      {"tril", {0, 3}},
      {"triu", {0, 3}},
  };
  return ops;
}

// Ops whose every tensor argument may be stacked (batched products, attention, concatenation);
// stacked arguments need `min_rank` so that dim 0 is a batch dim, not a contracted one.
const std::unordered_map<std::string, int64_t>& batched_ops() {
  static const std::unordered_map<std::string, int64_t> ops = {
      {"bmm", 3},
      {"matmul", 3},
      {"scaled_dot_product_attention", 3},
      {"_scaled_dot_product_flash_attention_for_cpu", 3},
      {"cat", 1},
      {"stack", 1},
  };
  return ops;
}

using ir::arg_at;

int64_t rank_of(const ir::Type& t) {
  if (t.is_tensor()) return static_cast<int64_t>(t.tensor.sizes.size());
  if (t.kind == ir::Type::Kind::Tuple && !t.elems.empty() && t.elems[0].is_tensor())
    return static_cast<int64_t>(t.elems[0].tensor.sizes.size());
  return -1;
}

std::string where_of(const Node& n) { return "%" + n.name() + " (" + n.target().str() + ")"; }

// The dims an op works along, which must not include dim 0 of its stacked input (rank `rank`,
// output rank `out_rank`); empty when the op names no dim. Throws for ops that reduce everything
// or whose dims cannot be read.
std::vector<int64_t> worked_dims(const Node& n, const std::string& op, int64_t rank, int64_t out_rank) {
  const std::string w = where_of(n);
  const auto need = [&](std::optional<std::vector<int64_t>> v, const char* what) {
    TORCH_CHECK(v.has_value() && !v->empty(), "batch_cone: ", w, " ", what,
                ", which mixes the stacked sites");
    std::vector<int64_t> out;
    for (int64_t d : *v) out.push_back(norm_dim(d, rank));
    return out;
  };
  if (op == "softmax" || op == "_softmax" || op == "log_softmax" || op == "_log_softmax" || op == "select" ||
      op == "squeeze" || op == "cumsum" || op == "cumprod" || op == "narrow" || op == "index_select") {
    if (op == "squeeze" && n.target().overload == "default")
      return need(std::nullopt, "squeezes every size-1 dim (dim 0 among them when the batch is 1)");
    return need(ir::ints_arg_or(n, 1, "dim", std::nullopt), "works along no explicit dim");
  }
  if (op == "sum" || op == "mean" || op == "amax" || op == "amin" || op == "prod" || op == "var" || op == "std" ||
      op == "logsumexp" || op == "argmax" || op == "argmin") {
    const Arg* a = arg_at(n, 1, "dim");
    if (a != nullptr && a->kind == Arg::Kind::List && a->list.empty()) a = nullptr;
    return need(a == nullptr ? std::nullopt : ir::ints_arg_or(n, 1, "dim", std::nullopt), "reduces over every dim");
  }
  // transpose / t / permute / unsqueeze / flatten / stack / views move the stacked dim (out_layout).
  if (op == "split" || op == "split_with_sizes" || op == "unsafe_split" || op == "chunk")
    return need(ir::ints_arg_or(n, 2, "dim", std::vector<int64_t>{0}), "splits no dim");
  if (op == "unbind") return need(ir::ints_arg_or(n, 1, "dim", std::vector<int64_t>{0}), "unbinds no dim");
  if (op == "flip") return need(ir::ints_arg_or(n, 1, "dims", std::nullopt), "flips no dim");
  if (op == "roll") return need(ir::ints_arg_or(n, 2, "dims", std::nullopt), "rolls the flattened tensor");
  if (op == "cat") return need(ir::ints_arg_or(n, 1, "dim", std::vector<int64_t>{0}), "has no dim");
  if (op == "layer_norm" || op == "native_layer_norm" || op == "rms_norm") {
    auto s = ir::ints_arg_or(n, 1, "normalized_shape", std::nullopt);
    TORCH_CHECK(s.has_value(), "batch_cone: ", w, " has no normalized_shape");
    std::vector<int64_t> out;
    for (int64_t d = rank - static_cast<int64_t>(s->size()); d < rank; ++d) out.push_back(d);
    return out;
  }
  if (op == "constant_pad_nd" || op == "pad") {
    auto p = ir::ints_arg_or(n, 1, "pad", std::nullopt);
    TORCH_CHECK(p.has_value(), "batch_cone: ", w, " has no pad");
    std::vector<int64_t> out;
    for (int64_t d = rank - static_cast<int64_t>(p->size() / 2); d < rank; ++d) out.push_back(d);
    return out;
  }
  return {};
}

using ir::meta_tensor;

const Arg* kwarg_of(const ir::Kwargs& kwargs, const std::string& name) {
  for (const auto& [key, a] : kwargs)
    if (key == name) return &a;
  return nullptr;
}

// The type a call of `target` on these (new graph) arguments produces, run on meta tensors; `cpu`: its first
// result laid out as the CPU kernel lays it out where that differs from the meta kernel's (ir::cpu_layout_op: eval
// batch norm's output follows the input's suggested memory format, layer norm's is contiguous).
ir::Type infer_type(const ir::Target& target, const std::vector<Arg>& args, const ir::Kwargs& kwargs,
                    const std::string& w, bool cpu = false) {
  auto op = ir::find_op(target);
  TORCH_CHECK(op.has_value(), "batch_cone: ", w, " is not a registered operator");
  const c10::FunctionSchema& schema = op->schema();
  std::vector<c10::IValue> stack;
  for (size_t i = 0; i < schema.arguments().size(); ++i) {
    const c10::Argument& formal = schema.arguments()[i];
    const Arg* a = i < args.size() ? &args[i] : kwarg_of(kwargs, formal.name());
    if (a == nullptr) {
      TORCH_CHECK(formal.default_value().has_value(), "batch_cone: ", w, " misses argument ", formal.name());
      stack.push_back(*formal.default_value());
      continue;
    }
    if (a->kind == Arg::Kind::Node) {
      TORCH_CHECK(a->node->type().is_tensor(), "batch_cone: ", w, " reads a non-tensor value %", a->node->name());
      stack.emplace_back(meta_tensor(a->node->type().tensor));
      continue;
    }
    bool has_node = false;
    a->for_each_node([&](Node*) { has_node = true; });
    if (!has_node) {
      stack.push_back(ir::constant_to_ivalue(*a, formal, "batch_cone: " + w + ": "));
      continue;
    }
    // A list holding tensors (cat, stack): optional elements are not expected here.
    c10::List<at::Tensor> l;
    for (const Arg& e : a->list) {
      TORCH_CHECK(e.kind == Arg::Kind::Node && e.node->type().is_tensor(), "batch_cone: ", w,
                  " has a tensor list with a non-tensor element");
      l.push_back(meta_tensor(e.node->type().tensor));
    }
    stack.emplace_back(l);
  }
  const ir::CpuLayoutOp* cpu_layout = cpu ? ir::cpu_layout_op(target) : nullptr;
  const std::vector<c10::IValue> layout_args = cpu_layout ? stack : std::vector<c10::IValue>();
  {
    at::AutoDispatchBelowAutograd no_autograd;
    c10::impl::ExcludeDispatchKeyGuard no_python(
        c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot}));
    try {
      op->callBoxed(stack);
    } catch (const std::exception& e) {
      const auto* c10e = dynamic_cast<const c10::Error*>(&e);
      TORCH_CHECK(false, "batch_cone: ", w, " refuses its stacked inputs: ",
                  c10e ? c10e->msg() : std::string(e.what()));
    }
  }
  const auto to_type = [&](const c10::IValue& v) {
    TORCH_CHECK(v.isTensor() && v.toTensor().defined(), "batch_cone: ", w, " returns a non-tensor value");
    const at::Tensor& t = v.toTensor();
    ir::TensorMeta m;
    m.dtype = t.scalar_type();
    m.sizes = t.sizes().vec();
    m.strides = t.strides().vec();
    return ir::Type::make_tensor(std::move(m));
  };
  const size_t returns = schema.returns().size();
  TORCH_CHECK(returns >= 1, "batch_cone: ", w, " returns nothing");
  ir::Type type;
  if (returns == 1 && !stack.at(0).isTensorList()) {
    type = to_type(stack.at(0));
  } else {
    std::vector<ir::Type> elems;
    if (returns == 1) {
      for (const c10::IValue& e : stack.at(0).toListRef()) elems.push_back(to_type(e));
    } else {
      for (size_t r = 0; r < returns; ++r) elems.push_back(to_type(stack.at(r)));
    }
    type = ir::Type::make_tuple(std::move(elems));
  }
  ir::Type* first = type.kind == ir::Type::Kind::Tuple ? (type.elems.empty() ? nullptr : &type.elems[0]) : &type;
  if (cpu_layout && first && first->is_tensor())
    if (auto strides = ir::cpu_result_strides(*cpu_layout, layout_args, first->tensor.sizes))
      first->tensor.strides = std::move(*strides);
  return type;
}

// `t` with dim 0 of every tensor times k (sizes only: strides are compared separately).
bool scaled_equal(const ir::Type& small, const ir::Type& got, int64_t k, int64_t dim = 0) {
  if (small.kind != got.kind) return false;
  if (small.is_tensor()) {
    const auto& s = small.tensor.sizes;
    const auto& g = got.tensor.sizes;
    if (static_cast<int64_t>(s.size()) <= dim || s.size() != g.size() || small.tensor.dtype != got.tensor.dtype) return false;
    for (size_t d = 0; d < s.size(); ++d)
      if (g[d] != (static_cast<int64_t>(d) == dim ? s[d] * k : s[d])) return false;
    return true;
  }
  if (small.kind != ir::Type::Kind::Tuple || small.elems.size() != got.elems.size()) return false;
  for (size_t i = 0; i < small.elems.size(); ++i)
    if (!scaled_equal(small.elems[i], got.elems[i], k, dim)) return false;
  return true;
}

void set_devices(ir::Type& t, const ir::Type& from) {
  if (t.is_tensor() && from.is_tensor()) t.tensor.device = from.tensor.device;
  if (t.kind == ir::Type::Kind::Tuple && from.kind == ir::Type::Kind::Tuple)
    for (size_t i = 0; i < t.elems.size() && i < from.elems.size(); ++i) set_devices(t.elems[i], from.elems[i]);
}

std::string sizes_text(const ir::Type& t) {
  if (t.is_tensor()) {
    std::string s = "[";
    for (size_t i = 0; i < t.tensor.sizes.size(); ++i) s += (i ? "," : "") + std::to_string(t.tensor.sizes[i]);
    return s + "]";
  }
  std::string s = "(";
  for (size_t i = 0; i < t.elems.size(); ++i) s += (i ? ", " : "") + sizes_text(t.elems[i]);
  return s + ")";
}

// Dense strides for `sizes` that order the dims as `like`'s strides do (outermost first).
std::vector<int64_t> dense_strides_like(const ir::TensorMeta& like, const std::vector<int64_t>& sizes) {
  std::vector<int64_t> order(sizes.size());
  for (size_t d = 0; d < order.size(); ++d) order[d] = static_cast<int64_t>(d);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return like.strides[a] > like.strides[b]; });
  std::vector<int64_t> strides(sizes.size());
  int64_t step = 1;
  for (size_t i = order.size(); i-- > 0;) {
    strides[order[i]] = step;
    step *= std::max<int64_t>(sizes[order[i]], 1);
  }
  return strides;
}

// An op with only a CompositeImplicitAutograd kernel (scaled_dot_product_attention) gets its layout
// on meta from whichever decomposition meta picks, not from the kernel that runs: CPU attention
// returns [B, T, H, D]-ordered results where meta returns them contiguous, and a view after a
// transpose (T5's attention output) then refused the stacked sites. A stacked result whose
// unstacked node had a dense permuted layout keeps that permutation.
void keep_layout_of(ir::Type& stacked, const ir::Type& alone) {
  if (stacked.kind == ir::Type::Kind::Tuple && alone.kind == ir::Type::Kind::Tuple) {
    for (size_t i = 0; i < stacked.elems.size() && i < alone.elems.size(); ++i) keep_layout_of(stacked.elems[i], alone.elems[i]);
    return;
  }
  if (!stacked.is_tensor() || !alone.is_tensor()) return;
  const ir::TensorMeta& a = alone.tensor;
  ir::TensorMeta& s = stacked.tensor;
  if (a.sizes.size() != s.sizes.size() || a.strides.size() != a.sizes.size()) return;
  if (dense_strides_like(a, a.sizes) != a.strides) return;  // not a dense layout: leave meta's
  s.strides = dense_strides_like(a, s.sizes);
}

bool layout_from_decomposition(const ir::Target& target) {
  auto op = ir::find_op(target);
  return op.has_value() && !op->hasKernelForDispatchKey(c10::DispatchKey::Meta) &&
         op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd);
}

ir::Type stacked_type(const ir::Type& t, int64_t k, int64_t dim = 0) {
  ir::Type out = t;
  out.tensor.sizes[dim] *= k;
  out.tensor.strides = ir::TensorMeta::contiguous_strides(out.tensor.sizes);
  return out;
}

// One entry of the unit: its node, its copies, and where they sit in the site placeholder.
struct Entry {
  const Node* node;
  int64_t k;
  int64_t lo;  // copies before this entry's (k_1 + ... + k_{j-1})
};

class Builder {
 public:
  Builder(const ir::Graph& g, std::vector<Entry> entries, int64_t site_dim)
      : g_(g), entries_(std::move(entries)), out_(std::make_unique<ir::Graph>()), site_dim_(site_dim) {
    total_ = entries_.back().lo + entries_.back().k;
  }

  BatchCone run(const std::vector<const Node*>& cone) {
    // Copies per cone node: those of the last entry whose cone reaches it (a prefix of the entries).
    const Node* site = entries_.front().node;
    for (size_t j = 1; j < entries_.size(); ++j) entry_of_[entries_[j].node] = j;
    live_after_[site] = 1;
    for (const Node* n : cone) {
      size_t m = 0;
      for (const Node* in : n->inputs()) {
        auto it = live_after_.find(in);
        if (it != live_after_.end()) m = std::max(m, it->second);
      }
      TORCH_INTERNAL_ASSERT(m >= 1, "batch_cone: %", n->name(), " is in no entry's cone");
      copies_of_[n] = copies(m);
      auto e = entry_of_.find(n);
      live_after_[n] = e == entry_of_.end() ? m : e->second + 1;
    }
    // Externals first (their placeholders precede the site), then the calls.
    lay_[site] = whole_chunks(site->type(), site_dim_);
    for (const Node* n : cone) plan_node(*n);
    site_ = out_->create_placeholder(site->name(), ir::InputRole::UserInput, stacked_type(site->type(), total_));
    count_[site_] = total_;
    nlay_[site_] = whole_chunks(site->type(), 0);
    Node* first = entries_.size() == 1 ? site_ : entry_copies(0);
    nlay_[first] = whole_chunks(site->type(), 0);
    map_[site] = to_layout(first, *site, lay_.at(site), entries_.front().k);
    for (const Node* n : cone) {
      emit(*n);
      auto e = entry_of_.find(n);
      if (e != entry_of_.end()) join(*n, e->second);
    }
    std::vector<Arg> outs;
    BatchCone result;
    for (const Arg& a : g_.output()->args().at(0).list) {
      if (a.kind != Arg::Kind::Node) {
        outs.push_back(a);
        result.output_batched.push_back(false);
        continue;
      }
      const bool inside = map_.count(a.node) > 0;
      outs.push_back(Arg::of_node(inside ? to_chunks(read_stacked(a.node, total_), *a.node, total_) : external(a.node, 0)));
      result.output_batched.push_back(inside);
    }
    out_->create_output(std::move(outs));
    // Placeholders were created in first-read order; the site goes last.
    std::vector<Node*> order;
    for (Node* p : out_->placeholders())
      if (p != site_) order.push_back(p);
    order.push_back(site_);
    out_->reorder_placeholders(order);
    for (Node* p : order) {
      if (p == site_) continue;
      const auto& [src, n] = sources_.at(p);
      result.externals.push_back({p->name(), src->name(), n > 0, n});
    }
    for (const auto& n : out_->nodes()) result.num_calls += n->kind() == ir::NodeKind::Call ? 1 : 0;
    out_->index();
    result.graph = std::move(out_);
    return result;
  }

  void mark_cone(const std::vector<const Node*>& cone) {
    in_cone_.insert(entries_.front().node);
    for (const Node* n : cone) in_cone_.insert(n);
  }

 private:
  int64_t copies(size_t entries) const { return entries_[entries - 1].lo + entries_[entries - 1].k; }
  bool stacked(const Node* n) const { return map_.count(n) > 0; }

  // Decides, before any call is emitted, which externals each cone call reads tiled (and how many
  // times: the call's copies), and creates their placeholders (first-read order keeps the graph
  // deterministic).
  void plan_node(const Node& n) {
    const std::string w = where_of(n);
    TORCH_CHECK(n.regions().empty(), "batch_cone: ", w, " has regions (control flow), which the pass does not batch");
    if (n.target().is_getitem()) {
      const Layout l = lay_.at(n.args().at(0).node);
      TORCH_CHECK(rank_of(n.type()) > l.b, "batch_cone: ", w, " reads an element without the stacked dim ", l.b);
      lay_[&n] = l;
      return;
    }
    const std::string& op = n.target().name;
    TORCH_CHECK(n.target().ns == "aten", "batch_cone: ", w, " is not an aten op the pass knows keeps dim 0 apart");
    TORCH_CHECK(op != "_native_batch_norm_legit_functional" && op != "_native_batch_norm_legit" &&
                    op != "native_batch_norm",
                "batch_cone: ", w, " normalises with batch statistics (training mode), which mixes dim 0 (the "
                "stacked sites); call model.eval() on a model with running statistics");
    const bool elementwise = elementwise_ops().count(op) > 0;
    const auto row = row_ops().find(op);
    const auto batched = batched_ops().find(op);
    TORCH_CHECK(elementwise || row != row_ops().end() || batched != batched_ops().end(), "batch_cone: ", w,
                " is not an op the pass can prove keeps the stacked sites apart along dim 0");
    if (op == "dropout") {
      const Arg* train = arg_at(n, 2, "train");
      TORCH_CHECK(train != nullptr && train->kind == Arg::Kind::Bool && train->i == 0, "batch_cone: ", w,
                  " draws random numbers (training-mode dropout)");
    }
    if (op == "batch_norm") {
      // Training mode normalises with statistics over dim 0: the stacked sites would mix.
      const Arg* training = arg_at(n, 5, "training");
      TORCH_CHECK(training != nullptr && training->kind == Arg::Kind::Bool && training->i == 0, "batch_cone: ", w,
                  " normalises with batch statistics (training mode, or track_running_stats=False), which mixes "
                  "dim 0 (the stacked sites); call model.eval() on a model with running statistics");
    }
    const int64_t out_rank = rank_of(n.type());
    const size_t nargs = n.args().size() + n.kwargs().size();
    const auto arg_i = [&](size_t i) -> const Arg& {
      return i < n.args().size() ? n.args()[i] : n.kwargs()[i - n.args().size()].second;
    };
    // The stacked inputs: all with their copies in the same place.
    std::optional<Layout> lin;
    const Node* first_in = nullptr;
    for (size_t i = 0; i < nargs; ++i)
      arg_i(i).for_each_node([&](Node* in) {
        if (!in_cone_.count(in)) return;
        const Layout& l = lay_.at(in);
        if (!lin) {
          lin = l;
          first_in = in;
          return;
        }
        TORCH_CHECK(l == *lin, "batch_cone: ", w, " reads %", first_in->name(), " with its stacked sites on ",
                    layout_text(*lin, first_in->type()), " and %", in->name(), " with them on ", layout_text(l, in->type()),
                    ", which do not line up");
      });
    TORCH_INTERNAL_ASSERT(lin.has_value(), "batch_cone: ", w, " reads nothing of the cone");
    const int64_t b = lin->b;
    const int64_t rs = rank_of(first_in->type());
    const Arg* w1 = arg_at(n, 1, "other");
    const bool by_matrix = op == "matmul" && w1 != nullptr && w1->kind == Arg::Kind::Node && !in_cone_.count(w1->node) &&
                           rank_of(w1->node->type()) <= 2;
    for (size_t i = 0; i < nargs; ++i) {
      arg_i(i).for_each_node([&](Node* in) {
        if (!in_cone_.count(in)) {
          if (!in->type().is_tensor()) {
            external(in, 0);
            return;
          }
          // Lined up with the stacked dim (right-aligned broadcasting): read tiled along its own dim e.
          const int64_t re = rank_of(in->type());
          const int64_t e = b - (rs - re);
          bool lined_up = (elementwise || batched != batched_ops().end()) && out_rank >= 1 && e >= 0 && e < re &&
                          in->type().tensor.sizes[e] > 1;
          if (lined_up && (op == "matmul" || op == "bmm" || op == "scaled_dot_product_attention" ||
                           op == "_scaled_dot_product_flash_attention_for_cpu"))
            lined_up = e < re - 2;  // its matrix dims are contracted or read whole, not lined up
          if (lined_up)
            TORCH_CHECK(in->type().tensor.sizes[e] == first_tensor(first_in->type())->sizes[b], "batch_cone: ", w,
                        " broadcasts %", first_in->name(), " (of the patched cone) along dim ", b,
                        ", where the stacked sites are");
          const int64_t times = lined_up ? copies_of_.at(&n) : 0;
          external(in, times);
          planned_[{&n, in}] = times;
          if (lined_up) tile_lay_[{&n, in}] = Layout{e, lin->in};
          return;
        }
        const int64_t r = rank_of(in->type());
        if (row != row_ops().end()) {
          TORCH_CHECK(i == row->second.row, "batch_cone: ", w, " reads %", in->name(), " (of the patched cone) as argument ",
                      i, ", which it does not treat as a batch of rows: it mixes dim ", b, " (the stacked sites)");
          TORCH_CHECK(r >= row->second.min_rank, "batch_cone: ", w, " reads %", in->name(), " of rank ", r,
                      " (needs rank >= ", row->second.min_rank, " for dim 0 to be a batch dim)");
        } else if (batched != batched_ops().end()) {
          // x @ W with a constant matrix W: a row-wise product, the rows of x are a batch too.
          const bool x_by_matrix = by_matrix && i == 0;
          TORCH_CHECK(r >= (x_by_matrix ? 2 : batched->second), "batch_cone: ", w, " reads %", in->name(), " of rank ", r,
                      " (needs rank >= ", (x_by_matrix ? 2 : batched->second), " for its stacked dim to be a batch dim)");
          if (op == "matmul" || op == "bmm" || op == "cat")
            TORCH_CHECK(r == out_rank, "batch_cone: ", w, " broadcasts %", in->name(),
                        " so that its dims are not the output's dims");
        } else {
          TORCH_CHECK(r == out_rank, "batch_cone: ", w, " broadcasts %", in->name(), " (rank ", r,
                      ") against rank ", out_rank, ", so its dims are not the output's dims");
        }
      });
    }
    const auto* in0 = n.args().empty() ? nullptr : &n.args()[0];
    int64_t rank = out_rank;
    if (in0 != nullptr && in0->kind == Arg::Kind::Node) rank = rank_of(in0->node->type());
    if (in0 != nullptr && in0->kind == Arg::Kind::List && !in0->list.empty() && in0->list[0].kind == Arg::Kind::Node)
      rank = rank_of(in0->list[0].node->type());
    for (int64_t d : worked_dims(n, op, rank, out_rank))
      TORCH_CHECK(d != b, "batch_cone: ", w, " works along dim ", b, ", where the stacked sites are, which mixes them");
    unsigned stacked_args = 0;
    for (size_t i = 0; i < 2 && i < n.args().size(); ++i)
      if (n.args()[i].kind == Arg::Kind::Node && in_cone_.count(n.args()[i].node)) stacked_args |= 1u << i;
    lay_[&n] = out_layout(n, op, *lin, first_tensor(first_in->type())->sizes, out_rank,
                          by_matrix && in_cone_.count(n.args()[0].node), stacked_args, w,
                          [this](const std::vector<Layout>& options) { return choose(options); });
  }

  // One of several equally valid layouts: picks_[i] for the i-th such choice of this build (0 past its end);
  // choices_ records how many there were.
  Layout choose(const std::vector<Layout>& options) {
    const size_t i = choices_.size();
    choices_.push_back(options.size());
    const size_t pick = i < picks_.size() ? picks_[i] : 0;
    return options.at(std::min(pick, options.size() - 1));
  }

 public:
  std::vector<size_t> picks_;    // set by batch_cone before run()
  std::vector<size_t> choices_;  // filled by run(), even when it throws

 private:
  // A name free in both graphs (cone calls keep their names).
  std::string fresh(const std::string& base, const Node* src = nullptr) const {
    std::string name = base;
    for (int i = 1; g_.find(name) != nullptr && (src == nullptr || name != src->name()); ++i)
      name = base + "_" + std::to_string(i);
    return out_->unique_name(name);
  }

  // `src`'s clean value as a placeholder: read as it is (times 0) or repeated `times` along dim 0.
  Node* external(const Node* src, int64_t times) {
    auto key = std::make_pair(src, times);
    auto it = externals_.find(key);
    if (it != externals_.end()) return it->second;
    std::string base = src->name();
    if (times > 0) base += times == total_ ? "_tiled" : "_tiled" + std::to_string(times);
    ir::InputRole role = ir::InputRole::Constant;
    std::string state;
    if (src->kind() == ir::NodeKind::Placeholder && times == 0) {
      role = src->role() == ir::InputRole::UserInput ? ir::InputRole::Constant : src->role();
      state = src->state_name();
    }
    ir::Type t = times > 0 ? stacked_type(src->type(), times) : src->type();
    Node* p = out_->create_placeholder(fresh(base, src), role, std::move(t), state);
    externals_[key] = p;
    sources_[p] = {src, times};
    return p;
  }

  // A plumbing call (slice, cat): its type from the meta kernel, checked against the expected copies.
  Node* plumb(const std::string& name, const char* target, std::vector<Arg> args, const Node& like, int64_t c,
              int64_t dim = 0) {
    const ir::Target t = ir::Target::parse(target);
    ir::Type type = infer_type(t, args, {}, "%" + name + " (" + target + ")");
    TORCH_INTERNAL_ASSERT(dim < 0 || scaled_equal(like.type(), type, c, dim), "batch_cone: %", name, " has the wrong type");
    set_devices(type, like.type());
    Node* n = out_->create_call(fresh(name), t, std::move(args), {}, std::move(type));
    n->set_module_path(like.module_path());
    count_[n] = c;
    return n;
  }

  // Entry j's copies: rows [lo_j, lo_j + k_j) of the site placeholder, in units of the site's dim 0.
  Node* entry_copies(size_t j) {
    const Entry& e = entries_[j];
    const int64_t rows = entries_.front().node->type().tensor.sizes[0];
    return plumb(e.node->name() + "_copies", "aten::slice.Tensor",
                 {Arg::of_node(site_), Arg::of_int(0), Arg::of_int(e.lo * rows), Arg::of_int((e.lo + e.k) * rows),
                  Arg::of_int(1)},
                 *e.node, e.k);
  }

  static Arg int_list(const std::vector<int64_t>& v) {
    std::vector<Arg> l;
    for (int64_t x : v) l.push_back(Arg::of_int(x));
    return Arg::of_list(std::move(l));
  }

  // `v` (c copies of `like`'s value as whole chunks of dim 0) with its copies placed as `to` says.
  Node* to_layout(Node* v, const Node& like, Layout to, int64_t c) {
    if (to == whole_chunks(like.type(), 0)) return v;
    const LayoutMove mv = move_from_chunks(first_tensor(like.type())->sizes, to, c);
    Node* out = move(v, like, mv, like.name() + "_dim" + std::to_string(to.b), c, to.b);
    nlay_[out] = to;
    return out;
  }

  // The inverse: `v` (layout nlay_[v]) with its copies as whole chunks of dim 0.
  Node* to_chunks(Node* v, const Node& like, int64_t c) {
    const Layout from = nlay_.at(v);
    if (from == whole_chunks(like.type(), 0)) return v;
    const LayoutMove mv = move_to_chunks(first_tensor(like.type())->sizes, from, c);
    Node* out = move(v, like, mv, like.name() + "_chunks", c, 0);
    nlay_[out] = whole_chunks(like.type(), 0);
    return out;
  }

  // The reshape / permute / reshape of `mv` on `v`, its calls named after `base`; the result holds its
  // copies along dim `dim`.
  Node* move(Node* v, const Node& like, const LayoutMove& mv, const std::string& base, int64_t c, int64_t dim) {
    Node* a = plumb(base + "_split", "aten::reshape.default", {Arg::of_node(v), int_list(mv.split)}, like, c, -1);
    Node* m = plumb(base + "_moved", "aten::permute.default", {Arg::of_node(a), int_list(mv.perm)}, like, c, -1);
    return plumb(base, "aten::reshape.default", {Arg::of_node(m), int_list(mv.sizes_after)}, like, c, dim);
  }

  // `src`'s clean value repeated `times` times, its copies placed as `to` says.
  Node* tiled(const Node* src, int64_t times, Layout to) {
    auto key = std::make_tuple(src, times, to.b, to.in);
    auto it = tiles_.find(key);
    if (it != tiles_.end()) return it->second;
    Node* t = external(src, times);
    nlay_[t] = whole_chunks(src->type(), 0);
    return tiles_[key] = to_layout(t, *src, to, times);
  }

  bool whole(Node* v) const {
    const Layout l = nlay_.at(v);
    return first_tensor(v->type())->sizes.at(l.b) == l.in * count_.at(v);
  }

  // After entry j's node ran on the copies so far: those copies, then entry j's own.
  void join(const Node& n, size_t j) {
    Node* so_far = map_.at(&n);
    TORCH_INTERNAL_ASSERT(count_.at(so_far) == entries_[j].lo, "batch_cone: entry %", n.name(), " runs on ",
                          count_.at(so_far), " copies, expected ", entries_[j].lo);
    const Layout l = nlay_.at(so_far);
    TORCH_CHECK(whole(so_far), "batch_cone: entry %", n.name(), " has the stacked sites on ", layout_text(l, n.type()),
                ", where the entry's copies cannot be joined to them");
    Node* own = to_layout(entry_copies(j), n, l, entries_[j].k);
    map_[&n] = plumb(n.name() + "_joined", "aten::cat.default",
                     {Arg::of_list({Arg::of_node(so_far), Arg::of_node(own)}), Arg::of_int(l.b)}, n,
                     entries_[j].lo + entries_[j].k, l.b);
    nlay_[map_[&n]] = l;
  }

  // The stacked value of cone node `x` with `c` copies: padded with its clean value where it has fewer
  // (the copies entering downstream of x see x unpatched).
  Node* read_stacked(const Node* x, int64_t c) {
    Node* v = map_.at(x);
    const int64_t have = count_.at(v);
    if (have == c) return v;
    TORCH_INTERNAL_ASSERT(have < c, "batch_cone: %", x->name(), " has ", have, " copies, more than ", c);
    auto key = std::make_pair(x, c);
    auto it = pads_.find(key);
    if (it != pads_.end()) return it->second;
    const Layout l = nlay_.at(v);
    TORCH_CHECK(whole(v), "batch_cone: %", x->name(), " has the stacked sites on ", layout_text(l, x->type()),
                ", where copies entering below it cannot be added");
    Node* clean = tiled(x, c - have, l);
    Node* p = plumb(x->name() + "_pad" + std::to_string(c), "aten::cat.default",
                    {Arg::of_list({Arg::of_node(v), Arg::of_node(clean)}), Arg::of_int(l.b)}, *x, c, l.b);
    nlay_[p] = l;
    return pads_[key] = p;
  }

  void emit(const Node& n) {
    const std::string w = where_of(n);
    const int64_t c = copies_of_.at(&n);
    std::vector<Arg> args;
    ir::Kwargs kwargs;
    const auto remap = [&](const Arg& a, auto&& self) -> Arg {
      if (a.kind == Arg::Kind::Node) {
        if (stacked(a.node)) return Arg::of_node(read_stacked(a.node, c));
        auto p = planned_.find({&n, a.node});
        if (p != planned_.end() && p->second > 0) return Arg::of_node(tiled(a.node, p->second, tile_lay_.at({&n, a.node})));
        return Arg::of_node(external(a.node, 0));
      }
      if (a.kind != Arg::Kind::List) return a;
      Arg out = a;
      for (Arg& e : out.list) e = self(e, self);
      return out;
    };
    for (const Arg& a : n.args()) args.push_back(remap(a, remap));
    for (const auto& [key, a] : n.kwargs()) kwargs.emplace_back(key, remap(a, remap));
    const std::string& op = n.target().name;
    const Layout lout = lay_.at(&n);
    ir::Target target = n.target();
    if (op == "view" || op == "reshape" || op == "_unsafe_view" || op == "expand") {
      TORCH_CHECK(args.size() >= 2, "batch_cone: ", w, " has no size list");
      std::vector<int64_t> sizes = first_tensor(n.type())->sizes;
      sizes.at(lout.b) *= c;
      args[1] = int_list(sizes);
    }
    if (op == "unflatten") {
      const int64_t rank = rank_of(n.args().at(0).node->type());
      const int64_t dim = norm_dim(ir::ints_arg_or(n, 1, "dim", std::nullopt).value().at(0), rank);
      TORCH_CHECK(args.size() >= 3, "batch_cone: ", w, " has no size list");
      const std::vector<int64_t>& out = first_tensor(n.type())->sizes;
      const int64_t parts = static_cast<int64_t>(out.size()) - rank + 1;
      std::vector<int64_t> sizes(out.begin() + dim, out.begin() + dim + parts);
      if (lout.b >= dim && lout.b < dim + parts) sizes[lout.b - dim] *= c;
      args[2] = int_list(sizes);
    }
    if (op == "slice") {
      const auto dim = ir::ints_arg_or(n, 1, "dim", std::vector<int64_t>{0});
      const int64_t rank = rank_of(n.args().at(0).node->type());
      const int64_t b_in = lay_.at(n.args().at(0).node).b;
      if (dim && dim->size() == 1 && norm_dim((*dim)[0], rank) == b_in) {
        // Only the identity slice of dim 0 keeps the sites: its end is rewritten to "all of it".
        const auto start = ir::ints_arg_or(n, 2, "start", std::vector<int64_t>{0});
        const auto end = ir::ints_arg_or(n, 3, "end", std::vector<int64_t>{std::numeric_limits<int64_t>::max()});
        const auto step = ir::ints_arg_or(n, 4, "step", std::vector<int64_t>{1});
        const int64_t size0 = n.args().at(0).node->type().tensor.sizes.at(b_in);
        TORCH_CHECK(start && end && step && (*start)[0] == 0 && (*step)[0] == 1 && (*end)[0] >= size0,
                    "batch_cone: ", w, " slices dim ", b_in, ", where the stacked sites are, which mixes them");
        while (args.size() < 4) args.push_back(args.size() == 2 ? Arg::of_int(0) : Arg::none());
        args[3] = Arg::of_int(std::numeric_limits<int64_t>::max());
        kwargs.erase(std::remove_if(kwargs.begin(), kwargs.end(), [](const auto& kv) { return kv.first == "end" || kv.first == "start"; }),
                     kwargs.end());
      }
    }
    ir::Type type;
    if (n.target().is_getitem()) {
      const Node* tuple = n.args().at(0).node;
      const ir::Type& tt = map_.at(tuple)->type();
      const int64_t i = n.args().at(1).i;
      TORCH_CHECK(tt.kind == ir::Type::Kind::Tuple && i >= 0 && i < static_cast<int64_t>(tt.elems.size()),
                  "batch_cone: ", w, " reads element ", i, " of a value with no such element");
      type = tt.elems[i];
    } else if (n.target().name == "batch_norm" && args.at(0).kind == Arg::Kind::Node) {
      // Its input's shape and layout; native_batch_norm has no C++ meta kernel (torch registers one
      // from Python), so a meta run would fail outside a Python process.
      type = args.at(0).node->type();
    } else {
      const ir::Type& alone = n.type().kind == ir::Type::Kind::Tuple && !n.type().elems.empty() ? n.type().elems[0]
                                                                                              : n.type();
      const bool cpu = alone.is_tensor() && alone.tensor.device.is_cpu();
      try {
        type = infer_type(target, args, kwargs, w, cpu);
      } catch (const c10::Error&) {
        // A view whose stacked input's strides cannot be viewed (the copies sit between dims it merges):
        // reshape gives the same values, copying. The cone has no in-place ops, so nothing writes through
        // the alias a view would have made.
        if (op != "view" && op != "_unsafe_view") throw;
        target = ir::Target::parse("aten::reshape.default");
        type = infer_type(target, args, kwargs, w, cpu);
      }
      if (layout_from_decomposition(target)) keep_layout_of(type, n.type());
      if (op == "_native_batch_norm_legit_no_training" && type.kind == ir::Type::Kind::Tuple &&
          n.type().kind == ir::Type::Kind::Tuple && type.elems.size() == 3 && n.type().elems.size() == 3) {
        // Eval-mode batch norm saves no statistics: the CPU kernel (and the trace) returns empty save_mean and
        // save_invstd, [0], where the meta kernel answers [C]; the refusal then named the op as mixing the
        // copies. The normalized output, per element from running statistics, is checked as any other.
        type.elems[1] = n.type().elems[1];
        type.elems[2] = n.type().elems[2];
      }
    }
    TORCH_CHECK(scaled_equal(n.type(), type, c, lout.b), "batch_cone: ", w, " produces ", sizes_text(type),
                " from the stacked inputs against ", sizes_text(n.type()), " alone, not the copies along dim ", lout.b,
                ": the op mixes them");
    set_devices(type, n.type());
    Node* copy = out_->create_call(n.name(), target, std::move(args), std::move(kwargs), std::move(type));
    copy->set_module_path(n.module_path());
    map_[&n] = copy;
    count_[copy] = c;
    nlay_[copy] = lout;
  }

  struct PairHash {
    size_t operator()(const std::pair<const Node*, int64_t>& p) const {
      return std::hash<const void*>()(p.first) * 31 + std::hash<int64_t>()(p.second);
    }
    size_t operator()(const std::pair<const Node*, const Node*>& p) const {
      return std::hash<const void*>()(p.first) ^ (std::hash<const void*>()(p.second) << 1);
    }
  };

  const ir::Graph& g_;
  const std::vector<Entry> entries_;
  int64_t total_ = 0;
  std::unique_ptr<ir::Graph> out_;
  Node* site_ = nullptr;
  std::unordered_set<const Node*> in_cone_;
  std::unordered_map<const Node*, size_t> entry_of_;     // entries 2.. by node
  std::unordered_map<const Node*, size_t> live_after_;   // entries whose copies a node's value carries
  std::unordered_map<const Node*, int64_t> copies_of_;   // copies a cone call runs on
  std::unordered_map<const Node*, int64_t> count_;       // copies of a new graph's stacked value
  std::unordered_map<const Node*, Node*> map_;
  std::unordered_map<std::pair<const Node*, int64_t>, Node*, PairHash> externals_;
  std::unordered_map<std::pair<const Node*, int64_t>, Node*, PairHash> pads_;
  std::unordered_map<const Node*, std::pair<const Node*, int64_t>> sources_;
  std::unordered_map<std::pair<const Node*, const Node*>, int64_t, PairHash> planned_;
  std::map<std::pair<const Node*, const Node*>, Layout> tile_lay_;       // where a tiled read puts its copies
  std::map<std::tuple<const Node*, int64_t, int64_t, int64_t>, Node*> tiles_;
  std::unordered_map<const Node*, Layout> lay_;   // original site and cone nodes: where their copies are
  std::unordered_map<const Node*, Layout> nlay_;  // the new graph's stacked values
  int64_t site_dim_ = 0;
};

// Nodes reachable from `s` through calls that are not in `stops` (s included).
std::unordered_set<const Node*> reach_from(const ir::Graph& g, const Node* s, const std::unordered_set<const Node*>& stops) {
  std::unordered_set<const Node*> reach{s};
  for (const auto& up : g.nodes()) {
    const Node* n = up.get();
    if (n->kind() != ir::NodeKind::Call || n == s || stops.count(n)) continue;
    for (const Node* in : n->inputs())
      if (reach.count(in)) {
        reach.insert(n);
        break;
      }
  }
  return reach;
}

}  // namespace

BatchCone batch_cone(const ir::Graph& g, const std::string& site, int64_t k, const std::vector<std::string>& stop) {
  TORCH_CHECK(k >= 1, "batch_cone: k must be >= 1, got ", k);
  return batch_cone(g, std::vector<BatchConeEntry>{{site, k}}, stop);
}

BatchCone batch_cone(const ir::Graph& g, const std::vector<BatchConeEntry>& entries, const std::vector<std::string>& stop) {
  TORCH_CHECK(!entries.empty(), "batch_cone: no entries");
  TORCH_CHECK(g.output() != nullptr, "batch_cone: the graph has no output");
  std::vector<Entry> es;
  int64_t lo = 0;
  for (const BatchConeEntry& e : entries) {
    TORCH_CHECK(e.k >= 1, "batch_cone: k must be >= 1, got ", e.k, " for entry %", e.site);
    const Node* s = g.find(e.site);
    TORCH_CHECK(s != nullptr && s->kind() != ir::NodeKind::Output, "batch_cone: no node named '%", e.site, "'");
    TORCH_CHECK(s->type().is_tensor() && !s->type().tensor.sizes.empty(), "batch_cone: %", e.site,
                " is not a tensor with a dim 0 to stack the sites along");
    for (const Entry& before : es)
      TORCH_CHECK(before.node != s, "batch_cone: entry %", e.site, " is given twice");
    if (!es.empty()) {
      const ir::TensorMeta& a = es.front().node->type().tensor;
      const ir::TensorMeta& b = s->type().tensor;
      TORCH_CHECK(a.sizes == b.sizes && a.dtype == b.dtype, "batch_cone: entry %", e.site, " has type ",
                  sizes_text(s->type()), " ", c10::toString(b.dtype), ", not the first entry %",
                  es.front().node->name(), "'s ", sizes_text(es.front().node->type()), " ", c10::toString(a.dtype),
                  " (one placeholder holds every entry's copies)");
    }
    es.push_back({s, e.k, lo});
    lo += e.k;
  }
  std::unordered_set<const Node*> stops;
  for (const std::string& name : stop) {
    const Node* n = g.find(name);
    TORCH_CHECK(n != nullptr, "batch_cone: no node named '%", name, "' (in stop)");
    if (n != es.front().node) stops.insert(n);
  }
  for (size_t j = 1; j < es.size(); ++j) {
    TORCH_CHECK(!stops.count(es[j].node), "batch_cone: entry %", es[j].node->name(), " is pinned (in stop)");
    TORCH_CHECK(reach_from(g, es[j - 1].node, stops).count(es[j].node), "batch_cone: entry %", es[j].node->name(),
                " is not in the cone of the entry before it, %", es[j - 1].node->name(),
                " (entries must lie along one chain, upstream first)");
  }
  // V+(s_1) without passing a stop node, then only the part that reaches an output inside it.
  const Node* s = es.front().node;
  const std::unordered_set<const Node*> reach = reach_from(g, s, stops);
  std::unordered_set<const Node*> live;
  for (const Arg& a : g.output()->args().at(0).list)
    a.for_each_node([&](Node* n) {
      if (reach.count(n)) live.insert(n);
    });
  for (auto it = g.nodes().rbegin(); it != g.nodes().rend(); ++it) {
    const Node* n = it->get();
    if (!live.count(n) || n == s) continue;
    for (const Node* in : n->inputs())
      if (reach.count(in)) live.insert(in);
  }
  for (size_t j = 1; j < es.size(); ++j)
    TORCH_CHECK(live.count(es[j].node), "batch_cone: entry %", es[j].node->name(), " reaches no output");
  std::vector<const Node*> cone;
  for (const auto& up : g.nodes())
    if (up->kind() == ir::NodeKind::Call && up.get() != s && live.count(up.get())) cone.push_back(up.get());
  // The copies go where the cone provably keeps them apart: along dim 0 of the site first, else along
  // the first other dim that works (dim 1 of a sequence-first [seq, batch, d] stream). Every rule is
  // checked per node from the dims themselves, not guessed from sizes, so seq == batch changes nothing.
  const int64_t rank = static_cast<int64_t>(s->type().tensor.sizes.size());
  std::string refusal;
  for (int64_t d = 0; d < rank; ++d) {
    // Chronological backtracking over the views' equally valid layouts: on a refusal, the last choice
    // made that has an untried option takes its next one (later choices start over). Bounded.
    std::vector<size_t> picks;
    std::string first;
    for (int attempt = 0; attempt < 24; ++attempt) {
      Builder b(g, es, d);
      b.picks_ = picks;
      b.mark_cone(cone);
      try {
        return b.run(cone);
      } catch (const c10::Error& e) {
        if (attempt == 0) first = e.msg();
      }
      const std::vector<size_t>& made = b.choices_;
      picks.resize(made.size(), 0);
      size_t i = made.size();
      while (i > 0 && picks[i - 1] + 1 >= made[i - 1]) --i;
      if (i == 0) break;
      picks.resize(i);
      ++picks[i - 1];
    }
    std::string msg = first;
    if (d == 0) {
      refusal = msg;
      continue;
    }
    const std::string prefix = "batch_cone: ";
    if (msg.rfind(prefix, 0) == 0) msg = msg.substr(prefix.size());
    refusal += "; along dim " + std::to_string(d) + " instead: " + msg;
  }
  TORCH_CHECK(false, refusal);
}

}  // namespace torch_ext::passes
