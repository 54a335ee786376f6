#include "ir/type_check.h"
#include "passes/split_heads.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace torch_ext::passes {
namespace {

const char* kLinear = "aten::linear.default";

bool is_call(const ir::Node* n, const char* target) {
  return n->kind() == ir::NodeKind::Call && n->target().str() == target;
}

bool is_view_or_reshape(const ir::Node* n) {
  return is_call(n, "aten::view.default") || is_call(n, "aten::reshape.default");
}

// beta / alpha of an aten::addmm: absent or exactly 1.
bool is_one(const ir::Arg& a) {
  return (a.kind == ir::Arg::Kind::Int && a.i == 1) || (a.kind == ir::Arg::Kind::Float && a.f == 1.0);
}

std::string users_of(const ir::Node* n) {
  std::string out;
  for (const ir::Node* u : n->users()) {
    if (!out.empty()) out += ", ";
    out += "%" + u->name() + (u->kind() == ir::NodeKind::Call ? " (" + u->target().str() + ")" : "");
  }
  return out.empty() ? "none" : out;
}

// The projection reading %z, in either of the two forms the pass can split:
//   linear: %out = aten::linear(%z, %W [D, H*dh], %b)
//   Conv1D (Hugging Face GPT-2's c_attn / c_proj): %flat [N, H*dh] = aten::view(%z, [-1, H*dh]),
//           %mm [N, D] = aten::addmm(%b [D], %flat, %W [H*dh, D]) (or aten::mm(%flat, %W)),
//           %out [..., D] = aten::view(%mm, [..., D])
// A view (or reshape) to [N, w] or from [N, D] is the row-major flatten / unflatten whatever its
// size list says: its type alone proves the structure.
struct Projection {
  ir::Node* out = nullptr;     // the node whose uses the per-head form takes over
  ir::Node* weight = nullptr;  // [D, H*dh] (linear) or [H*dh, D] (Conv1D)
  ir::Node* bias = nullptr;    // [D] or null
  bool in_out = false;         // weight laid out [in, out] (Conv1D)
  ir::Node* mm = nullptr;      // Conv1D: the addmm / mm (erased with %out)
  ir::Node* flat = nullptr;    // Conv1D: the flattening view (erased when nothing else reads it)
};

// The one aten::linear that reads `z` as its input (not as a weight), with a 2-d weight.
ir::Node* linear_of(ir::Node* z) {
  ir::Node* found = nullptr;
  for (ir::Node* u : z->users()) {
    if (!is_call(u, kLinear)) continue;
    if (u->args().empty() || u->args()[0].kind != ir::Arg::Kind::Node || u->args()[0].node != z) continue;
    TORCH_CHECK(found == nullptr, "split_heads: %", z->name(), " feeds more than one linear (%", found->name(),
                ", %", u->name(), ")");
    found = u;
  }
  return found;
}

// The Conv1D projection of `z`, or null when `z` has no flattening view feeding an addmm / mm as
// its mat1. Once that start is found, every other part of the form is checked and a mismatch is
// refused naming the node and what was expected.
bool conv1d_of(ir::Node* z, Projection& p) {
  if (!z->type().is_tensor() || z->type().tensor.sizes.empty()) return false;
  const std::vector<int64_t>& zs = z->type().tensor.sizes;
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < zs.size(); ++i) rows *= zs[i];
  const int64_t width = zs.back();
  for (ir::Node* flat : z->users()) {
    if (!is_view_or_reshape(flat) || flat->args().empty() || flat->args()[0].kind != ir::Arg::Kind::Node ||
        flat->args()[0].node != z || !flat->type().is_tensor() ||
        flat->type().tensor.sizes != std::vector<int64_t>{rows, width})
      continue;
    for (ir::Node* mm : flat->users()) {
      const bool addmm = is_call(mm, "aten::addmm.default");
      if (!addmm && !is_call(mm, "aten::mm.default")) continue;
      const auto& a = mm->args();
      const size_t x = addmm ? 1 : 0;  // mat1's position
      if (a.size() <= x + 1 || a[x].kind != ir::Arg::Kind::Node || a[x].node != flat) continue;
      TORCH_CHECK(p.mm == nullptr, "split_heads: %", z->name(), " feeds more than one Conv1D projection (%",
                  p.mm ? p.mm->name() : "", ", %", mm->name(), ")");
      p.flat = flat;
      p.mm = mm;
    }
  }
  if (p.mm == nullptr) return false;
  ir::Node* mm = p.mm;
  const auto& a = mm->args();
  const bool addmm = is_call(mm, "aten::addmm.default");
  const size_t w_at = addmm ? 2 : 1;
  TORCH_CHECK(a.size() == w_at + 1 && a[w_at].kind == ir::Arg::Kind::Node && a[w_at].node->type().is_tensor() &&
                  a[w_at].node->type().tensor.sizes.size() == 2,
              "split_heads: %", mm->name(), " (", mm->target().str(), " of %", p.flat->name(),
              ") has no 2-d weight node [in, out] as its mat2");
  for (const auto& [key, value] : mm->kwargs())
    TORCH_CHECK((key == "beta" || key == "alpha") && is_one(value), "split_heads: %", mm->name(),
                " has ", key, " other than 1; the per-head form computes bias + x @ W only");
  p.weight = a[w_at].node;
  p.in_out = true;
  if (addmm) {
    const ir::Node* b = a[0].kind == ir::Arg::Kind::Node ? a[0].node : nullptr;
    const int64_t d = p.weight->type().tensor.sizes[1];
    TORCH_CHECK(b != nullptr && b->type().is_tensor() && b->type().tensor.sizes == std::vector<int64_t>{d},
                "split_heads: %", mm->name(), " adds a bias that is not a 1-d [", d, "] node (got ",
                b != nullptr && b->type().is_tensor() ? c10::str(c10::IntArrayRef(b->type().tensor.sizes)) : std::string("no tensor"),
                ")");
    p.bias = a[0].node;
  }
  // The product must be read only by the view back to z's leading dims: any other reader would not
  // see the per-head form.
  std::vector<int64_t> back(zs.begin(), zs.end() - 1);
  back.push_back(p.weight->type().tensor.sizes[1]);
  ir::Node* out = mm->users().size() == 1 ? mm->users()[0] : nullptr;
  TORCH_CHECK(out != nullptr && is_view_or_reshape(out) && out->type().is_tensor() &&
                  out->type().tensor.sizes == back,
              "split_heads: %", mm->name(), " (the Conv1D projection of %", z->name(),
              ") must be read only by a view back to ", c10::str(c10::IntArrayRef(back)), "; its users: ", users_of(mm));
  p.out = out;
  return true;
}

