#include "passes/sequence_axis.h"

#include "ir/args.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <sstream>

namespace torch_ext::passes {
namespace {

using ir::Arg;
using ir::Node;

const std::vector<int64_t>* sizes_of(const Node* n) {
  const ir::Type& t = n->type();
  if (t.kind == ir::Type::Kind::Tensor) return &t.tensor.sizes;
  if (t.kind == ir::Type::Kind::Tuple && !t.elems.empty() && t.elems[0].kind == ir::Type::Kind::Tensor)
    return &t.elems[0].tensor.sizes;
  return nullptr;
}

int64_t rank_of(const Node* n) {
  const auto* s = sizes_of(n);
  return s ? static_cast<int64_t>(s->size()) : -1;
}

using ir::arg_at;
using ir::ints_arg;

std::optional<int64_t> int_arg(const Node& n, size_t pos, const char* name) {
  const Arg* a = arg_at(n, pos, name);
  if (a == nullptr || a->kind != Arg::Kind::Int) return std::nullopt;
  return a->i;
}

const Node* node_arg(const Node& n, size_t pos, const char* name) {
  const Arg* a = arg_at(n, pos, name);
  return a != nullptr && a->kind == Arg::Kind::Node ? a->node : nullptr;
}

int64_t norm_dim(int64_t d, int64_t rank) { return d < 0 ? d + rank : d; }

const std::set<std::string>& elementwise_ops() {
  static const std::set<std::string> ops = {
      "add", "sub", "mul", "div", "neg", "pow", "rsqrt", "sqrt", "exp", "log", "tanh", "sigmoid", "relu", "gelu",
      "silu", "softplus", "erf", "abs", "clamp", "clamp_min", "clamp_max", "where", "masked_fill", "maximum",
      "minimum", "reciprocal", "sin", "cos", "mish", "leaky_relu", "hardtanh", "elu", "square", "rsub", "type_as",
      "expm1", "log1p", "sign", "floor", "ceil", "round", "eq", "ne", "lt", "le", "gt", "ge", "logical_and",
      "logical_or", "logical_not", "bitwise_not", "hardswish", "hardsigmoid", "relu6", "zeros_like", "ones_like",
      "full_like", "clone", "contiguous", "alias", "detach", "_to_copy", "to", "lift_fresh_copy", "dropout",
      "feature_dropout", "alpha_dropout", "exp2", "log2", "tan", "atan", "sinh", "cosh", "gelu_", "erfinv",
      "_softmax_backward_data"};
  return ops;
}

bool identity_like(const std::string& op) {
  return op == "clone" || op == "contiguous" || op == "alias" || op == "detach" || op == "_to_copy" || op == "to" ||
         op == "lift_fresh_copy" || op == "dropout" || op == "feature_dropout" || op == "alpha_dropout";
}


// ---- Small integer / boolean constants computed from the graph alone (no placeholder reaches them):
// positions, masks. Evaluated exactly on the CPU at analysis time, so that a mask built by code the
// structural rules do not know (Hugging Face's causal mask: positions compared with `le`, `and`ed with
// a packed-sequence test) can be proven lower-triangular by its value. Floating results are refused
// (kept exact), and so is anything larger than kMaxKnown elements.
// The ops evaluated are listed by name, on purpose: no rule read from the schema admits only ops whose value
// here is the value the graph computes on its device. "No tensor input, not nondeterministic_seeded" admits
// aten::empty / new_empty / empty_like (uninitialized memory; tagged core or pt2_compliant_tag only), and
// "integer or boolean inputs" admits scatter / index_put with repeated indices (which write wins is the
// device's) and sort / argsort / topk with ties (unstable order); torch tags none of these. Each op below gives
// the same value on every device: an arange or a fill, a view, a copy, a gather (index), integer or boolean
// arithmetic and comparisons.
constexpr int64_t kMaxKnown = int64_t{1} << 24;  // a [8, 1, 1024, 1024] mask and its parts

std::optional<at::Scalar> scalar_arg(const Arg* a) {
  if (a == nullptr) return std::nullopt;
  if (a->kind == Arg::Kind::Int) return at::Scalar(a->i);
  if (a->kind == Arg::Kind::Bool) return at::Scalar(static_cast<bool>(a->i));
  return std::nullopt;
}

std::optional<at::Tensor> evaluate_constant(const Node& n, const std::unordered_map<const Node*, at::Tensor>& known) {
  if (n.kind() != ir::NodeKind::Call || n.target().ns != "aten" || n.type().kind != ir::Type::Kind::Tensor)
    return std::nullopt;
  int64_t numel = 1;  // refused before anything is allocated
  for (int64_t d : n.type().tensor.sizes) numel *= d;
  if (numel > kMaxKnown) return std::nullopt;
  for (const Node* in : n.inputs())
    if (!known.count(in)) return std::nullopt;
  auto t = [&](size_t pos, const char* name) -> std::optional<at::Tensor> {
    const Arg* a = arg_at(n, pos, name);
    if (a == nullptr || a->kind != Arg::Kind::Node) return std::nullopt;
    return known.at(a->node);
  };
  auto dtype_kw = [&]() -> std::optional<c10::ScalarType> {
    const Arg* d = n.kwarg("dtype");
    if (d == nullptr || d->kind != Arg::Kind::Dtype) return std::nullopt;
    return static_cast<c10::ScalarType>(d->i);
  };
  const std::string& op = n.target().name;
  const auto long_opts = at::TensorOptions().dtype(at::kLong);
  at::Tensor r;
  try {
    if (op == "arange") {
      const Arg* a0 = arg_at(n, 0, "end");
      const Arg* a1 = n.args().size() > 1 ? &n.args()[1] : nullptr;
      if (a0 == nullptr || a0->kind != Arg::Kind::Int || n.args().size() > 2 || n.kwarg("step") != nullptr)
        return std::nullopt;
      if (a1 != nullptr && a1->kind == Arg::Kind::Int) r = at::arange(a0->i, a1->i, long_opts);
      else if (a1 == nullptr) r = at::arange(a0->i, long_opts);
      else return std::nullopt;
      if (auto d = dtype_kw()) r = r.to(*d);
    } else if (op == "new_ones" || op == "new_zeros") {
      const auto size = ints_arg(n, 1, "size");
      auto x = t(0, "self");
      if (!size || !x) return std::nullopt;
      const auto opts = at::TensorOptions().dtype(dtype_kw().value_or(x->scalar_type()));
      r = op == "new_ones" ? at::ones(*size, opts) : at::zeros(*size, opts);
    } else if (op == "unsqueeze") {
      auto x = t(0, "self");
      const auto d = int_arg(n, 1, "dim");
      if (!x || !d) return std::nullopt;
      r = x->unsqueeze(*d);
    } else if (op == "expand") {
      auto x = t(0, "self");
      const auto size = ints_arg(n, 1, "size");
      if (!x || !size) return std::nullopt;
      r = x->expand(*size);
    } else if (op == "view" || op == "reshape" || op == "_unsafe_view") {
      auto x = t(0, "self");
      const auto size = ints_arg(n, 1, "size");
      if (!x || !size) return std::nullopt;
      r = x->reshape(*size);
    } else if (op == "slice") {
      auto x = t(0, "self");
      if (!x) return std::nullopt;
      const int64_t dim = int_arg(n, 1, "dim").value_or(0);
      const Arg* st = arg_at(n, 2, "start");
      const Arg* en = arg_at(n, 3, "end");
      std::optional<int64_t> start, end;
      if (st && st->kind == Arg::Kind::Int) start = st->i;
      else if (st && st->kind != Arg::Kind::None) return std::nullopt;
      if (en && en->kind == Arg::Kind::Int) end = en->i;
      else if (en && en->kind != Arg::Kind::None) return std::nullopt;
      r = x->slice(dim, start, end, int_arg(n, 4, "step").value_or(1));
    } else if (op == "diff") {
      auto x = t(0, "self");
      if (!x) return std::nullopt;
      const Arg* pre = arg_at(n, 3, "prepend");
      const Arg* app = arg_at(n, 4, "append");
      std::optional<at::Tensor> prepend, append;
      if (pre && pre->kind == Arg::Kind::Node) prepend = known.at(pre->node);
      if (app && app->kind == Arg::Kind::Node) append = known.at(app->node);
      r = at::diff(*x, int_arg(n, 1, "n").value_or(1), int_arg(n, 2, "dim").value_or(-1), prepend, append);
    } else if (op == "cumsum") {
      auto x = t(0, "self");
      const auto d = int_arg(n, 1, "dim");
      if (!x || !d || dtype_kw()) return std::nullopt;
      r = x->cumsum(*d);
    } else if (op == "index") {
      auto x = t(0, "self");
      const Arg* idx = arg_at(n, 1, "indices");
      if (!x || idx == nullptr || idx->kind != Arg::Kind::List) return std::nullopt;
      c10::List<std::optional<at::Tensor>> indices;
      for (const Arg& e : idx->list) {
        if (e.kind == Arg::Kind::Node) indices.push_back(known.at(e.node));
        else if (e.kind == Arg::Kind::None) indices.push_back(std::nullopt);
        else return std::nullopt;
      }
      r = at::index(*x, indices);
    } else if (op == "to" || op == "_to_copy" || op == "clone" || op == "contiguous" || op == "alias" ||
               op == "lift_fresh_copy") {
      auto x = t(0, "self");
      if (!x) return std::nullopt;
      r = x->to(dtype_kw().value_or(x->scalar_type())).clone();
    } else if (op == "logical_not" || op == "bitwise_not" || op == "neg") {
      auto x = t(0, "self");
      if (!x) return std::nullopt;
      r = op == "logical_not" ? x->logical_not() : op == "neg" ? x->neg() : x->bitwise_not();
    } else if (op == "add" || op == "sub" || op == "mul" || op == "eq" || op == "ne" || op == "le" || op == "lt" ||
               op == "ge" || op == "gt" || op == "__and__" || op == "__or__" || op == "bitwise_and" ||
               op == "bitwise_or" || op == "logical_and" || op == "logical_or") {
      auto x = t(0, "self");
      if (!x) return std::nullopt;
      const Arg* o = arg_at(n, 1, "other");
      if (o == nullptr) return std::nullopt;
      at::Tensor other;
      if (o->kind == Arg::Kind::Node) {
        other = known.at(o->node);
      } else if (auto sc = scalar_arg(o)) {
        other = at::scalar_tensor(*sc, at::TensorOptions().dtype(sc->isBoolean() ? at::kBool : at::kLong));
      } else {
        return std::nullopt;
      }
      const Arg* alpha = n.kwarg("alpha");
      if (alpha != nullptr && !(alpha->kind == Arg::Kind::Int && alpha->i == 1)) return std::nullopt;
      if (op == "add") r = at::add(*x, other);
      else if (op == "sub") r = at::sub(*x, other);
      else if (op == "mul") r = at::mul(*x, other);
      else if (op == "eq") r = at::eq(*x, other);
      else if (op == "ne") r = at::ne(*x, other);
      else if (op == "le") r = at::le(*x, other);
      else if (op == "lt") r = at::lt(*x, other);
      else if (op == "ge") r = at::ge(*x, other);
      else if (op == "gt") r = at::gt(*x, other);
      else if (op == "__and__" || op == "bitwise_and") r = at::bitwise_and(*x, other);
      else if (op == "__or__" || op == "bitwise_or") r = at::bitwise_or(*x, other);
      else if (op == "logical_and") r = at::logical_and(*x, other);
      else r = at::logical_or(*x, other);
    } else {
      return std::nullopt;
    }
  } catch (const std::exception&) {
    return std::nullopt;  // not evaluable here: no claim
  }
  // Only exact values, of the declared type: integers and booleans, small.
  if (r.is_floating_point() || r.is_complex() || r.numel() > kMaxKnown || n.type().kind != ir::Type::Kind::Tensor ||
      r.sizes() != at::IntArrayRef(n.type().tensor.sizes) || r.scalar_type() != n.type().tensor.dtype)
    return std::nullopt;
  return r;
}

// 1: lower-triangular keep mask (true where j <= i) over the last two dims, for every leading index;
// 2: its complement; 3: all true; 0: none of these.
int mask_kind_of_value(const at::Tensor& v) {
  if (v.dim() < 2 || v.size(-1) != v.size(-2) || v.numel() == 0) return 0;
  const at::Tensor b = v.to(at::kBool);
  if (b.all().item<bool>()) return 3;
  const int64_t T = v.size(-1);
  const at::Tensor keep = at::ones({T, T}, at::TensorOptions().dtype(at::kBool)).tril();
  if (b.eq(keep).all().item<bool>()) return 1;
  if (b.eq(keep.logical_not()).all().item<bool>()) return 2;
  return 0;
}

class Analyzer {
 public:
  Analyzer(const ir::Graph& g, int64_t seq_dim) : g_(g) { out_.seq_dim = seq_dim; }

