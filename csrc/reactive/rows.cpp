// Token-granular cones: the row-range fast path of the reactive engine (see engine.h,
// evaluate_patched_rows, and passes/sequence_axis.h for the analysis it relies on).
//
// Representation. During one evaluate_patched_rows call, a cone node the analysis bounds to rows
// [p, T) (change Rows or Upper) holds only its recomputed rows [start, T) along its row axis, where
// start = max(p, the first row any reader needs). A reader that needs the whole value gets the
// cached rows [0, p) joined with the recomputed ones (its need is 0, so start = p there). No cached
// tensor is written: the cone's cached values are kept aside and put back at the end, so restore
// stays free, exactly as in evaluate_patched.
#include "reactive/engine.h"
#include "reactive/max_abs.h"

#include "runtime/executor.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <limits>

namespace torch_ext::reactive {
namespace {

c10::IValue narrow_value(const c10::IValue& v, int64_t dim, int64_t from, int64_t len) {
  if (v.isTensor()) return v.toTensor().narrow(dim, from, len);
  if (v.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : v.toTensorVector()) out.push_back(t.narrow(dim, from, len));
    return out;
  }
  if (v.isTuple()) {
    std::vector<c10::IValue> out;
    for (const auto& e : v.toTupleRef().elements()) out.push_back(narrow_value(e, dim, from, len));
    return c10::ivalue::Tuple::create(std::move(out));
  }
  TORCH_CHECK(false, "token-granular cone: cannot take rows of a ", v.tagKind(), " value");
}

// Rows in blocks (passes::SeqNode::fold): a value whose dim `dim` holds `fold` blocks of rows, seen as
// [.., fold, rows, ..] (a view), and back (a view when dense, else a copy).
at::Tensor unfold_rows(const at::Tensor& t, int64_t dim, int64_t fold) {
  return fold == 1 ? t : t.unflatten(dim, {fold, t.size(dim) / fold});
}
at::Tensor refold_rows(const at::Tensor& t, int64_t dim, int64_t fold) { return fold == 1 ? t : t.flatten(dim, dim + 1); }

// Rows [from, from + len) of every block.
c10::IValue narrow_rows(const c10::IValue& v, int64_t dim, int64_t fold, int64_t from, int64_t len) {
  if (fold == 1) return narrow_value(v, dim, from, len);
  TORCH_CHECK(v.isTensor(), "token-granular cone: cannot take rows in blocks of a ", v.tagKind(), " value");
  return refold_rows(unfold_rows(v.toTensor(), dim, fold).narrow(dim + 1, from, len), dim, fold);
}

// Rows [0, p) of `cached`, NaN for rows [p, start), `suffix` for rows [start, stop), cached rows [stop, T), in
// every block (a fresh tensor).
at::Tensor join_folded(const at::Tensor& cached, const at::Tensor& suffix, int64_t dim, int64_t fold, int64_t p,
                       int64_t start, int64_t stop) {
  const at::Tensor c = unfold_rows(cached, dim, fold);
  const int64_t T = c.size(dim + 1);
  if (stop < 0 || stop > T) stop = T;
  std::vector<at::Tensor> parts;
  if (p > 0) parts.push_back(c.narrow(dim + 1, 0, p));
  if (start > p) {
    std::vector<int64_t> sizes = c.sizes().vec();
    sizes[dim + 1] = std::min(start, T) - p;
    parts.push_back(at::full(sizes, std::numeric_limits<double>::quiet_NaN(), c.options()));
  }
  if (stop > start) parts.push_back(unfold_rows(suffix, dim, fold));
  if (stop < T) parts.push_back(c.narrow(dim + 1, stop, T - stop));
  return refold_rows(at::cat(parts, dim + 1), dim, fold);
}

// max that keeps a NaN from either side (std::max drops a NaN in its second argument).
double max_keep_nan(double a, double b) {
  return std::isnan(a) || std::isnan(b) ? std::numeric_limits<double>::quiet_NaN() : std::max(a, b);
}

double largest_finite(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return std::numeric_limits<double>::max();
    case at::kHalf: return 65504.0;
    case at::kBFloat16: return 3.3895313892515355e38;
    default: return std::numeric_limits<float>::max();
  }
}

// Rows [0, p) of `cached`, NaN for rows [p, start), then `suffix` (rows [start, T)).
at::Tensor join_rows(const at::Tensor& cached, const c10::IValue& suffix, int64_t dim, int64_t p, int64_t start) {
  const int64_t T = cached.size(dim);
  std::vector<at::Tensor> parts;
  if (p > 0) parts.push_back(cached.narrow(dim, 0, p));
  if (start > p) {
    std::vector<int64_t> sizes = cached.sizes().vec();
    sizes[dim] = std::min(start, T) - p;
    parts.push_back(at::full(sizes, std::numeric_limits<double>::quiet_NaN(), cached.options()));
  }
  if (start < T) parts.push_back(suffix.toTensor());
  return parts.size() == 1 ? parts[0].contiguous() : at::cat(parts, dim);
}

c10::IValue join_value(const c10::IValue& cached, const c10::IValue& suffix, int64_t dim, int64_t p, int64_t start) {
  if (cached.isTensor()) return join_rows(cached.toTensor(), suffix, dim, p, start);
  if (cached.isTensorList()) {
    const auto cs = cached.toTensorVector();
    const auto ss = suffix.toTensorVector();
    c10::List<at::Tensor> out;
    for (size_t i = 0; i < cs.size(); ++i) out.push_back(join_rows(cs[i], ss[i], dim, p, start));
    return out;
  }
  if (cached.isTuple()) {
    const auto& cs = cached.toTupleRef().elements();
    const auto& ss = suffix.toTupleRef().elements();
    std::vector<c10::IValue> out;
    for (size_t i = 0; i < cs.size(); ++i) out.push_back(join_value(cs[i], ss[i], dim, p, start));
    return c10::ivalue::Tuple::create(std::move(out));
  }
  TORCH_CHECK(false, "token-granular cone: cannot join rows of a ", cached.tagKind(), " value");
}

// a's rows followed by b's, along `dim` (tensors, or lists/tuples of them element by element).
c10::IValue concat_rows(const c10::IValue& a, const c10::IValue& b, int64_t dim) {
  if (a.isTensor()) return at::cat({a.toTensor(), b.toTensor()}, dim);
  if (a.isTensorList()) {
    const auto as = a.toTensorVector();
    const auto bs = b.toTensorVector();
    c10::List<at::Tensor> out;
    for (size_t i = 0; i < as.size(); ++i) out.push_back(at::cat({as[i], bs[i]}, dim));
    return out;
  }
  if (a.isTuple()) {
    const auto& as = a.toTupleRef().elements();
    const auto& bs = b.toTupleRef().elements();
    std::vector<c10::IValue> out;
    for (size_t i = 0; i < as.size(); ++i) out.push_back(concat_rows(as[i], bs[i], dim));
    return c10::ivalue::Tuple::create(std::move(out));
  }
  TORCH_CHECK(false, "token-granular cone: cannot join rows of a ", a.tagKind(), " value");
}