Projection projection_of(ir::Node* z) {
  Projection p;
  if (ir::Node* lin = linear_of(z)) {
    const auto& args = lin->args();
    TORCH_CHECK(args.size() >= 2 && args[1].kind == ir::Arg::Kind::Node && args[1].node->type().is_tensor() &&
                    args[1].node->type().tensor.sizes.size() == 2,
                "split_heads: %", lin->name(), " has no 2-d weight node");
    p.out = lin;
    p.weight = args[1].node;
    if (args.size() >= 3 && args[2].kind == ir::Arg::Kind::Node) p.bias = args[2].node;
    return p;
  }
  if (conv1d_of(z, p)) return p;
  TORCH_CHECK(false, "split_heads: %", z->name(),
              " is not the input of an aten::linear nor of a Conv1D projection (aten::view to [N, ",
              z->type().is_tensor() && !z->type().tensor.sizes.empty() ? c10::str(z->type().tensor.sizes.back())
                                                                         : std::string("?"),
              "] -> aten::addmm(bias, x2d, W [in, out]) -> aten::view back); its users: ", users_of(z));
  return p;
}

at::Tensor meta_of(const ir::TensorMeta& m) { return ir::meta_tensor(m); }

ir::Type type_of(const at::Tensor& t, const c10::Device& device) {
  ir::TensorMeta m;
  m.dtype = t.scalar_type();
  m.sizes = t.sizes().vec();
  m.strides = t.strides().vec();
  m.device = device;
  return ir::Type::make_tensor(m);
}

std::vector<ir::Arg> ints(const std::vector<int64_t>& v) {
  std::vector<ir::Arg> out;
  for (int64_t x : v) out.push_back(ir::Arg::of_int(x));
  return out;
}

struct Checked {
  ir::Node* z;
  Projection proj;
  int64_t heads;
};

// The weight seen per head as [H, dh, D]: [D, H*dh] viewed [D, H, dh] and permuted (linear), or
// [H*dh, D] viewed [H, dh, D] (Conv1D).
std::vector<int64_t> weight_view(const Projection& p, int64_t heads, int64_t d_head) {
  const std::vector<int64_t>& ws = p.weight->type().tensor.sizes;
  return p.in_out ? std::vector<int64_t>{heads, d_head, ws[1]} : std::vector<int64_t>{ws[0], heads, d_head};
}

at::Tensor per_head_weight(const Projection& p, const at::Tensor& w_view) {
  return p.in_out ? w_view : w_view.permute({1, 2, 0});
}

}  // namespace