  SeqAxisAnalysis run() {
    for (const auto& up : g_.nodes()) {
      const Node* n = up.get();
      if (n->kind() == ir::NodeKind::Output) continue;
      SeqNode info;
      if (n->kind() == ir::NodeKind::Placeholder) {
        const auto* s = sizes_of(n);
        info.varying = n->role() == ir::InputRole::UserInput;
        if (n->role() == ir::InputRole::UserInput && n->type().kind == ir::Type::Kind::Tensor && s &&
            static_cast<int64_t>(s->size()) > out_.seq_dim && out_.seq_dim >= 0) {
          info.row_axis = out_.seq_dim;
          info.length = (*s)[out_.seq_dim];
        }
      } else {
        info = call(*n);
        for (const Node* in : n->inputs()) info.varying = info.varying || of(in).varying;
        if (info.row_axis < 0 && !info.varying) {
          if (auto v = evaluate_constant(*n, known_)) {
            if (info.mask_kind == 0) info.mask_kind = mask_kind_of_value(*v);
            known_[n] = std::move(*v);
          }
        }
      }
      out_.nodes[n] = std::move(info);
    }
    return std::move(out_);
  }

 private:
  const SeqNode& of(const Node* n) const { return out_.nodes.at(n); }
  bool has_axis(const Node* n) const { return of(n).row_axis >= 0; }