// Whether row `row` along `axis` of two CPU tensor values differs anywhere, by the bytes of its
// elements (walked by strides: no kernel runs, no tensor is made). Equal bytes, another device, or a
// non-tensor answer false (ask changed_rows); a -0.0 against 0.0 answers true, which only costs row
// savings (the row is recomputed, to its right value).
bool row_bytes_differ(const c10::IValue& cached, const c10::IValue& now, int64_t axis, int64_t row) {
  if (!cached.isTensor() || !now.isTensor()) return false;
  const at::Tensor& a = cached.toTensor();
  const at::Tensor& b = now.toTensor();
  if (!a.is_cpu() || !b.is_cpu() || a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes() || a.numel() == 0 ||
      axis >= a.dim() || row >= a.size(axis))
    return false;
  const int64_t item = a.element_size();
  if (a.is_contiguous() && b.is_contiguous()) {  // the row is `outer` runs of `inner` elements: one memcmp each
    const int64_t T = a.size(axis);
    int64_t outer = 1;
    for (int64_t d = 0; d < axis; ++d) outer *= a.size(d);
    const int64_t inner = a.numel() / (outer * T);
    const auto* ca = static_cast<const char*>(a.const_data_ptr());
    const auto* cb = static_cast<const char*>(b.const_data_ptr());
    for (int64_t o = 0; o < outer; ++o) {
      const int64_t at_row = (o * T + row) * inner * item;
      if (std::memcmp(ca + at_row, cb + at_row, static_cast<size_t>(inner * item)) != 0) return true;
    }
    return false;
  }
  const auto* pa = static_cast<const char*>(a.const_data_ptr()) + row * a.stride(axis) * item;
  const auto* pb = static_cast<const char*>(b.const_data_ptr()) + row * b.stride(axis) * item;
  c10::SmallVector<int64_t, 8> sizes, sa, sb;  // the row's other dims (no heap allocation: asked at every site)
  for (int64_t d = 0; d < a.dim(); ++d)
    if (d != axis) sizes.push_back(a.size(d)), sa.push_back(a.stride(d) * item), sb.push_back(b.stride(d) * item);
  c10::SmallVector<int64_t, 8> index(sizes.size(), 0);
  while (true) {
    if (std::memcmp(pa, pb, item) != 0) return true;
    int64_t d = static_cast<int64_t>(sizes.size()) - 1;  // odometer over the row's elements
    for (; d >= 0; --d) {
      pa += sa[d], pb += sb[d];
      if (++index[d] < sizes[d]) break;
      pa -= sa[d] * sizes[d], pb -= sb[d] * sizes[d];
      index[d] = 0;
    }
    if (d < 0) return false;
  }
}

// The length along `dim` of a tensor value, or of the first element of a list or tuple of them (-1 otherwise).
int64_t rows_along(const c10::IValue& v, int64_t dim) {
  if (v.isTensor()) return dim < v.toTensor().dim() ? v.toTensor().size(dim) : -1;
  if (v.isTensorList()) {
    const auto l = v.toTensorList();
    return l.size() > 0 && dim < l.get(0).dim() ? l.get(0).size(dim) : -1;
  }
  if (v.isTuple()) {
    const auto& e = v.toTupleRef().elements();
    return e.empty() ? -1 : rows_along(e[0], dim);
  }
  return -1;
}

// Whether declared reads leave every row and column of the outputs read: no read row past 0, no read
// columns (row_plan_for then gives no node a need past row 0 and no columns: RowPlan::narrows is false).
bool reads_whole(const std::vector<int64_t>& read_rows, const std::vector<std::vector<int64_t>>& read_cols) {
  return std::none_of(read_rows.begin(), read_rows.end(), [](int64_t r) { return r > 0; }) &&
         std::all_of(read_cols.begin(), read_cols.end(), [](const std::vector<int64_t>& c) { return c.empty(); });
}

bool is_floating(const ir::Type& t) {
  return t.kind == ir::Type::Kind::Tensor && c10::isFloatingType(t.tensor.dtype);
}

}  // namespace

void Engine::set_positions(bool enabled, int64_t seq_dim) {
  TORCH_CHECK(seq_dim >= 0, "positions: seq_dim must be >= 0, got ", seq_dim);
  if (seq_dim != seq_dim_) {
    seq_.reset();
    clear_row_plans();
  }
  positions_ = enabled;
  seq_dim_ = seq_dim;
}

const passes::SeqAxisAnalysis& Engine::seq_analysis() {
  if (!seq_) seq_ = passes::analyze_sequence_axis(*graph_, seq_dim_);
  return *seq_;
}

int64_t Engine::seq_axis(const std::string& name) { return seq_axis_at(id_of(name)); }

int64_t Engine::seq_axis_at(int64_t id) {
  check_id(id, "seq_axis");
  if (!positions_ || states_[id].node->type().kind != ir::Type::Kind::Tensor) return -1;
  const passes::SeqNode& info = seq_analysis().at(states_[id].node);
  return info.fold == 1 ? info.row_axis : -1;
}

std::pair<int64_t, int64_t> Engine::seq_fold(const std::string& name) {
  const int64_t id = id_of(name);
  if (!positions_ || states_[id].node->type().kind != ir::Type::Kind::Tensor) return {-1, 1};
  const passes::SeqNode& info = seq_analysis().at(states_[id].node);
  return {info.row_axis, info.row_axis >= 0 ? info.fold : 1};
}

// changed_rows for dense CPU tensors of one real dtype, read in place (no temporaries, one pass at most):
// the rows are scanned from the first up to the first changed one, and from the last down to the last
// changed one, by the elements' bits as on the general path: -0.0 differs from 0.0 (1 / x, atan2, copysign
// tell them apart downstream, so such a row must be recomputed), a NaN with the same bits is unchanged.
// nullopt where it does not apply (another device or layout, a complex dtype): the general path runs.
static std::optional<std::pair<int64_t, int64_t>> changed_rows_dense(const at::Tensor& cached, const at::Tensor& now,
                                                                     int64_t axis, int64_t T, bool first_only) {
  if (!cached.is_cpu() || !now.is_cpu() || cached.scalar_type() != now.scalar_type() ||
      cached.sizes() != now.sizes() || axis < 0 || axis >= now.dim() || now.size(axis) != T ||
      !cached.is_contiguous() || !now.is_contiguous() || cached.is_complex() || cached.is_conj() || now.is_conj() ||
      cached.is_neg() || now.is_neg())
    return std::nullopt;
  int64_t outer = 1;
  for (int64_t d = 0; d < axis; ++d) outer *= now.size(d);
  const int64_t inner = now.numel() / (outer * T);
  std::pair<int64_t, int64_t> out{T, T};
  AT_DISPATCH_ALL_TYPES_AND3(at::kHalf, at::kBFloat16, at::kBool, now.scalar_type(), "changed_rows", [&] {
    const scalar_t* a = cached.const_data_ptr<scalar_t>();
    const scalar_t* b = now.const_data_ptr<scalar_t>();
    auto differs = [&](int64_t r) {
      for (int64_t o = 0; o < outer; ++o) {
        const scalar_t* x = a + (o * T + r) * inner;
        const scalar_t* y = b + (o * T + r) * inner;
        if (std::memcmp(x, y, static_cast<size_t>(inner) * sizeof(scalar_t)) != 0) return true;
      }
      return false;
    };
    int64_t first = 0;
    while (first < T && !differs(first)) ++first;
    if (first == T) return;
    if (first_only) {  // the last changed row is not asked for: no row after the first is read
      out = {first, T};
      return;
    }
    int64_t last = T - 1;
    while (last > first && !differs(last)) --last;
    out = {first, last + 1};
  });
  return out;
}