std::vector<SplitHeadsResult> split_heads(ir::Graph& g, const std::vector<SplitHeadsSite>& sites) {
  // Check every site before the first edit, so that a refusal leaves the graph unchanged.
  std::vector<Checked> checked;
  for (const SplitHeadsSite& s : sites) {
    ir::Node* z = g.find(s.z);
    TORCH_CHECK(z != nullptr, "split_heads: no node named '%", s.z, "'");
    TORCH_CHECK(s.heads > 0, "split_heads: heads must be positive, got ", s.heads, " for %", s.z);
    const Projection proj = projection_of(z);
    const ir::TensorMeta& zm = z->type().tensor;
    const ir::TensorMeta& wm = proj.weight->type().tensor;
    TORCH_CHECK(z->type().is_tensor() && zm.sizes.size() >= 1, "split_heads: %", proj.out->name(),
                " needs an input with a last dim");
    const int64_t width = zm.sizes.back();
    TORCH_CHECK(width % s.heads == 0, "split_heads: the last dim of %", s.z, " (", width,
                ") is not divisible by heads=", s.heads);
    const int64_t w_in = proj.in_out ? wm.sizes[0] : wm.sizes[1];
    TORCH_CHECK(w_in == width, "split_heads: the weight %", proj.weight->name(), " of %", proj.out->name(),
                " reads ", w_in, " features, expected the last dim of %", s.z, " (", width, ")");
    // The per-head form must produce exactly the projection's type (and %z must be viewable per head).
    const int64_t d_head = width / s.heads;
    std::vector<int64_t> z_shape(zm.sizes.begin(), zm.sizes.end() - 1);
    z_shape.insert(z_shape.end(), {s.heads, 1, d_head});
    at::Tensor out_m;
    try {
      out_m = at::matmul(meta_of(zm).view(z_shape),
                         per_head_weight(proj, meta_of(wm).view(weight_view(proj, s.heads, d_head))))
                  .squeeze(-2)
                  .sum({-2});
      if (proj.bias != nullptr) out_m = out_m + meta_of(proj.bias->type().tensor);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "split_heads: %", proj.out->name(), " cannot be split into ", s.heads, " heads: ",
                  e.what_without_backtrace());
    }
    TORCH_CHECK(type_of(out_m, zm.device) == proj.out->type(), "split_heads: %", proj.out->name(),
                " produces another type than its per-head form (is its output non-contiguous?)");
    checked.push_back({z, proj, s.heads});
  }
  std::vector<SplitHeadsResult> results;
  for (const Checked& c : checked) {
    const Projection& p = c.proj;
    ir::Node* at_node = p.out;
    ir::Node* w = p.weight;
    const ir::TensorMeta& zm = c.z->type().tensor;
    const c10::Device device = zm.device;
    const int64_t d_head = zm.sizes.back() / c.heads;
    const std::vector<int64_t> w_shape = weight_view(p, c.heads, d_head);
    std::vector<int64_t> z_shape(zm.sizes.begin(), zm.sizes.end() - 1);
    z_shape.insert(z_shape.end(), {c.heads, 1, d_head});
    // Types from the same meta kernels the verifier runs, so declared and inferred agree exactly.
    const at::Tensor z_heads_m = meta_of(zm).view(z_shape);
    const at::Tensor w_view_m = meta_of(w->type().tensor).view(w_shape);
    const at::Tensor w_heads_m = per_head_weight(p, w_view_m);
    const at::Tensor mm_m = at::matmul(z_heads_m, w_heads_m);
    const at::Tensor result_m = mm_m.squeeze(-2);
    const at::Tensor sum_m = result_m.sum({-2});
    // Named after the projection: the linear, or the Conv1D's addmm.
    const std::string base = p.mm != nullptr ? p.mm->name() : p.out->name();
    const std::string path = at_node->module_path();
    auto call = [&](const std::string& name, const char* target, std::vector<ir::Arg> args, const at::Tensor& m) {
      ir::Node* n = g.create_call(g.unique_name(name), ir::Target::parse(target), std::move(args), {},
                                  type_of(m, device), at_node);
      n->set_module_path(path);
      return n;
    };
    ir::Node* z_heads = call(base + "_z_heads", "aten::view.default",
                             {ir::Arg::of_node(c.z), ir::Arg::of_list(ints(z_shape))}, z_heads_m);
    ir::Node* w_heads = call(base + "_w_view", "aten::view.default",
                             {ir::Arg::of_node(w), ir::Arg::of_list(ints(w_shape))}, w_view_m);
    if (!p.in_out)
      w_heads = call(base + "_w_heads", "aten::permute.default",
                     {ir::Arg::of_node(w_heads), ir::Arg::of_list(ints({1, 2, 0}))}, w_heads_m);
    ir::Node* mm = call(base + "_result_mm", "aten::matmul.default",
                        {ir::Arg::of_node(z_heads), ir::Arg::of_node(w_heads)}, mm_m);
    ir::Node* result = call(base + "_result", "aten::squeeze.dim", {ir::Arg::of_node(mm), ir::Arg::of_int(-2)},
                            result_m);
    ir::Node* out = call(base + "_heads_sum", "aten::sum.dim_IntList",
                         {ir::Arg::of_node(result), ir::Arg::of_list(ints({-2}))}, sum_m);
    if (p.bias != nullptr) {
      const at::Tensor biased_m = sum_m + meta_of(p.bias->type().tensor);
      out = call(base + "_biased", "aten::add.Tensor", {ir::Arg::of_node(out), ir::Arg::of_node(p.bias)}, biased_m);
    }
    const std::string replaced = p.out->name();
    g.replace_all_uses_with(p.out, out);
    g.erase(p.out);
    if (p.mm != nullptr) {
      g.erase(p.mm);  // read only by the view back (checked)
      if (p.flat->users().empty()) g.erase(p.flat);
    }
    results.push_back({result->name(), out->name(), replaced});
  }
  return results;
}

}  // namespace torch_ext::passes