  SeqNode base(const Node& n) const {
    SeqNode s;
    for (const Node* in : n.inputs()) s.inputs.push_back(SeqInput{in, SeqRel::None, -1});
    return s;
  }
  SeqNode fallback(const Node& n) const {
    SeqNode s = base(n);
    for (auto& in : s.inputs)
      if (has_axis(in.node)) in.rel = SeqRel::All;
    return s;
  }
  SeqInput* input(SeqNode& s, const Node* in) const {
    for (auto& i : s.inputs)
      if (i.node == in) return &i;
    return nullptr;
  }
  // Everything else must be read whole and have no sequence axis.
  bool rest_is_constant(const SeqNode& s) const {
    for (const auto& i : s.inputs)
      if (i.rel == SeqRel::None && has_axis(i.node)) return false;
    return true;
  }

  SeqNode call(const Node& n) {
    bool any_axis = false;
    for (const Node* in : n.inputs()) any_axis = any_axis || has_axis(in);
    if (!any_axis) return constant(n);
    if (n.target().is_getitem()) {
      SeqNode s = base(n);
      const Node* src = n.inputs().at(0);
      s.row_axis = of(src).row_axis;
      s.key_axis = of(src).key_axis;
      s.length = of(src).length;
      s.inputs[0].rel = SeqRel::Row;
      s.inputs[0].dim = s.row_axis;
      return s;
    }
    const std::string& op = n.target().name;
    std::optional<SeqNode> r;
    if (elementwise_ops().count(op)) r = elementwise(n);
    else if (op == "linear") r = linear(n);
    else if (op == "mm" || op == "bmm" || op == "matmul") r = matmul(n);
    else if (op == "addmm") r = addmm(n);
    else if (op == "layer_norm" || op == "rms_norm") r = norm(n);
    else if (op == "softmax" || op == "_softmax" || op == "log_softmax" || op == "_log_softmax") r = softmax(n);
    else if (op == "mean" || op == "sum" || op == "amax" || op == "amin" || op == "var" || op == "std") r = reduce(n);
    else if (op == "view" || op == "_unsafe_view" || op == "reshape") r = view(n);
    else if (op == "expand") r = expand(n);
    else if (op == "transpose" || op == "swapaxes" || op == "t") r = transpose(n);
    else if (op == "permute") r = permute(n);
    else if (op == "unsqueeze") r = unsqueeze(n);
    else if (op == "squeeze") r = squeeze(n);
    else if (op == "select") r = select(n);
    else if (op == "slice") r = slice(n);
    else if (op == "split" || op == "split_with_sizes" || op == "chunk" || op == "unbind") r = split(n);
    else if (op == "cat") r = cat(n);
    else if (op == "embedding") r = embedding(n);
    else if (op == "scaled_dot_product_attention") r = sdpa(n);
    if (!r || r->row_axis < 0 || !rest_is_constant(*r)) return fallback(n);
    // Rows folded into blocks (SeqNode::fold) are followed by the ops whose rules above account for it.
    const bool folds = elementwise_ops().count(op) || op == "linear" || op == "addmm" || op == "layer_norm" ||
                       op == "rms_norm" || op == "view" || op == "_unsafe_view" || op == "reshape";
    bool folded = r->fold != 1;
    for (const Node* in : n.inputs()) folded = folded || (has_axis(in) && of(in).fold != 1);
    if (folded && !folds) return fallback(n);
    return *r;
  }