// A tensor's elements as integers of the same width (floating and complex dtypes), so that `ne` compares bits.
static at::Tensor bits_of(const at::Tensor& t) {
  const at::Tensor plain = t.resolve_conj().resolve_neg();  // a lazy conj / neg view has no plain bits
  at::Tensor real = plain.is_complex() ? at::view_as_real(plain) : plain;
  if (!c10::isFloatingType(real.scalar_type())) return real;
  switch (real.element_size()) {
    case 2: return real.view(at::kShort);
    case 4: return real.view(at::kInt);
    case 8: return real.view(at::kLong);
    default: return real.view(at::kByte);
  }
}

std::pair<int64_t, int64_t> Engine::changed_rows(int64_t id, const c10::IValue& value, bool first_only) {
  const passes::SeqNode& info = seq_analysis().at(states_[id].node);
  TORCH_CHECK(info.row_axis >= 0, "first_changed_row %", states_[id].node->name(), ": the node has no sequence axis");
  check_value_type(*states_[id].node, value);
  const at::Tensor& cached = values_[id].toTensor();
  const at::Tensor& now = value.toTensor();
  const int64_t T = info.length;
  if (now.numel() == 0) return {T, T};
  if (auto dense = changed_rows_dense(cached, now, info.row_axis, T, first_only)) return *dense;
  // By bits, as the dense path: `ne` would call -0.0 equal to 0.0 and skip a row whose downstream values
  // differ (1 / -0.0 = -inf).
  const at::Tensor changed = bits_of(now).ne(bits_of(cached)).movedim(info.row_axis, 0).reshape({T, -1}).any(1);
  const at::Tensor rows = changed.nonzero();
  if (rows.size(0) == 0) return {T, T};
  const at::Tensor ends = rows.select(1, 0).index_select(0, at::tensor({int64_t{0}, rows.size(0) - 1}).to(rows.device()))
                              .cpu();
  return {ends[0].item<int64_t>(), ends[1].item<int64_t>() + 1};
}

int64_t Engine::first_changed_row(const std::string& name, const c10::IValue& value) {
  return changed_rows(id_of(name), value, /*first_only=*/true).first;
}

