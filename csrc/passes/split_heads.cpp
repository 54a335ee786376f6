#include "passes/split_heads.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace torch_ext::passes {
namespace {

const char* kLinear = "aten::linear.default";

// The one aten::linear that reads `z` as its input (not as a weight), with a 2-d weight.
ir::Node* projection_of(ir::Node* z) {
  ir::Node* found = nullptr;
  for (ir::Node* u : z->users()) {
    if (u->kind() != ir::NodeKind::Call || u->target().str() != kLinear) continue;
    if (u->args().empty() || u->args()[0].kind != ir::Arg::Kind::Node || u->args()[0].node != z) continue;
    TORCH_CHECK(found == nullptr, "split_heads: %", z->name(), " feeds more than one linear (%", found->name(),
                ", %", u->name(), ")");
    found = u;
  }
  return found;
}

at::Tensor meta_of(const ir::TensorMeta& m) {
  return at::empty_strided(m.sizes, m.strides, at::TensorOptions().dtype(m.dtype).device(at::kMeta));
}

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
  ir::Node* linear;
  int64_t heads;
};

}  // namespace

std::vector<SplitHeadsResult> split_heads(ir::Graph& g, const std::vector<SplitHeadsSite>& sites) {
  // Check every site before the first edit, so that a refusal leaves the graph unchanged.
  std::vector<Checked> checked;
  for (const SplitHeadsSite& s : sites) {
    ir::Node* z = g.find(s.z);
    TORCH_CHECK(z != nullptr, "split_heads: no node named '%", s.z, "'");
    TORCH_CHECK(s.heads > 0, "split_heads: heads must be positive, got ", s.heads, " for %", s.z);
    ir::Node* lin = projection_of(z);
    TORCH_CHECK(lin != nullptr, "split_heads: %", s.z, " is not the input of an aten::linear (its users: ",
                z->users().size(), ")");
    const auto& args = lin->args();
    TORCH_CHECK(args.size() >= 2 && args[1].kind == ir::Arg::Kind::Node && args[1].node->type().is_tensor(),
                "split_heads: %", lin->name(), " has no weight node");
    const ir::TensorMeta& zm = z->type().tensor;
    const ir::TensorMeta& wm = args[1].node->type().tensor;
    TORCH_CHECK(z->type().is_tensor() && zm.sizes.size() >= 1 && wm.sizes.size() == 2,
                "split_heads: %", lin->name(), " needs a 2-d weight and an input with a last dim");
    const int64_t width = zm.sizes.back();
    TORCH_CHECK(width % s.heads == 0, "split_heads: the last dim of %", s.z, " (", width,
                ") is not divisible by heads=", s.heads);
    // The per-head form must produce exactly the linear's type (and %z must be viewable per head).
    const int64_t d_head = width / s.heads;
    std::vector<int64_t> z_shape(zm.sizes.begin(), zm.sizes.end() - 1);
    z_shape.insert(z_shape.end(), {s.heads, 1, d_head});
    at::Tensor out_m;
    try {
      out_m = at::matmul(meta_of(zm).view(z_shape), meta_of(wm).view({wm.sizes[0], s.heads, d_head}).permute({1, 2, 0}))
                  .squeeze(-2)
                  .sum({-2});
      if (args.size() >= 3 && args[2].kind == ir::Arg::Kind::Node) out_m = out_m + meta_of(args[2].node->type().tensor);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "split_heads: %", lin->name(), " cannot be split into ", s.heads, " heads: ",
                  e.what_without_backtrace());
    }
    TORCH_CHECK(type_of(out_m, zm.device) == lin->type(), "split_heads: %", lin->name(),
                " produces another type than its per-head form (is its output non-contiguous?)");
    checked.push_back({z, lin, s.heads});
  }
  std::vector<SplitHeadsResult> results;
  for (const Checked& c : checked) {
    ir::Node* lin = c.linear;
    ir::Node* w = lin->args()[1].node;
    const bool has_bias = lin->args().size() >= 3 && lin->args()[2].kind == ir::Arg::Kind::Node;
    const ir::TensorMeta& zm = c.z->type().tensor;
    const c10::Device device = zm.device;
    const int64_t d_head = zm.sizes.back() / c.heads;
    const int64_t d_model = w->type().tensor.sizes[0];
    std::vector<int64_t> z_shape(zm.sizes.begin(), zm.sizes.end() - 1);
    z_shape.insert(z_shape.end(), {c.heads, 1, d_head});
    // Types from the same meta kernels the verifier runs, so declared and inferred agree exactly.
    const at::Tensor z_heads_m = meta_of(zm).view(z_shape);
    const at::Tensor w_view_m = meta_of(w->type().tensor).view({d_model, c.heads, d_head});
    const at::Tensor w_heads_m = w_view_m.permute({1, 2, 0});
    const at::Tensor mm_m = at::matmul(z_heads_m, w_heads_m);
    const at::Tensor result_m = mm_m.squeeze(-2);
    const at::Tensor sum_m = result_m.sum({-2});
    const std::string base = lin->name();
    const std::string& path = lin->module_path();
    auto call = [&](const std::string& name, const char* target, std::vector<ir::Arg> args, const at::Tensor& m) {
      ir::Node* n = g.create_call(g.unique_name(name), ir::Target::parse(target), std::move(args), {},
                                  type_of(m, device), lin);
      n->set_module_path(path);
      return n;
    };
    ir::Node* z_heads = call(base + "_z_heads", "aten::view.default",
                             {ir::Arg::of_node(c.z), ir::Arg::of_list(ints(z_shape))}, z_heads_m);
    ir::Node* w_view = call(base + "_w_view", "aten::view.default",
                            {ir::Arg::of_node(w), ir::Arg::of_list(ints({d_model, c.heads, d_head}))}, w_view_m);
    ir::Node* w_heads = call(base + "_w_heads", "aten::permute.default",
                             {ir::Arg::of_node(w_view), ir::Arg::of_list(ints({1, 2, 0}))}, w_heads_m);
    ir::Node* mm = call(base + "_result_mm", "aten::matmul.default",
                        {ir::Arg::of_node(z_heads), ir::Arg::of_node(w_heads)}, mm_m);
    ir::Node* result = call(base + "_result", "aten::squeeze.dim", {ir::Arg::of_node(mm), ir::Arg::of_int(-2)},
                            result_m);
    ir::Node* out = call(base + "_heads_sum", "aten::sum.dim_IntList",
                         {ir::Arg::of_node(result), ir::Arg::of_list(ints({-2}))}, sum_m);
    if (has_bias) {
      const at::Tensor biased_m = sum_m + meta_of(lin->args()[2].node->type().tensor);
      out = call(base + "_biased", "aten::add.Tensor",
                 {ir::Arg::of_node(out), ir::Arg::of_node(lin->args()[2].node)}, biased_m);
    }
    const std::string replaced = lin->name();
    g.replace_all_uses_with(lin, out);
    g.erase(lin);
    results.push_back({result->name(), out->name(), replaced});
  }
  return results;
}

}  // namespace torch_ext::passes