  // ---- constants: only the causal-mask structure is tracked.
  SeqNode constant(const Node& n) const {
    SeqNode s = base(n);
    const std::string& op = n.target().name;
    const Node* x = n.inputs().empty() ? nullptr : n.inputs()[0];
    const int xk = x ? of(x).mask_kind : 0;
    const auto* sz = sizes_of(&n);
    if (op == "ones" || op == "ones_like") {
      s.mask_kind = 3;
    } else if (op == "tril" && xk == 3 && int_arg(n, 1, "diagonal").value_or(0) == 0) {
      s.mask_kind = 1;
    } else if (op == "triu" && xk == 3 && int_arg(n, 1, "diagonal").value_or(0) == 1) {
      s.mask_kind = 2;
    } else if (op == "eq" && (xk == 1 || xk == 2) && arg_at(n, 1, "other") && arg_at(n, 1, "other")->kind != Arg::Kind::Node) {
      const Arg* o = arg_at(n, 1, "other");
      const double v = o->kind == Arg::Kind::Float ? o->f : static_cast<double>(o->i);
      if (v == 0) s.mask_kind = 3 - xk;
    } else if (op == "ne" && (xk == 1 || xk == 2) && arg_at(n, 1, "other") && arg_at(n, 1, "other")->kind != Arg::Kind::Node) {
      const Arg* o = arg_at(n, 1, "other");
      const double v = o->kind == Arg::Kind::Float ? o->f : static_cast<double>(o->i);
      if (v == 0) s.mask_kind = xk;
    } else if ((op == "logical_not" || op == "bitwise_not") && (xk == 1 || xk == 2)) {
      s.mask_kind = 3 - xk;
    } else if (identity_like(op) && op != "dropout") {
      s.mask_kind = xk;
    } else if (op == "slice" && xk) {
      const Arg* start = arg_at(n, 2, "start");
      const bool from0 = start == nullptr || start->kind == Arg::Kind::None || (start->kind == Arg::Kind::Int && start->i == 0);
      if (from0 && int_arg(n, 4, "step").value_or(1) == 1) s.mask_kind = xk;
    } else if ((op == "unsqueeze" || op == "view" || op == "reshape" || op == "_unsafe_view" || op == "expand") && xk && sz &&
               sizes_of(x)) {
      // Leading dims only: the last two dims must be the input's last two.
      const auto& in = *sizes_of(x);
      if (in.size() >= 2 && sz->size() >= 2 && in[in.size() - 2] == (*sz)[sz->size() - 2] &&
          in.back() == sz->back()) {
        int64_t pin = 1, pout = 1;
        for (size_t i = 0; i + 2 < in.size(); ++i) pin *= in[i];
        for (size_t i = 0; i + 2 < sz->size(); ++i) pout *= (*sz)[i];
        if (pin == 1 && (pout == 1 || op == "expand")) s.mask_kind = xk;
      }
    }
    return s;
  }

  // A mask proven causal for an output whose (row, key) axes are its last two dims, of length T.
  bool causal_mask(const Node* m, int want_kind, int64_t T) const {
    if (m == nullptr || has_axis(m) || of(m).mask_kind != want_kind) return false;
    const auto* s = sizes_of(m);
    return s && s->size() >= 2 && (*s)[s->size() - 2] == T && s->back() == T;
  }

  // ---- position-wise ops
  std::optional<SeqNode> elementwise(const Node& n) {
    SeqNode s = base(n);
    const auto* out = sizes_of(&n);
    if (!out || n.type().kind != ir::Type::Kind::Tensor) return std::nullopt;
    const auto R = static_cast<int64_t>(out->size());
    const std::string& op = n.target().name;
    if (op == "dropout" || op == "feature_dropout" || op == "alpha_dropout") {
      const Arg* train = arg_at(n, 2, "train");
      const Arg* p = arg_at(n, 1, "p");
      const bool off = (train && train->kind == Arg::Kind::Bool && !train->i) ||
                       (p && p->kind == Arg::Kind::Float && p->f == 0.0);
      if (!off) return std::nullopt;
    }
    int64_t row = -1, key = -1, T = 0, fold = 0;
    for (const Node* in : n.inputs()) {
      const SeqNode& i = of(in);
      if (i.row_axis < 0) continue;
      const int64_t a = i.row_axis + (R - rank_of(in));
      const int64_t k = i.key_axis >= 0 ? i.key_axis + (R - rank_of(in)) : -1;
      if (row >= 0 && a != row) return std::nullopt;
      if (k >= 0 && key >= 0 && k != key) return std::nullopt;
      row = a;
      if (k >= 0) key = k;
      if (T && i.length != T) return std::nullopt;
      if (fold && i.fold != fold) return std::nullopt;
      T = i.length;
      fold = i.fold;
    }
    if (row < 0 || (*out)[row] != fold * T) return std::nullopt;
    s.row_axis = row;
    s.key_axis = key;
    s.length = T;
    s.fold = fold;
    for (auto& in : s.inputs) {
      const int64_t r = rank_of(in.node);
      if (r < 0) continue;
      const int64_t d = row - (R - r);
      if (has_axis(in.node)) {
        in.rel = SeqRel::Row;
        in.dim = of(in.node).row_axis;
      } else if (fold != 1 && d >= 0 && (*sizes_of(in.node))[d] != 1) {
        return std::nullopt;  // a table along folded rows: not read row-wise here
      } else if (d >= 0 && (*sizes_of(in.node))[d] == T && T != 1) {
        in.rel = SeqRel::Row;  // a positional table or mask broadcast along the axis: read its rows
        in.dim = d;
      }
    }
    const Node* x = n.inputs()[0];
    if (op == "masked_fill" && key == R - 1 && row == R - 2 && has_axis(x)) {
      const Node* m = node_arg(n, 1, "mask");
      const Arg* v = arg_at(n, 2, "value");
      if (causal_mask(m, 2, T) && v && (v->kind == Arg::Kind::Float || v->kind == Arg::Kind::Int)) {
        const double val = v->kind == Arg::Kind::Float ? v->f : static_cast<double>(v->i);
        if (std::isinf(val) && val < 0) {
          s.masks_upper = true;
          s.causal_values = true;  // -inf above the diagonal
          s.mask_kind = 1;         // marks "-inf" (softmax turns it into zeros)
        } else if (val == 0) {
          s.masks_upper = true;
          s.causal_values = true;
          s.mask_kind = 2;  // zeros above the diagonal
        }
      }
    } else if (identity_like(op) && has_axis(x)) {
      s.causal_values = of(x).causal_values;
      if (s.causal_values) s.mask_kind = of(x).mask_kind;
    }
    return s;
  }