const Engine::RowPlan& Engine::row_plan_for(int64_t id, const std::vector<int64_t>& read_rows,
                                            const std::vector<std::vector<int64_t>>& read_cols) {
  // Found again per node without building row_plans_'s key: a sweep's consecutive sites are on different
  // nodes, so one memo for the last node alone would miss at every site.
  RowPlanMemo& memo = row_plan_memo_[id];
  if (memo.plan != nullptr && memo.plan->pins_version == pins_version_ && memo.read_rows == read_rows &&
      memo.read_cols == read_cols)
    return *memo.plan;
  const auto key = std::make_tuple(id, read_rows, read_cols);
  auto it = row_plans_.find(key);
  if (it != row_plans_.end() && it->second.pins_version == pins_version_) {
    memo = {id, &it->second, read_rows, read_cols};
    return it->second;
  }
  const PatchPlan& plan = plan_for(id);
  const passes::SeqAxisAnalysis& a = seq_analysis();
  const ir::Node* src = states_[id].node;
  const auto changes = passes::seq_cone(*graph_, a, src);
  RowPlan rp;
  rp.pins_version = pins_version_;
  rp.source_axis = a.at(src).fold == 1 ? a.at(src).row_axis : -1;  // a folded source: whole (node-granular)
  rp.source_length = a.at(src).length;
  rp.steps.resize(plan.order.size());
  for (size_t i = 0; i < plan.order.size(); ++i) rp.pos[plan.order[i]] = i;
  for (size_t i = 0; i < plan.order.size(); ++i) {
    const NodeState& st = states_[plan.order[i]];
    const passes::SeqNode& info = a.at(st.node);
    auto c = changes.find(st.node);
    const passes::SeqChange change = c == changes.end() ? passes::SeqChange::All : c->second;
    RowStep& step = rp.steps[i];
    step.suffix = info.row_axis >= 0 && (change == passes::SeqChange::Rows || change == passes::SeqChange::Upper);
    step.row_axis = info.row_axis;
    step.length = info.length;
    step.fold = info.fold;
    const std::string& op = st.node->target().name;
    step.dense_inputs = op == "linear" || op == "matmul" || op == "mm" || op == "bmm" || op == "addmm" ||
                        op == "layer_norm" || op == "rms_norm" || op == "scaled_dot_product_attention";
    step.dense_whole = st.node->target().ns == "aten" && (op == "linear" || op == "layer_norm" || op == "rms_norm");
    if (info.causal_attention) step.special = 1;
    else if (op == "view") step.special = 2;
    else if (op == "_unsafe_view") step.special = 3;
    else if (op == "reshape") step.special = 4;
    else if (op == "expand") step.special = 5;
    // squeeze is a view whose result depends on which dims are 1: run on one row, the kernel also drops the
    // row axis (squeeze() or squeeze(row_axis) of a [b, 1, d] slice of a [b, T, d] value). Its traced sizes,
    // with the rows computed, say what it keeps: a view, as view's.
    else if (op == "squeeze") step.special = 2;
    if (st.node->target().ns == "aten") {
      if (op == "linear") step.pooled = 1;
      else if (op == "gelu") step.pooled = 2;
      else if (op == "add" && st.node->target().overload == "Tensor") step.pooled = 3;
    }
    for (int64_t slot : st.kernel->input_slots()) {
      RowInput ri;
      ri.slot = slot;
      for (const auto& in : info.inputs)
        if (in.node == states_[slot].node) {
          ri.rel = in.rel;
          ri.dim = in.dim;
          if (in.rel == passes::SeqRel::Row && a.at(in.node).row_axis >= 0) ri.fold = a.at(in.node).fold;
        }
      auto p = rp.pos.find(slot);
      ri.pos = p == rp.pos.end() ? -1 : static_cast<int64_t>(p->second);
      step.inputs.push_back(ri);
    }
    step.local = step.suffix && change == passes::SeqChange::Rows && !info.causal_attention;
    for (const RowInput& ri : step.inputs) {
      if ((ri.pos >= 0 || ri.slot == id) && ri.rel != passes::SeqRel::Row) step.local = false;
      if (op == "scaled_dot_product_attention" && ri.rel == passes::SeqRel::Prefix) step.causal_sdpa = true;
    }
  }
  // Needs, readers first: an output declared read from row r needs rows [r, T); a row-wise reader
  // passes its own need on; any other reader needs the whole value.
  constexpr int64_t kNone = std::numeric_limits<int64_t>::max();
  std::vector<int64_t> need(plan.order.size(), kNone);
  const auto& outs = graph_->output()->args()[0].list;
  for (size_t k = 0; k < outs.size(); ++k) {
    if (outs[k].kind != ir::Arg::Kind::Node) continue;
    auto p = rp.pos.find(ids_.at(outs[k].node));
    if (p == rp.pos.end()) continue;
    const RowStep& step = rp.steps[p->second];
    const bool partial = k < read_rows.size() && read_rows[k] >= 0 && step.suffix && step.fold == 1 &&
                         is_floating(outs[k].node->type());
    need[p->second] = std::min(need[p->second], partial ? std::min(read_rows[k], step.length) : int64_t{0});
  }
  for (size_t i = plan.order.size(); i-- > 0;) {
    RowStep& step = rp.steps[i];
    step.need = need[i] == kNone ? 0 : need[i];
    for (const RowInput& ri : step.inputs) {
      if (ri.pos < 0) continue;
      const bool pass_on = step.suffix && ri.rel == passes::SeqRel::Row && rp.steps[ri.pos].suffix;
      need[ri.pos] = std::min(need[ri.pos], pass_on ? step.need : int64_t{0});
    }
  }
  // Read columns of an output computed by linear(x, W[, b]) or matmul(x, W) with a constant 2-D
  // weight and read by nothing but the output: only those columns are computed.
  for (size_t k = 0; k < outs.size() && k < read_cols.size(); ++k) {
    if (read_cols[k].empty() || outs[k].kind != ir::Arg::Kind::Node) continue;
    const ir::Node* o = outs[k].node;
    auto p = rp.pos.find(ids_.at(o));
    if (p == rp.pos.end()) continue;
    RowStep& step = rp.steps[p->second];
    const std::string& op = o->target().name;
    if (!step.suffix || step.special != 0 || step.fold != 1 || !(op == "linear" || op == "matmul") || o->args().size() < 2 ||
        o->args()[1].kind != ir::Arg::Kind::Node || !is_floating(o->type()))
      continue;
    const ir::Node* w = o->args()[1].node;
    if (rp.pos.count(ids_.at(w)) || w->type().kind != ir::Type::Kind::Tensor || w->type().tensor.sizes.size() != 2 ||
        (o->args().size() > 2 && o->args()[2].kind == ir::Arg::Kind::Node && rp.pos.count(ids_.at(o->args()[2].node))))
      continue;
    bool only_output = true;
    for (const ir::Node* u : o->users()) only_output = only_output && u->kind() == ir::NodeKind::Output;
    if (!only_output) continue;
    step.width = o->type().tensor.sizes.back();
    for (int64_t c : read_cols[k]) {
      TORCH_CHECK(c >= -step.width && c < step.width, "reads: column ", c, " of output %", o->name(), " is out of range ",
                  "(its last dim has ", step.width, ")");
      step.cols.push_back(c < 0 ? c + step.width : c);
    }
    step.special = op == "linear" ? 6 : 7;
    step.cols_index = at::tensor(step.cols, at::TensorOptions().dtype(at::kLong)).to(w->type().tensor.device);
  }
  // Join once where q, k and v come from one projection: a suffix node (need 0, not an output) whose every
  // reader is a view chain (split, getitem, reshape, view, transpose, permute) ending only in causal
  // attention is joined whole where it is computed (whole 1), and the views run whole on it (whole 2), so
  // attention reads views of one joined buffer, laid out as in a full run, instead of three joins.
  {
    auto is_view = [](const ir::Node* u) {
      if (u->target().is_getitem()) return true;
      const std::string& op = u->target().name;
      return u->target().ns == "aten" && (op == "split" || op == "split_with_sizes" || op == "reshape" ||
                                          op == "view" || op == "_unsafe_view" || op == "transpose" ||
                                          op == "permute");
    };
    for (size_t i = 0; i < plan.order.size(); ++i) {
      RowStep& step = rp.steps[i];
      const ir::Node* node = states_[plan.order[i]].node;
      if (!step.suffix || step.special != 0 || step.need != 0 || step.whole != 0 || step.row_axis < 0 ||
          node->type().kind != ir::Type::Kind::Tensor || is_view(node))
        continue;
      std::vector<size_t> views;
      bool ok = !node->users().empty();
      bool reaches_attention = false;
      std::vector<const ir::Node*> todo(node->users().begin(), node->users().end());
      while (ok && !todo.empty()) {
        const ir::Node* u = todo.back();
        todo.pop_back();
        auto p = u->kind() == ir::NodeKind::Output ? rp.pos.end() : rp.pos.find(ids_.at(u));
        if (p == rp.pos.end()) {
          ok = false;
          break;
        }
        const RowStep& su = rp.steps[p->second];
        if (su.special == 1 && su.suffix) {
          reaches_attention = true;
          continue;
        }
        if (!is_view(u) || !su.suffix || su.whole != 0 || su.special >= 5) {
          ok = false;
          break;
        }
        views.push_back(p->second);
        todo.insert(todo.end(), u->users().begin(), u->users().end());
      }
      if (!ok || !reaches_attention) continue;
      step.whole = 1;
      for (size_t v : views) rp.steps[v].whole = 2;
    }
  }
  rp.narrows = std::any_of(rp.steps.begin(), rp.steps.end(),
                           [](const RowStep& st) { return st.need > 0 || !st.cols.empty(); });
  RowPlan& stored = row_plans_[key] = std::move(rp);
  row_plan_memo_[id] = {id, &stored, read_rows, read_cols};  // found anew: nothing above may keep `memo`
  return stored;
}

