// batch_layout: see batch_layout.h. Pure functions of sizes, dims and an op's arguments.
#include "passes/batch_layout.h"

#include "ir/args.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <optional>
#include <set>

namespace torch_ext::passes::batch_layout {

const ir::TensorMeta* first_tensor(const ir::Type& t) {
  if (t.is_tensor()) return &t.tensor;
  if (t.kind == ir::Type::Kind::Tuple)
    for (const ir::Type& e : t.elems)
      if (e.is_tensor()) return &e.tensor;
  return nullptr;
}

Layout whole_chunks(const ir::Type& t, int64_t b) { return {b, first_tensor(t)->sizes.at(b)}; }

std::string layout_text(const Layout& l, const ir::Type& t) {
  std::string s = "dim " + std::to_string(l.b);
  const ir::TensorMeta* m = first_tensor(t);
  if (m != nullptr && l.b < static_cast<int64_t>(m->sizes.size()) && m->sizes[l.b] != l.in)
    s += " (every " + std::to_string(l.in) + " rows)";
  return s;
}

std::vector<Layout> view_layouts(const std::vector<int64_t>& in_sizes, Layout l, const std::vector<int64_t>& out,
                                 const std::string& w) {
  int64_t inner = l.in;
  for (size_t d = l.b + 1; d < in_sizes.size(); ++d) inner *= in_sizes[d];
  for (int64_t s : out) TORCH_CHECK(s > 0, "batch_cone: ", w, " has an empty output, which the pass does not batch");
  std::vector<Layout> valid;
  for (size_t d = 0; d < out.size(); ++d) {
    int64_t after = 1;
    for (size_t e = d + 1; e < out.size(); ++e) after *= out[e];
    if (inner % after != 0) continue;
    const int64_t q = inner / after;
    if (q >= 1 && out[d] % q == 0) valid.push_back({static_cast<int64_t>(d), q});
  }
  TORCH_CHECK(!valid.empty(), "batch_cone: ", w, " reshapes dim ", l.b, ", where the stacked sites are, so that they no "
              "longer stay apart in one dim of its output");
  std::vector<Layout> order;
  const auto add = [&](const Layout& c) {
    if (std::find(order.begin(), order.end(), c) == order.end()) order.push_back(c);
  };
  if (static_cast<int64_t>(out.size()) > l.b && std::equal(in_sizes.begin(), in_sizes.begin() + l.b + 1, out.begin()))
    for (const Layout& c : valid)
      if (c == l) add(c);
  for (auto it = valid.rbegin(); it != valid.rend(); ++it)
    if (it->in == out[it->b]) add(*it);
  for (const Layout& c : valid) add(c);
  return order;
}

Layout out_layout(const ir::Node& n, const std::string& op, Layout l, const std::vector<int64_t>& in_sizes, int64_t R,
                  bool x_by_matrix, unsigned stacked_args, const std::string& w, const LayoutChoice& choose) {
  const int64_t r = static_cast<int64_t>(in_sizes.size());
  const int64_t b = l.b;
  const auto need = [&](bool ok, const char* why) {
    TORCH_CHECK(ok, "batch_cone: ", w, " has the stacked sites on dim ", b, ", ", why, ", which mixes them");
  };
  static const std::set<std::string> dim0_only = {
      "mm", "addmm", "conv1d", "conv2d", "conv3d", "convolution", "max_pool1d", "max_pool2d", "avg_pool1d",
      "avg_pool2d", "adaptive_avg_pool1d", "adaptive_avg_pool2d", "_adaptive_avg_pool2d", "batch_norm",
      "_native_batch_norm_legit_no_training"};
  if (dim0_only.count(op)) need(b == 0, "not on dim 0, the only dim it keeps apart");
  if (op == "linear") need(b < r - 1, "which it contracts");
  if (op == "tril" || op == "triu") need(b < r - 2, "one of its matrix dims");
  if (op == "matmul" || op == "bmm") {
    // Batch dims, or the rows of the left matrix / the columns of the right one when only that one is
    // stacked (each row / column of the product reads only its own).
    const bool left = stacked_args & 1, right = stacked_args & 2;
    need(b < R - 2 || (x_by_matrix && b < r - 1) || (left && !right && b == r - 2) || (right && !left && b == r - 1),
         "one of its matrix dims");
  }
  if (op == "scaled_dot_product_attention" || op == "_scaled_dot_product_flash_attention_for_cpu")
    need(b < R - 2, "one of its sequence or feature dims");
  const std::vector<int64_t>& out = first_tensor(n.type())->sizes;
  const auto dim_of = [&](size_t pos, const char* name, int64_t rank, std::optional<int64_t> dflt) {
    auto d = ir::ints_arg_or(n, pos, name, dflt ? std::optional<std::vector<int64_t>>(std::vector<int64_t>{*dflt}) : std::nullopt);
    TORCH_CHECK(d && d->size() == 1, "batch_cone: ", w, " has no ", name);
    return norm_dim((*d)[0], rank);
  };
  if (op == "select" || op == "unbind") {
    const int64_t d = dim_of(1, "dim", r, op == "unbind" ? std::optional<int64_t>(0) : std::nullopt);
    return {b - (d < b ? 1 : 0), l.in};
  }
  if (op == "squeeze") {
    auto ds = ir::ints_arg_or(n, 1, "dim", std::nullopt);
    TORCH_CHECK(ds.has_value(), "batch_cone: ", w, " has no dim");
    int64_t moved = 0;
    for (int64_t d : *ds) moved += norm_dim(d, r) < b && in_sizes.at(norm_dim(d, r)) == 1 ? 1 : 0;
    return {b - moved, l.in};
  }
  if (op == "unsqueeze") return {b + (dim_of(1, "dim", R, std::nullopt) <= b ? 1 : 0), l.in};
  if (op == "stack") return {b + (dim_of(1, "dim", R, 0) <= b ? 1 : 0), l.in};
  if (op == "transpose") {
    const int64_t d0 = dim_of(1, "dim0", r, std::nullopt), d1 = dim_of(2, "dim1", r, std::nullopt);
    return {b == d0 ? d1 : b == d1 ? d0 : b, l.in};
  }
  if (op == "t") return {r == 2 ? 1 - b : b, l.in};
  if (op == "permute") {
    auto p = ir::ints_arg_or(n, 1, "dims", std::nullopt);
    TORCH_CHECK(p.has_value(), "batch_cone: ", w, " has no permutation");
    for (size_t i = 0; i < p->size(); ++i)
      if (norm_dim((*p)[i], r) == b) return {static_cast<int64_t>(i), l.in};
    TORCH_CHECK(false, "batch_cone: ", w, " drops dim ", b);
  }
  static const std::set<std::string> reductions = {"sum", "mean", "amax", "amin", "prod", "var", "std",
                                                   "logsumexp", "argmax", "argmin"};
  if (reductions.count(op) && R < r) {  // keepdim=False: the reduced dims before b go
    auto ds = ir::ints_arg_or(n, 1, "dim", std::nullopt);
    int64_t gone = 0;
    for (int64_t d : *ds) gone += norm_dim(d, r) < b ? 1 : 0;
    return {b - gone, l.in};
  }
  if (op == "flatten") {
    if (r == 0) return l;
    const int64_t start = dim_of(1, "start_dim", r, 0), end = dim_of(2, "end_dim", r, -1);
    if (b < start) return l;
    if (b > end) return {b - (end - start), l.in};
    int64_t inner = l.in;
    for (int64_t d = b + 1; d <= end; ++d) inner *= in_sizes[d];
    return {start, inner};
  }
  if (op == "view" || op == "reshape" || op == "_unsafe_view" || op == "unflatten")
    return choose(view_layouts(in_sizes, l, out, w));
  if (op == "expand") {
    const int64_t to = b + (R - r);
    need(out.at(to) == in_sizes.at(b), "which it expands");
    return {to, l.in};
  }
  return l;
}

LayoutMove move_from_chunks(const std::vector<int64_t>& n, Layout to, int64_t c) {
  LayoutMove m;
  const bool outer = n[to.b] != to.in;
  m.split.push_back(c);
  m.split.insert(m.split.end(), n.begin(), n.begin() + to.b);
  if (outer) m.split.push_back(n[to.b] / to.in);
  m.split.push_back(to.in);
  m.split.insert(m.split.end(), n.begin() + to.b + 1, n.end());
  const int64_t before = to.b + (outer ? 1 : 0);  // dims that go before the copies
  for (int64_t d = 1; d <= before; ++d) m.perm.push_back(d);
  m.perm.push_back(0);
  for (int64_t d = before + 1; d < static_cast<int64_t>(m.split.size()); ++d) m.perm.push_back(d);
  m.sizes_after = n;
  m.sizes_after[to.b] *= c;
  return m;
}

LayoutMove move_to_chunks(const std::vector<int64_t>& n, Layout from, int64_t c) {
  LayoutMove m;
  const bool outer = n[from.b] != from.in;
  m.split.assign(n.begin(), n.begin() + from.b);
  if (outer) m.split.push_back(n[from.b] / from.in);
  const int64_t at = static_cast<int64_t>(m.split.size());
  m.split.push_back(c);
  m.split.push_back(from.in);
  m.split.insert(m.split.end(), n.begin() + from.b + 1, n.end());
  m.perm.push_back(at);
  for (int64_t d = 0; d < static_cast<int64_t>(m.split.size()); ++d)
    if (d != at) m.perm.push_back(d);
  m.sizes_after = n;
  m.sizes_after[0] *= c;
  return m;
}

}  // namespace torch_ext::passes::batch_layout