  std::optional<SeqNode> linear(const Node& n) {
    SeqNode s = base(n);
    const Node* x = node_arg(n, 0, "input");
    if (!x || !has_axis(x)) return std::nullopt;
    const SeqNode& i = of(x);
    if (i.row_axis >= rank_of(x) - 1) return std::nullopt;
    s.row_axis = i.row_axis;
    s.length = i.length;
    s.fold = i.fold;
    s.mixes_key = i.key_axis == rank_of(x) - 1;
    input(s, x)->rel = SeqRel::Row;
    input(s, x)->dim = i.row_axis;
    return s;
  }

  std::optional<SeqNode> addmm(const Node& n) {
    SeqNode s = base(n);
    const Node* a = node_arg(n, 1, "mat1");
    if (!a || !has_axis(a) || of(a).row_axis != 0) return std::nullopt;
    // The bias is read whole: it must broadcast along the rows (a row-sized one is not sliced).
    const Node* bias = node_arg(n, 0, "self");
    if (bias != nullptr && !has_axis(bias) && rank_of(bias) == 2 && (*sizes_of(bias))[0] != 1) return std::nullopt;
    s.row_axis = 0;
    s.length = of(a).length;
    s.fold = of(a).fold;
    input(s, a)->rel = SeqRel::Row;
    input(s, a)->dim = 0;
    return s;
  }

  std::optional<SeqNode> matmul(const Node& n) {
    SeqNode s = base(n);
    const Node* a = node_arg(n, 0, "self");
    const Node* b = node_arg(n, 1, "mat2");
    if (!b) b = node_arg(n, 1, "other");
    const auto* out = sizes_of(&n);
    if (!a || !b || a == b || !out) return std::nullopt;
    const int64_t ra = rank_of(a), rb = rank_of(b), R = static_cast<int64_t>(out->size());
    if (ra < 2 || rb < 2) return std::nullopt;
    const SeqNode& A = of(a);
    const SeqNode& B = of(b);
    if (A.row_axis < 0) return std::nullopt;
    const int64_t T = A.length;
    if (A.row_axis == ra - 1) return std::nullopt;  // the contraction runs over the sequence
    s.row_axis = A.row_axis + (R - ra);
    s.length = T;
    s.mixes_key = A.key_axis == ra - 1;
    input(s, a)->rel = SeqRel::Row;
    input(s, a)->dim = A.row_axis;
    SeqInput* bi = input(s, b);
    if (B.row_axis < 0) {
      if (A.row_axis < ra - 2) {  // the axis is a batch dim: b is read row-wise where it is not broadcast
        const int64_t d = s.row_axis - (R - rb);
        if (d >= 0 && d < rb - 2 && (*sizes_of(b))[d] == T && T != 1) {
          bi->rel = SeqRel::Row;
          bi->dim = d;
        }
      }
      return s;
    }
    if (A.row_axis != ra - 2 || ra != rb || B.length != T) return std::nullopt;
    if (B.row_axis == rb - 1 && A.key_axis < 0) {  // q @ k^T: scores with a key axis
      s.key_axis = R - 1;
      bi->rel = SeqRel::Key;
      bi->dim = B.row_axis;
      return s;
    }
    if (B.row_axis == rb - 2 && A.key_axis == ra - 1 && A.causal_values && A.mask_kind == 2 && B.key_axis < 0) {
      s.mixes_key = false;  // zeros above the diagonal: row i reads value rows <= i only
      bi->rel = SeqRel::Prefix;
      bi->dim = B.row_axis;
      return s;
    }
    return std::nullopt;
  }

  std::optional<SeqNode> norm(const Node& n) {
    SeqNode s = base(n);
    const Node* x = n.inputs()[0];
    const auto shape = ints_arg(n, 1, "normalized_shape");
    if (!has_axis(x) || !shape) return std::nullopt;
    const SeqNode& i = of(x);
    const int64_t first = rank_of(x) - static_cast<int64_t>(shape->size());
    if (i.row_axis >= first) return std::nullopt;
    s.row_axis = i.row_axis;
    s.length = i.length;
    s.fold = i.fold;
    s.mixes_key = i.key_axis >= first;
    input(s, x)->rel = SeqRel::Row;
    input(s, x)->dim = i.row_axis;
    return s;
  }

  std::optional<SeqNode> softmax(const Node& n) {
    SeqNode s = base(n);
    const Node* x = n.inputs()[0];
    const auto dim = int_arg(n, 1, "dim");
    if (!has_axis(x) || !dim) return std::nullopt;
    const SeqNode& i = of(x);
    const int64_t d = norm_dim(*dim, rank_of(x));
    if (d == i.row_axis) return std::nullopt;
    s.row_axis = i.row_axis;
    s.key_axis = i.key_axis;
    s.length = i.length;
    input(s, x)->rel = SeqRel::Row;
    input(s, x)->dim = i.row_axis;
    if (d == i.key_axis) {
      s.mixes_key = true;
      const std::string& op = n.target().name;
      if (i.causal_values && i.mask_kind == 1 && (op == "softmax" || op == "_softmax")) {
        s.causal_values = true;
        s.mask_kind = 2;  // exp(-inf) = 0 above the diagonal
      }
    }
    return s;
  }