at::Tensor Engine::assemble_rows(int64_t id, const at::Tensor& cached, const at::Tensor& suffix, int64_t dim, int64_t p,
                                 int64_t start, const std::vector<int64_t>& cols, const at::Tensor& cols_index,
                                 int64_t stop) {
  const int64_t T = cached.size(dim);
  if (stop < 0 || stop > T) stop = T;
  TORCH_INTERNAL_ASSERT(cols.empty() || stop == T, "assemble_rows: columns with cached rows after the suffix");
  RowScratch& sc = row_scratch_[id];
  // Inference tensors have no version counter, so a write into them could not be seen: never reuse.
  const bool reuse = sc.buf.defined() && !sc.buf.is_inference() &&
                     sc.buf.use_count() == 1 && sc.buf.storage().use_count() == 1 && version_of(sc.buf) == sc.version &&
                     sc.source.is(cached);
  if (!reuse) {
    // The cached value's strides where they are dense (a transposed view): a whole reader (a train-mode
    // batch norm, a reduction) then reads the layout a full run hands it, so it sums in the same order.
    sc.buf = at::empty_like(cached, at::MemoryFormat::Preserve);
    sc.state.assign(T, 0);
    sc.source.set(cached);
    sc.cols.clear();
  }
  // Brings rows [a, b) to state `want`, filling only the runs of rows not already in it.
  auto ensure = [&](int64_t a, int64_t b, uint8_t want, auto&& fill) {
    for (int64_t r = a; r < b;) {
      if (sc.state[r] == want) {
        ++r;
        continue;
      }
      int64_t e = r;
      while (e < b && sc.state[e] != want) ++e;
      fill(sc.buf.narrow(dim, r, e - r), r, e);
      std::fill(sc.state.begin() + r, sc.state.begin() + e, want);
      r = e;
    }
  };
  const double nan = std::numeric_limits<double>::quiet_NaN();
  ensure(0, std::min(p, T), 1, [&](at::Tensor dst, int64_t a, int64_t b) { dst.copy_(cached.narrow(dim, a, b - a)); });
  ensure(p, std::min(start, T), 2, [&](at::Tensor dst, int64_t, int64_t) { dst.fill_(nan); });
  if (start < T) {
    if (!cols.empty()) {
      at::Tensor dst = sc.buf.narrow(dim, start, T - start);
      if (sc.cols != cols) {  // rows NaN but for other columns
        for (auto& st : sc.state)
          if (st == 3) st = 0;
        sc.cols = cols;
      }
      ensure(start, T, 3, [&](at::Tensor d, int64_t, int64_t) { d.fill_(nan); });
      dst.index_copy_(dst.dim() - 1, cols_index, suffix);
    } else if (stop > start) {
      sc.buf.narrow(dim, start, stop - start).copy_(suffix);
      std::fill(sc.state.begin() + start, sc.state.begin() + stop, 4);
    }
    ensure(std::max(start, stop), T, 1,
           [&](at::Tensor d, int64_t a, int64_t b) { d.copy_(cached.narrow(dim, a, b - a)); });
  }
  sc.version = version_of(sc.buf);
  return sc.buf;
}

std::vector<c10::IValue> Engine::evaluate_patched_rows(const std::string& name, c10::IValue value,
                                                       const std::vector<int64_t>& read_rows,
                                                       const std::vector<std::vector<int64_t>>& read_cols) {
  return evaluate_patched_rows_at(id_of(name), std::move(value), read_rows, read_cols);
}

