#include "passes/clip_grad_norm.h"

#include <c10/util/Exception.h>

namespace torch_ext::passes {
namespace {

ir::Type scalar_like(const ir::Node* n) {
  ir::TensorMeta m;
  m.dtype = n->type().tensor.dtype;
  m.device = n->type().tensor.device;
  return ir::Type::make_tensor(m);
}

ir::Node* call(ir::Graph& g, const std::string& base, const char* target, std::vector<ir::Arg> args, ir::Type type,
               ir::Kwargs kwargs = {}) {
  return g.create_call(g.unique_name(base), ir::Target::parse(target), std::move(args), std::move(kwargs),
                       std::move(type));
}

}  // namespace

std::vector<ir::Node*> clip_grad_norm(ir::Graph& g, const std::vector<ir::Node*>& grads, double max_norm,
                                      double norm_type) {
  TORCH_CHECK(max_norm > 0, "clip_grad_norm: max_norm must be positive, got ", max_norm);
  if (grads.empty()) return grads;
  for (const ir::Node* gr : grads)
    TORCH_CHECK(gr->owner() == &g && gr->type().is_tensor(), "clip_grad_norm: %", gr->name(),
                " is not a tensor of this graph");
  std::vector<ir::Arg> norms;
  for (ir::Node* gr : grads)
    norms.push_back(ir::Arg::of_node(call(g, "grad_norm", "aten::linalg_vector_norm.default",
                                          {ir::Arg::of_node(gr), ir::Arg::of_float(norm_type)}, scalar_like(gr))));
  ir::TensorMeta stacked;
  stacked.dtype = grads[0]->type().tensor.dtype;
  stacked.sizes = {static_cast<int64_t>(grads.size())};
  ir::Node* stack = call(g, "grad_norms", "aten::stack.default", {ir::Arg::of_list(norms)}, ir::Type::make_tensor(stacked));
  ir::Node* total = call(g, "total_norm", "aten::linalg_vector_norm.default",
                         {ir::Arg::of_node(stack), ir::Arg::of_float(norm_type)}, scalar_like(grads[0]));
  ir::Node* denom = call(g, "clip_denom", "aten::add.Tensor", {ir::Arg::of_node(total), ir::Arg::of_float(1e-6)},
                         scalar_like(grads[0]));
  ir::Node* recip = call(g, "clip_recip", "aten::reciprocal.default", {ir::Arg::of_node(denom)}, scalar_like(grads[0]));
  ir::Node* coef = call(g, "clip_coef", "aten::mul.Tensor", {ir::Arg::of_node(recip), ir::Arg::of_float(max_norm)},
                        scalar_like(grads[0]));
  ir::Node* clamped = call(g, "clip_coef_clamped", "aten::clamp.default",
                           {ir::Arg::of_node(coef), ir::Arg::none(), ir::Arg::of_float(1.0)}, scalar_like(grads[0]));
  std::vector<ir::Node*> out;
  for (ir::Node* gr : grads)
    out.push_back(call(g, gr->name() + "_clipped", "aten::mul.Tensor", {ir::Arg::of_node(gr), ir::Arg::of_node(clamped)},
                       gr->type()));
  return out;
}

}  // namespace torch_ext::passes