  std::optional<SeqNode> reduce(const Node& n) {
    SeqNode s = base(n);
    const Node* x = n.inputs()[0];
    const auto dims = ints_arg(n, 1, "dim");
    if (!has_axis(x) || !dims || dims->empty()) return std::nullopt;
    const Arg* kd = arg_at(n, n.target().name == "var" || n.target().name == "std" ? 3 : 2, "keepdim");
    const bool keep = kd && kd->kind == Arg::Kind::Bool && kd->i;
    const SeqNode& i = of(x);
    const int64_t r = rank_of(x);
    int64_t row = i.row_axis, key = i.key_axis;
    for (int64_t d0 : *dims) {
      const int64_t d = norm_dim(d0, r);
      if (d == i.row_axis) return std::nullopt;
      if (d == i.key_axis) {
        s.mixes_key = true;
        key = -1;
      }
    }
    if (!keep) {
      for (int64_t d0 : *dims) {
        const int64_t d = norm_dim(d0, r);
        if (d < i.row_axis) --row;
      }
      key = -1;
    }
    s.row_axis = row;
    s.key_axis = key;
    s.length = i.length;
    input(s, x)->rel = SeqRel::Row;
    input(s, x)->dim = i.row_axis;
    return s;
  }

  // ---- layout ops
  SeqNode follow(const Node& n, const Node* x, int64_t row, int64_t key) const {
    SeqNode s = base(n);
    s.row_axis = row;
    s.key_axis = key;
    s.length = of(x).length;
    s.fold = of(x).fold;
    s.causal_values = of(x).causal_values;
    s.mask_kind = of(x).causal_values ? of(x).mask_kind : 0;
    input(s, x)->rel = SeqRel::Row;
    input(s, x)->dim = of(x).row_axis;
    return s;
  }

  // follow() for an op that reorders axes (`moved` maps an input axis to its output axis): once the
  // key axis comes before the row axis, the values are no longer causal in the row.
  template <typename Moved>
  SeqNode follow_reordered(const Node& n, const Node* x, Moved moved) const {
    SeqNode s = follow(n, x, moved(of(x).row_axis), moved(of(x).key_axis));
    if (s.key_axis >= 0 && s.key_axis < s.row_axis) s.causal_values = false;
    return s;
  }

  // Where dim `d` of `in` lands in `out` when a reshape keeps it whole, or -1.
  static int64_t reshape_dim(const std::vector<int64_t>& in, const std::vector<int64_t>& out, int64_t d) {
    if (d < 0) return -1;
    int64_t pre = 1;
    for (int64_t i = 0; i < d; ++i) pre *= in[i];
    int64_t acc = 1;
    for (size_t j = 0; j < out.size(); ++j) {
      if (acc == pre && out[j] == in[d] && (in[d] != 1)) return static_cast<int64_t>(j);
      acc *= out[j];
    }
    return -1;
  }

  std::optional<SeqNode> view(const Node& n) {
    const Node* x = n.inputs()[0];
    const auto* out = sizes_of(&n);
    const auto* in = sizes_of(x);
    if (!has_axis(x) || !out || !in) return std::nullopt;
    if (of(x).key_axis < 0) {
      // Rows merged into blocks or split out of them: output dim j holds the row axis when the dims up to
      // it hold as many elements as the input's dims up to its row axis (so the flat index L over them is
      // the same) and its size is a multiple of T: row t of block L / T, t = L mod T, on both sides.
      const int64_t d = of(x).row_axis, T = of(x).length;
      int64_t pin = 1, pout = 1;
      for (int64_t k = 0; k <= d; ++k) pin *= (*in)[k];
      for (size_t j = 0; j < out->size(); ++j) {
        pout *= (*out)[j];
        if (pout == pin && T > 1 && (*out)[j] % T == 0) {
          SeqNode s = follow(n, x, static_cast<int64_t>(j), -1);
          s.fold = (*out)[j] / T;
          s.causal_values = false;  // no key axis: nothing causal to carry
          s.mask_kind = 0;
          return s;
        }
        if (pout > pin) break;
      }
      return std::nullopt;
    }
    if (of(x).fold != 1) return std::nullopt;
    const int64_t row = reshape_dim(*in, *out, of(x).row_axis);
    if (row < 0) return std::nullopt;
    // The key axis must also stay whole, else the causal structure is lost (Upper stays Upper).
    const int64_t key = reshape_dim(*in, *out, of(x).key_axis);
    SeqNode s = follow(n, x, row, key);
    if (key < 0) s.causal_values = false;
    return s;
  }

  std::optional<SeqNode> expand(const Node& n) {
    const Node* x = n.inputs()[0];
    const auto* out = sizes_of(&n);
    if (!has_axis(x) || !out) return std::nullopt;
    const int64_t shift = static_cast<int64_t>(out->size()) - rank_of(x);
    const SeqNode& i = of(x);
    return follow(n, x, i.row_axis + shift, i.key_axis >= 0 ? i.key_axis + shift : -1);
  }

  std::optional<SeqNode> transpose(const Node& n) {
    const Node* x = n.inputs()[0];
    if (!has_axis(x)) return std::nullopt;
    const int64_t r = rank_of(x);
    int64_t a = 0, b = 1;
    if (n.target().name != "t") {
      const auto d0 = int_arg(n, 1, "dim0");
      const auto d1 = int_arg(n, 2, "dim1");
      if (!d0 || !d1) return std::nullopt;
      a = norm_dim(*d0, r);
      b = norm_dim(*d1, r);
    }
    return follow_reordered(n, x, [&](int64_t d) { return d < 0 ? d : d == a ? b : d == b ? a : d; });
  }

  std::optional<SeqNode> permute(const Node& n) {
    const Node* x = n.inputs()[0];
    const auto dims = ints_arg(n, 1, "dims");
    if (!has_axis(x) || !dims) return std::nullopt;
    const int64_t r = rank_of(x);
    auto where = [&](int64_t d) -> int64_t {
      if (d < 0) return -1;
      for (size_t j = 0; j < dims->size(); ++j)
        if (norm_dim((*dims)[j], r) == d) return static_cast<int64_t>(j);
      return -1;
    };
    return follow_reordered(n, x, where);
  }

  std::optional<SeqNode> unsqueeze(const Node& n) {
    const Node* x = n.inputs()[0];
    const auto dim = int_arg(n, 1, "dim");
    if (!has_axis(x) || !dim) return std::nullopt;
    const int64_t d = norm_dim(*dim, rank_of(x) + 1);
    auto shift = [&](int64_t a) { return a < 0 ? a : a + (d <= a ? 1 : 0); };
    return follow(n, x, shift(of(x).row_axis), shift(of(x).key_axis));
  }