std::vector<c10::IValue> Engine::evaluate_patched_rows_at(int64_t id, c10::IValue value,
                                                          const std::vector<int64_t>& read_rows,
                                                          const std::vector<std::vector<int64_t>>& read_cols) {
  check_id(id, "evaluate_patched_rows");
  const std::string& name = states_[id].node->name();
  take_written_inputs("evaluate_patched_rows");  // the caller's patch function ran since the last read
  settle_pending();              // settle() without scanning the inputs again
  TORCH_CHECK(positions_, "evaluate_patched_rows %", name, ": positions are off (set_positions(true) first)");
  TORCH_CHECK(pinned_.empty(), "evaluate_patched_rows %", name, ": standing patches are active at ", pinned_.size(),
              " nodes; use evaluate_patched or patch()/demand()");
  TORCH_CHECK(has_run_ && dirty_.empty() && !txn_, "evaluate_patched_rows %", name,
              ": needs a graph that has run, with nothing stale and no open transaction");
  check_value_type(*states_[id].node, value);
  // Whole or rows, decided before any row bookkeeping where the reads cannot narrow the cone (no read row
  // past 0, no read columns: RowPlan::narrows is false whatever the plan) and the patch changes the source's
  // first and last rows (by their bytes): every cone node then runs on rows [0, T), which is the whole-cone
  // evaluation taken below after the plan's lookup, here without it (a sweep's consecutive sites are on
  // different nodes). Same kernels, same bits, same count.
  if (reads_whole(read_rows, read_cols)) {
    const passes::SeqNode& info = seq_analysis().at(states_[id].node);
    if (info.row_axis >= 0 && row_bytes_differ(values_[id], value, info.row_axis, 0) &&
        row_bytes_differ(values_[id], value, info.row_axis, info.length - 1)) {
      check_intact(id);
      return evaluate_cone_whole(id, std::move(value));
    }
  }
  const RowPlan& rp = row_plan_for(id, read_rows, read_cols);
  TORCH_CHECK(rp.source_axis >= 0 || !cutoff_, "evaluate_patched_rows %", name,
              ": the node has no sequence axis and early cutoff is on; use patch()/demand()");
  if (rp.source_axis < 0) return evaluate_patched_at(id, std::move(value));
  check_intact(id);
  // A value in another layout changes every row's inputs (a row's reduction reads it in another order), so
  // no row is the cached one: the whole cone, on the kernels eager runs (evaluate_cone_whole).
  if (other_layout(id, value)) return evaluate_cone_whole(id, std::move(value));
  // Rows 0 and T-1 changed (by their bytes), so rows [0, T), with no read rows or columns
  // declared: every node runs whole, local ones included, and that is a whole-cone
  // evaluation, whose kernels (and loop) are exactly those of a full recompute. Taken with cutoff on or
  // off alike (cutoff does not act inside a cone on either path), so the two give the same bits.
  const bool narrows = rp.narrows;
  if (!narrows && row_bytes_differ(values_[id], value, rp.source_axis, 0) &&
      row_bytes_differ(values_[id], value, rp.source_axis, rp.source_length - 1))
    return evaluate_cone_whole(id, std::move(value));
  const auto [p, src_hi] = changed_rows(id, value);
  if (p >= rp.source_length && cutoff_) {
    // Early cutoff at the site: the value equals the cached one, so nothing downstream changes and
    // the outputs are the cached ones; every cone node is cut off without running.
    stats_.cutoffs += static_cast<int64_t>(plan_for(id).order.size());
    std::vector<c10::IValue> outs = runtime::output_values(
        graph_->output()->args()[0].list, [&](const ir::Node* n) -> const c10::IValue& { return values_[ids_.at(n)]; });
    return outs;
  }
  // A value equal to the cached one changes no row: its cone runs whole, as in evaluate_patched, so
  // the outputs are the cached ones bit for bit and the patch still costs |V+(s)| evaluations.
  if (p >= rp.source_length || (p == 0 && src_hi >= rp.source_length && !narrows))
    return evaluate_cone_whole(id, std::move(value));
  // Early cutoff does not act inside a row-range cone (a recomputed row range rarely equals the
  // cached one): with cutoff on or off, a changed value takes this same path, so the two give the
  // same bits.
  const PatchPlan& plan = plan_for(id);
  const auto& out_args = graph_->output()->args()[0].list;
  // Kept for the whole-cone fallback below (one more reference, no copy).
  const c10::IValue patched = value;
  bool spreads_non_finite = false;
  std::vector<c10::IValue> result;
  {
  HeldCone held(*this, id, plan, std::move(value));  // the cone's cached values, put back at the end
  // Suffix values written into reused memory (row_buffers.h); off with the scratch, for fresh allocations.
  RowBufferPool* pool = scratch_enabled_ ? row_pool_.get() : nullptr;
  std::vector<int64_t> start(plan.order.size(), 0);
  std::vector<c10::IValue> joined(plan.order.size());  // a cone node's whole value, assembled once
  std::vector<int64_t> hi(plan.order.size(), 0);        // rows [p, hi[i]) of a cone node can differ
  // A suffix node's value holds its rows [start[i], end[i]). A local node keeps only the rows it computed
  // (end = hi < T): its cached rows [hi, T) are joined on once, when a reader first needs them, so a chain
  // of local nodes (norm, qkv projection, split, q/k/v reshapes) concatenates once instead of at every node.
  std::vector<int64_t> end(plan.order.size(), 0);
  // The cached rows [from, T) of cone node k (the read columns alone for a columns-only output).
  auto cached_tail = [&](size_t k, int64_t from) {
    const RowStep& sk = rp.steps[k];
    c10::IValue tail = narrow_rows(held.cached(k), sk.row_axis, sk.fold, from, sk.length - from);
    if (!sk.cols.empty()) tail = tail.toTensor().index_select(tail.toTensor().dim() - 1, sk.cols_index);
    return tail;
  };
  auto complete = [&](size_t k) {
    const RowStep& sk = rp.steps[k];
    if (!sk.suffix || end[k] >= sk.length) return;
    const int64_t slot = plan.order[k];
    values_[slot] = sk.fold == 1 ? concat_rows(values_[slot], cached_tail(k, end[k]), sk.row_axis)
                                 : c10::IValue(refold_rows(at::cat({unfold_rows(values_[slot].toTensor(), sk.row_axis, sk.fold),
                                                                    unfold_rows(cached_tail(k, end[k]).toTensor(), sk.row_axis, sk.fold)},
                                                                   sk.row_axis + 1),
                                                           sk.row_axis, sk.fold));
    end[k] = sk.length;
  };
  // Inputs replaced by their rows for one node, put back before `held` puts the cone back.
  std::vector<std::pair<int64_t, c10::IValue>> swapped;
  auto put_inputs_back = [&]() {
    for (auto it = swapped.rbegin(); it != swapped.rend(); ++it) values_[it->first] = std::move(it->second);
    swapped.clear();
  };
  std::vector<c10::IValue> outs;
  try {
    for (size_t i = 0; i < plan.order.size(); ++i) {
      const RowStep& step = rp.steps[i];
      const int64_t n = plan.order[i];
      NodeState& st = states_[n];
      const int64_t T = step.length;
      const int64_t s = step.suffix ? std::max(p, step.need) : 0;
      start[i] = s;
      end[i] = T;
      int64_t e = T;  // rows [s, e) are computed; rows [e, T) are the cached ones
      if (step.local) {
        e = 0;
        for (const RowInput& ri : step.inputs) {
          if (ri.pos >= 0) e = std::max(e, hi[ri.pos]);
          else if (ri.slot == id) e = std::max(e, src_hi);
        }
        e = std::min(e, T);
      }
      hi[i] = e;
      if (step.whole == 2) {
        // A view in a chain read whole by causal attention (RowStep::whole): run on the whole value it
        // views, counted as the rows the row path would have computed of it.
        c10::IValue out;
        try {
          out = step.special == 2 || step.special == 3
                    ? c10::IValue(values_[ids_.at(st.node->args().at(0).node)].toTensor().reshape(st.node->type().tensor.sizes))
                    : st.kernel->invoke(values_, stack_);
        } catch (const std::exception& ex) {
          rethrow_evaluating(st, ex, std::string(" whole, in a row-range recompute"));
        }
        values_[n] = std::move(out);
        start[i] = 0;
        end[i] = T;
        if (s < T) count_evaluation(st, s >= e ? 0 : e - s, T);
        for (int64_t r : plan.steps[i].release) values_[r] = c10::IValue();
        continue;
      }
      if (step.whole == 1 && s >= e) {  // no row differs from the cached ones: the cached value, whole
        values_[n] = held.cached(i);
        end[i] = T;
        count_evaluation(st, 0, T);
        for (int64_t r : plan.steps[i].release) values_[r] = c10::IValue();
        continue;
      }
      if (step.suffix && s >= T) {  // no reader needs any of its rows
        values_[n] = c10::IValue();
        continue;
      }
      if (step.suffix && s >= e) {  // none of the rows read differ from the cached ones
        values_[n] = cached_tail(i, s);
        count_evaluation(st, 0, T);
        for (int64_t r : plan.steps[i].release) values_[r] = c10::IValue();
        continue;
      }
      // A causal SDPA (is_causal, no mask) whose rows are all needed from p on runs its own kernel on whole
      // inputs (below), the full run's call; one read from a later row (reads=) runs on its rows alone.
      const bool whole_sdpa = step.suffix && step.special == 1 && s == p;
      // Also for whole_sdpa: a NaN or inf in the changed key / value rows reaches rows before p through a
      // full kernel (0 * NaN), which the row path keeps cached.
      if (step.suffix && step.causal_sdpa && attention_may_overflow(step, st, held, rp, p)) {
        spreads_non_finite = true;
        break;
      }
      for (const RowInput& ri : step.inputs) {
        const bool in_suffix = ri.pos >= 0 && rp.steps[ri.pos].suffix && rp.steps[ri.pos].whole == 0;
        c10::IValue repl;
        if (step.suffix && ri.rel == passes::SeqRel::Row && !whole_sdpa) {
          const int64_t from = in_suffix ? s - start[ri.pos] : s;
          if (in_suffix && end[ri.pos] < e) complete(ri.pos);  // rows past the ones it computed are read
          if (from == 0 && in_suffix && rows_along(values_[ri.slot], ri.dim) == ri.fold * (e - s)) {
            // Its rows as they are. A strided one (a view of rows of a whole value, such as attention's
            // output narrowed, transposed and reshaped) is what linear and the norms copy densely
            // themselves (linear then runs matmul and add_, not the fused addmm a full run's dense input
            // gets): the copy goes to pooled memory, and linear takes run_pooled's addmm, a full run's call.
            const c10::IValue& v = values_[ri.slot];
            if (!step.dense_whole || !v.isTensor() || v.toTensor().dim() < 3 || v.toTensor().is_contiguous()) continue;
            repl = pooled_contiguous(v.toTensor(), pool);
            swapped.emplace_back(ri.slot, std::move(values_[ri.slot]));
            values_[ri.slot] = std::move(repl);
            continue;
          }
          repl = narrow_rows(values_[ri.slot], ri.dim, ri.fold, from, e - s);
          // A strided slice makes BLAS and the norm kernels take slow paths: give them dense rows.
          if (step.dense_inputs && repl.isTensor() && !repl.toTensor().is_contiguous())
            repl = pooled_contiguous(repl.toTensor(), pool);
        } else if (in_suffix) {
          TORCH_INTERNAL_ASSERT(start[ri.pos] == p, "token-granular cone: %", states_[ri.slot].node->name(),
                                " is read whole but was computed from row ", start[ri.pos]);
          if (joined[ri.pos].isNone()) {
            complete(ri.pos);
            // Row i of a prefix reader (causal attention, a causal-weights matmul) multiplies the rows
            // after i by zero weights. A full kernel turns 0 * NaN or 0 * inf into NaN in the rows before
            // p, which the row path keeps cached: with a non-finite value in the changed rows, the cone runs
            // whole instead, so the sweep gives what a full recompute gives. (Causal SDPA was checked before
            // its inputs were taken: attention_may_overflow also sees a NaN or inf.)
            if (ri.rel == passes::SeqRel::Prefix && !step.causal_sdpa && values_[ri.slot].isTensor()) {
              const at::Tensor& changed = values_[ri.slot].toTensor();
              if (at::isFloatingType(changed.scalar_type()) && !changed.isfinite().all().item<bool>()) {
                spreads_non_finite = true;
                break;
              }
            }
            const c10::IValue& cached = held.cached(ri.pos);
            const RowStep& from = rp.steps[ri.pos];
            joined[ri.pos] = from.fold != 1 ? c10::IValue(join_folded(cached.toTensor(), values_[ri.slot].toTensor(),
                                                                      from.row_axis, from.fold, p, p, -1))
                           : cached.isTensor() ? c10::IValue(assemble_rows(ri.slot, cached.toTensor(), values_[ri.slot].toTensor(),
                                                                          rp.steps[ri.pos].row_axis, p, p, {}, {}))
                                               : join_value(cached, values_[ri.slot], rp.steps[ri.pos].row_axis, p, p);
          }
          repl = joined[ri.pos];
        } else if (ri.pos >= 0 && rp.steps[ri.pos].whole == 2 && step.special == 1 && !whole_sdpa &&
                   values_[ri.slot].isTensor() && !values_[ri.slot].toTensor().is_contiguous()) {
          repl = values_[ri.slot].toTensor().contiguous();  // the masked call reads dense keys and values
        } else {
          continue;
        }
        swapped.emplace_back(ri.slot, std::move(values_[ri.slot]));
        values_[ri.slot] = std::move(repl);
      }
      if (spreads_non_finite) {
        put_inputs_back();
        break;
      }
      c10::IValue out;
      try {
        const ir::Node& node = *st.node;
        auto arg_value = [&](size_t k) -> const c10::IValue& { return values_[ids_.at(node.args().at(k).node)]; };
        if (whole_sdpa) {
          // Causal SDPA on whole queries, keys and values, rows [p, T) of its result kept. Row i of a causal
          // attention reads query row i and key / value rows [0, i] only, so those rows are the full
          // recompute's, bit for bit (same kernel, same inputs; a non-finite input ran the cone whole above),
          // where the masked call below gives other bits. On short sequences the whole kernel costs about
          // what the masked one does on the suffix.
          const c10::IValue whole = st.kernel->invoke(values_, stack_);
          out = narrow_value(whole, step.row_axis, s, T - s);
        } else if (step.suffix && step.special == 1) {
          // Query rows [s, T) against every key and value: row i may read keys j <= s + i. SDPA's own
          // is_causal aligns top-left when Lq != Lk, so the offset goes into an explicit mask.
          const at::Tensor& q = arg_value(0).toTensor();
          const at::Tensor& k = arg_value(1).toTensor();
          const at::Tensor& v = arg_value(2).toTensor();
          const auto lk = k.size(-2);
          // Additive, as SDPA turns a boolean mask into (0 where allowed, -inf elsewhere) itself.
          const auto key = std::make_tuple(s, T, lk, static_cast<int>(q.scalar_type()),
                                           static_cast<int>(q.device().type()) * 1024 + q.device().index());
          at::Tensor& mask = sdpa_masks_[key];
          if (!mask.defined()) {
            auto idx = at::TensorOptions().dtype(at::kLong).device(q.device());
            const at::Tensor allowed = at::arange(lk, idx).unsqueeze(0) <= at::arange(s, T, idx).unsqueeze(1);
            mask = at::zeros(allowed.sizes(), q.options()).masked_fill_(allowed.logical_not(),
                                                                          -std::numeric_limits<double>::infinity());
          }
          std::optional<double> scale;
          const ir::Arg* sc = node.args().size() > 6 ? &node.args()[6] : node.kwarg("scale");
          if (sc != nullptr && sc->kind == ir::Arg::Kind::Float) scale = sc->f;
          // Grouped-query attention (fewer key / value heads, shared inside the kernel) as the node runs it.
          const ir::Arg* gqa = node.args().size() > 7 ? &node.args()[7] : node.kwarg("enable_gqa");
          const bool enable_gqa = gqa != nullptr && gqa->kind == ir::Arg::Kind::Bool && gqa->i;
          out = at::scaled_dot_product_attention(q, k, v, mask, 0.0, false, scale, enable_gqa);
        } else if (step.suffix && step.special >= 6) {
          // Only the read columns of the output: the weight's rows (linear) or columns (matmul) picked.
          const at::Tensor& x = arg_value(0).toTensor();
          const at::Tensor& w = arg_value(1).toTensor();
          const at::Tensor& idx = step.cols_index;
          at::Tensor small;
          if (step.special == 6) {
            std::optional<at::Tensor> b;
            if (node.args().size() > 2 && node.args()[2].kind == ir::Arg::Kind::Node)
              b = arg_value(2).toTensor().index_select(0, idx);
            small = at::linear(x, w.index_select(0, idx), b);
          } else {
            // A transposed weight (x @ W.t()): pick rows of W itself, index_select along a strided dim is slow.
            const at::Tensor picked = w.stride(0) < w.stride(1) ? w.t().index_select(0, idx).t() : w.index_select(1, idx);
            small = at::matmul(x, picked);
          }
          out = small;  // only the read columns: the output is assembled below (read by nothing else)
        } else if (step.suffix && step.special >= 2) {
          std::vector<int64_t> sizes = node.type().tensor.sizes;
          sizes[step.row_axis] = step.fold * (e - s);
          const at::Tensor& x = arg_value(0).toTensor();
          out = step.special == 5 ? x.expand(sizes) : step.special == 4 ? pooled_reshape(x, sizes, pool) : x.reshape(sizes);
        } else if (!step.suffix && (step.special == 2 || step.special == 3)) {
          // A whole view of a value computed here from joined rows, whose strides can differ from a full
          // run's (a kernel fed other strides lays its output out otherwise): a view may not fit them.
          // reshape gives the same values, and is the view wherever one fits.
          out = arg_value(0).toTensor().reshape(node.type().tensor.sizes);
        } else {
          at::Tensor pooled;
          if (pool != nullptr && step.suffix && step.pooled != 0) pooled = run_pooled(step, node, *pool);
          out = pooled.defined() ? c10::IValue(std::move(pooled)) : st.kernel->invoke(values_, stack_);
        }
      } catch (const std::exception& e) {
        rethrow_evaluating(st, e, step.suffix ? " on rows [" + std::to_string(s) + ", " + std::to_string(T) + ")"
                                              : std::string(" whole, in a row-range recompute"));
      }
      put_inputs_back();
      if (step.whole == 1) {  // rows [s, e) joined with the cached ones, once, where they are computed
        const c10::IValue& cached = held.cached(i);
        TORCH_INTERNAL_ASSERT(cached.isTensor() && out.isTensor() && s == p, "token-granular cone: %", st.node->name(),
                              " joined where computed needs tensor rows from the first changed one");
        out = step.fold != 1 ? join_folded(cached.toTensor(), out.toTensor(), step.row_axis, step.fold, s, s, e)
                             : assemble_rows(n, cached.toTensor(), out.toTensor(), step.row_axis, s, s, {}, {}, e);
      }
      values_[n] = std::move(out);
      end[i] = step.whole == 1 ? T : e;  // e < T: a local node, its cached rows [e, T) joined on when read (complete)
      const double col_frac = step.cols.empty() ? 1.0 : static_cast<double>(step.cols.size()) / static_cast<double>(step.width);
      if (step.suffix) {
        count_evaluation(st, e - s, T, col_frac);
      } else {
        count_evaluation(st, 1, 1, col_frac);
      }
      for (int64_t r : plan.steps[i].release) values_[r] = c10::IValue();  // last use: free, as the executor does
    }
    // Outputs computed on a suffix: cached rows [0, p), NaN for rows no declared read reaches, new rows.
    for (const ir::Arg& a : out_args) {
      if (spreads_non_finite) break;
      if (a.kind != ir::Arg::Kind::Node) continue;
      const int64_t o = ids_.at(a.node);
      auto pos = rp.pos.find(o);
      if (pos == rp.pos.end() || !rp.steps[pos->second].suffix || rp.steps[pos->second].whole != 0) continue;
      const size_t i = pos->second;
      if (std::any_of(swapped.begin(), swapped.end(), [&](const auto& e) { return e.first == o; })) continue;
      complete(i);
      swapped.emplace_back(o, std::move(values_[o]));
      const c10::IValue& cached = held.cached(i);
      const c10::IValue& suffix = swapped.back().second;
      if (!joined[i].isNone()) {
        values_[o] = joined[i];
      } else if (rp.steps[i].fold != 1) {
        values_[o] = join_folded(cached.toTensor(), suffix.toTensor(), rp.steps[i].row_axis, rp.steps[i].fold, p,
                                 start[i], -1);
      } else if (cached.isTensor()) {
        values_[o] = assemble_rows(o, cached.toTensor(), suffix.isTensor() ? suffix.toTensor() : at::Tensor(),
                                   rp.steps[i].row_axis, p, start[i], rp.steps[i].cols, rp.steps[i].cols_index);
      } else {
        values_[o] = join_value(cached, suffix, rp.steps[i].row_axis, p, start[i]);
      }
    }
    if (!spreads_non_finite)
      outs = runtime::output_values(out_args, [&](const ir::Node* n) -> const c10::IValue& { return values_[ids_.at(n)]; });
  } catch (...) {
    put_inputs_back();
    throw;
  }
  put_inputs_back();
  result = std::move(outs);
  }  // `held` puts the cone's cached values back
  // The row path's evaluations so far stay in the ledger: they ran.
  if (spreads_non_finite) return evaluate_cone_whole(id, patched);
  return result;
}