  std::optional<SeqNode> squeeze(const Node& n) {
    const Node* x = n.inputs()[0];
    const auto* in = sizes_of(x);
    if (!has_axis(x) || !in) return std::nullopt;
    std::vector<int64_t> dims;
    if (auto ds = ints_arg(n, 1, "dim")) {
      for (int64_t d : *ds) dims.push_back(norm_dim(d, rank_of(x)));
    } else {
      for (size_t d = 0; d < in->size(); ++d) dims.push_back(static_cast<int64_t>(d));
    }
    auto shift = [&](int64_t a) -> int64_t {
      if (a < 0) return a;
      int64_t out = a;
      for (int64_t d : dims) {
        if ((*in)[d] != 1) continue;
        if (d == a) return -2;
        if (d < a) --out;
      }
      return out;
    };
    const int64_t row = shift(of(x).row_axis), key = shift(of(x).key_axis);
    if (row < 0 || key == -2) return std::nullopt;
    return follow(n, x, row, key);
  }

  std::optional<SeqNode> select(const Node& n) {
    const Node* x = n.inputs()[0];
    const auto dim = int_arg(n, 1, "dim");
    if (!has_axis(x) || !dim) return std::nullopt;
    const int64_t d = norm_dim(*dim, rank_of(x));
    if (d == of(x).row_axis || d == of(x).key_axis) return std::nullopt;
    auto shift = [&](int64_t a) { return a < 0 ? a : a - (d < a ? 1 : 0); };
    return follow(n, x, shift(of(x).row_axis), shift(of(x).key_axis));
  }

  std::optional<SeqNode> slice(const Node& n) {
    const Node* x = n.inputs()[0];
    const auto dim = int_arg(n, 1, "dim");
    if (!has_axis(x) || !dim) return std::nullopt;
    const int64_t d = norm_dim(*dim, rank_of(x));
    if (d == of(x).row_axis || d == of(x).key_axis) {
      // Only the identity slice keeps every row in place.
      if ((*sizes_of(&n))[d] != (*sizes_of(x))[d]) return std::nullopt;
    }
    return follow(n, x, of(x).row_axis, of(x).key_axis);
  }

  std::optional<SeqNode> split(const Node& n) {
    const Node* x = n.inputs()[0];
    if (!has_axis(x)) return std::nullopt;
    const bool unbind = n.target().name == "unbind";
    const int64_t d = norm_dim(int_arg(n, unbind ? 1 : 2, "dim").value_or(0), rank_of(x));
    if (d == of(x).row_axis || d == of(x).key_axis) return std::nullopt;
    auto shift = [&](int64_t a) { return a < 0 ? a : a - (unbind && d < a ? 1 : 0); };
    return follow(n, x, shift(of(x).row_axis), shift(of(x).key_axis));
  }

  std::optional<SeqNode> cat(const Node& n) {
    SeqNode s = base(n);
    const auto* out = sizes_of(&n);
    if (!out) return std::nullopt;
    const auto R = static_cast<int64_t>(out->size());
    const int64_t d = norm_dim(int_arg(n, 1, "dim").value_or(0), R);
    int64_t row = -1, T = 0;
    for (const Node* in : n.inputs()) {
      if (!has_axis(in)) continue;
      if (rank_of(in) != R || of(in).key_axis >= 0) return std::nullopt;
      if (row >= 0 && (of(in).row_axis != row || of(in).length != T)) return std::nullopt;
      row = of(in).row_axis;
      T = of(in).length;
    }
    if (row < 0 || row == d) return std::nullopt;
    s.row_axis = row;
    s.length = T;
    for (auto& in : s.inputs) {
      if (has_axis(in.node) || (rank_of(in.node) == R && (*sizes_of(in.node))[row] == T)) {
        in.rel = SeqRel::Row;
        in.dim = row;
      }
    }
    return s;
  }

  std::optional<SeqNode> embedding(const Node& n) {
    SeqNode s = base(n);
    const Node* w = node_arg(n, 0, "weight");
    const Node* idx = node_arg(n, 1, "indices");
    if (!w || !idx || has_axis(w) || !has_axis(idx)) return std::nullopt;
    s.row_axis = of(idx).row_axis;
    s.length = of(idx).length;
    input(s, idx)->rel = SeqRel::Row;
    input(s, idx)->dim = s.row_axis;
    return s;
  }

  std::optional<SeqNode> sdpa(const Node& n) {
    SeqNode s = base(n);
    const Node* q = node_arg(n, 0, "query");
    const Node* k = node_arg(n, 1, "key");
    const Node* v = node_arg(n, 2, "value");
    const Node* mask = node_arg(n, 3, "attn_mask");
    const Arg* drop = arg_at(n, 4, "dropout_p");
    const Arg* causal = arg_at(n, 5, "is_causal");
    if (!q || !k || !v || q == k || q == v || k == v || !has_axis(q)) return std::nullopt;
    if (drop && !(drop->kind == Arg::Kind::Float && drop->f == 0.0) && !(drop->kind == Arg::Kind::Int && drop->i == 0))
      return std::nullopt;
    // enable_gqa (fewer key / value heads, shared inside the kernel) leaves the rows alone: the row path's masked
    // call passes it on (reactive/rows.cpp).
    const bool is_causal = causal && causal->kind == Arg::Kind::Bool && causal->i;
    const int64_t rq = rank_of(q);
    const int64_t T = of(q).length;
    if (of(q).row_axis != rq - 2 || of(q).key_axis >= 0) return std::nullopt;
    s.row_axis = rq - 2;
    s.length = T;
    input(s, q)->rel = SeqRel::Row;
    input(s, q)->dim = rq - 2;
    const bool self_attn = has_axis(k) && has_axis(v) && of(k).row_axis == rank_of(k) - 2 &&
                           of(v).row_axis == rank_of(v) - 2 && of(k).length == T && of(v).length == T &&
                           of(k).key_axis < 0 && of(v).key_axis < 0;
    bool causal_ok = false;
    if (is_causal && mask == nullptr && self_attn) {
      causal_ok = true;
      s.causal_attention = true;
    } else if (!is_causal && mask != nullptr && self_attn && causal_mask(mask, 1, T) &&
               mask->type().kind == ir::Type::Kind::Tensor && mask->type().tensor.dtype == c10::kBool) {
      causal_ok = true;
      s.causal_attention = true;  // the mask is the causal one: is_causal's rows (the row path may use either)
      SeqInput* mi = input(s, mask);
      mi->rel = SeqRel::Row;
      mi->dim = rank_of(mask) - 2;
    } else if (!is_causal && mask == nullptr && !has_axis(k) && !has_axis(v)) {
      return s;  // attention to a constant memory: row-wise in the queries
    }
    if (!causal_ok) return std::nullopt;
    input(s, k)->rel = SeqRel::Prefix;
    input(s, k)->dim = rank_of(k) - 2;
    input(s, v)->rel = SeqRel::Prefix;
    input(s, v)->dim = rank_of(v) - 2;
    return s;
  }

  const ir::Graph& g_;
  SeqAxisAnalysis out_;
  std::unordered_map<const Node*, at::Tensor> known_;  // evaluate_constant's values
};

const char* rel_name(SeqRel r) {
  switch (r) {
    case SeqRel::None: return "none";
    case SeqRel::Row: return "row";
    case SeqRel::Prefix: return "prefix";
    case SeqRel::Key: return "key";
    case SeqRel::All: return "all";
  }
  return "?";
}

}  // namespace

SeqAxisAnalysis analyze_sequence_axis(const ir::Graph& graph, int64_t seq_dim) {
  return Analyzer(graph, seq_dim).run();
}

std::string print_sequence_axis(const ir::Graph& graph, const SeqAxisAnalysis& a) {
  std::ostringstream os;
  for (const auto& up : graph.nodes()) {
    const Node* n = up.get();
    if (n->kind() != ir::NodeKind::Call) continue;
    const SeqNode& s = a.at(n);
    os << "%" << n->name() << ":";
    if (s.row_axis < 0) {
      os << (s.varying ? " all" : " const");
      if (s.mask_kind == 1) os << " tril";
      if (s.mask_kind == 2) os << " triu";
      if (s.mask_kind == 3) os << " ones";
    } else {
      os << " row=" << s.row_axis;
      if (s.fold != 1) os << " fold=" << s.fold;
      if (s.key_axis >= 0) os << " key=" << s.key_axis;
      if (s.causal_attention) os << " causal-attention";
      if (s.masks_upper) os << " causal-mask";
      if (s.causal_values) os << (s.mask_kind == 1 ? " upper=-inf" : " upper=0");
      if (s.mixes_key) os << " mixes-key";
    }
    if (!s.inputs.empty()) {
      os << " |";
      for (size_t i = 0; i < s.inputs.size(); ++i) {
        const auto& in = s.inputs[i];
        os << (i ? ", %" : " %") << in.node->name() << ": " << rel_name(in.rel);
        if (in.rel != SeqRel::None && in.rel != SeqRel::All) os << "@" << in.dim;
      }
    }
    os << "\n";
  }
  return os.str();
}

const char* to_string(SeqChange c) {
  switch (c) {
    case SeqChange::None: return "none";
    case SeqChange::Rows: return "rows";
    case SeqChange::Upper: return "upper";
    case SeqChange::All: return "all";
  }
  return "?";
}

std::unordered_map<const ir::Node*, SeqChange> seq_cone(const ir::Graph& graph, const SeqAxisAnalysis& a,
                                                         const ir::Node* source) {
  std::set<const Node*> forced;  // Upper nodes read whole somewhere: computed (and changed) whole
  for (;;) {
    std::unordered_map<const Node*, SeqChange> ch;
    ch[source] = a.at(source).row_axis >= 0 ? SeqChange::Rows : SeqChange::All;
    for (const auto& up : graph.nodes()) {
      const Node* n = up.get();
      if (n->kind() != ir::NodeKind::Call || n == source || n->index() < source->index()) continue;
      const SeqNode& s = a.at(n);
      SeqChange out = SeqChange::None;
      for (const auto& in : s.inputs) {
        auto it = ch.find(in.node);
        if (it == ch.end() || it->second == SeqChange::None) continue;
        SeqChange c = it->second;
        SeqChange r = SeqChange::All;
        if (s.row_axis >= 0) {
          switch (in.rel) {
            case SeqRel::Row:
              if (c == SeqChange::Rows) r = SeqChange::Rows;
              else if (c == SeqChange::Upper) r = s.masks_upper && in.node == n->inputs()[0] ? SeqChange::Rows
                                                  : s.mixes_key ? SeqChange::All : SeqChange::Upper;
              break;
            case SeqRel::Prefix: r = c == SeqChange::Rows ? SeqChange::Rows : SeqChange::All; break;
            case SeqRel::Key: r = c == SeqChange::Rows ? SeqChange::Upper : SeqChange::All; break;
            default: break;
          }
        }
        out = std::max(out, r);
      }
      if (out == SeqChange::None) continue;
      if (forced.count(n)) out = SeqChange::All;
      ch[n] = out;
    }
    // An Upper node is computed on its rows [p, T) only: every reader must take those rows alone.
    bool again = false;
    for (const auto& [n, c] : ch) {
      if (c != SeqChange::Upper) continue;
      bool whole = false;
      for (const Node* u : n->users()) {
        if (u->kind() == ir::NodeKind::Output) {
          whole = true;
          continue;
        }
        auto it = ch.find(u);
        if (it == ch.end()) continue;
        if (it->second == SeqChange::All) whole = true;
        for (const auto& in : a.at(u).inputs)
          if (in.node == n && in.rel != SeqRel::Row) whole = true;
      }
      if (whole && forced.insert(n).second) again = true;
    }
    if (!again) {
      ch.erase(source);
      return ch;
    }
  }
}

}  // namespace torch_ext::passes