double Engine::cached_max_abs(int64_t slot, const at::Tensor& cached) {
  CleanMax& c = clean_max_[slot];
  if (c.source.is(cached)) return c.max_abs;
  c.max_abs = max_abs(cached);
  c.source.set(cached);
  return c.max_abs;
}

// A full causal kernel and the row path mask differently: SDPA's is_causal never computes (or overwrites)
// the scores above the diagonal, the row path adds -inf to them, and a boolean mask is added as -inf by
// SDPA itself. A score that overflows to +inf then gives inf - inf = NaN on one side and not on the other
// (rows >= p on the row path, rows < p of a full kernel under a boolean mask). So the row path runs only
// when no score can overflow: |q . k| * max(1, scale) <= D * max|q| * max|k| * max(1, scale) stays below
// half the dtype's largest finite value (in any summation order), and so does every value of v (the
// output is a convex combination of v's rows). Each maximum covers every row either side reads: the
// rows this site recomputed and the cached ones. A NaN or inf anywhere also runs the cone whole.
bool Engine::attention_may_overflow(const RowStep& step, const NodeState& st, const HeldCone& held, const RowPlan& rp,
                                    int64_t p) {
  const ir::Node& node = *st.node;
  auto largest = [&](size_t arg) -> double {
    const int64_t slot = ids_.at(node.args().at(arg).node);
    const c10::IValue& now = values_[slot];
    const RowInput* in = nullptr;
    for (const RowInput& ri : step.inputs)
      if (ri.slot == slot) in = &ri;
    if (in != nullptr && in->pos >= 0) {  // a cone node: the rows it recomputed, and its cached value
      const RowStep& from = rp.steps[static_cast<size_t>(in->pos)];
      double fresh = 0.0;
      if (now.isTensor()) {
        // A whole value (RowStep::whole): its rows before p are cached ones, covered by the cached maximum.
        const at::Tensor& t = now.toTensor();
        fresh = max_abs(from.whole != 0 && from.row_axis >= 0 && p < t.size(from.row_axis)
                            ? t.narrow(from.row_axis, p, t.size(from.row_axis) - p)
                            : t);
      }
      const c10::IValue& cached = held.cached(static_cast<size_t>(in->pos));
      return max_keep_nan(fresh, cached.isTensor() ? cached_max_abs(slot, cached.toTensor()) : 0.0);
    }
    return now.isTensor() ? cached_max_abs(slot, now.toTensor()) : 0.0;  // whole: clean, or the patched value
  };
  const at::Tensor& q = values_[ids_.at(node.args().at(0).node)].toTensor();
  const double head_dim = static_cast<double>(q.size(-1));
  double scale = 1.0 / std::sqrt(head_dim);
  const ir::Arg* sc = node.args().size() > 6 ? &node.args()[6] : node.kwarg("scale");
  if (sc != nullptr && sc->kind == ir::Arg::Kind::Float) scale = sc->f;
  const double limit = 0.5 * largest_finite(q.scalar_type());
  const double scores = head_dim * largest(0) * largest(1) * std::max(1.0, std::abs(scale));
  const double values = largest(2);
  return !(scores < limit) || !(values < limit);  // false for NaN too
}

}  // namespace torch_ext::reactive
