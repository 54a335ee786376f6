#include "ir/type_check.h"
#include "passes/grad_layout.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <numeric>

namespace torch_ext::passes {
namespace {

at::Tensor meta_of(const ir::TensorMeta& m) { return ir::meta_tensor(m); }

ir::Type type_of(const at::Tensor& meta, const ir::TensorMeta& like) {
  ir::TensorMeta m = like;
  m.sizes = meta.sizes().vec();
  m.strides = meta.strides().vec();
  return ir::Type::make_tensor(m);
}

std::vector<ir::Arg> ints(const std::vector<int64_t>& v) {
  std::vector<ir::Arg> out;
  for (int64_t x : v) out.push_back(ir::Arg::of_int(x));
  return out;
}

}  // namespace

bool obeys_grad_layout(const ir::TensorMeta& grad, const ir::TensorMeta& param) {
  if (grad.sizes != param.sizes) return true;  // not a gradient of it (the checks downstream refuse it)
  if (!meta_of(param).is_non_overlapping_and_dense()) return meta_of(grad).is_contiguous();
  for (size_t d = 0; d < grad.sizes.size(); ++d)
    if (grad.sizes[d] != 1 && grad.strides[d] != param.strides[d]) return false;
  return true;
}

ir::Node* obey_grad_layout(ir::Graph& g, ir::Node* grad, const ir::TensorMeta& param, ir::Node* before) {
  TORCH_CHECK(grad->type().is_tensor(), "obey_grad_layout: gradient %", grad->name(), " is not a tensor");
  const ir::TensorMeta& gm = grad->type().tensor;
  if (obeys_grad_layout(gm, param)) return grad;
  auto call = [&](const std::string& suffix, const char* target, std::vector<ir::Arg> args, ir::Kwargs kwargs,
                  const at::Tensor& meta) {
    ir::Node* n = g.create_call(g.unique_name(grad->name() + suffix), ir::Target::parse(target), std::move(args),
                                std::move(kwargs), type_of(meta, gm), before);
    n->set_module_path(grad->module_path());
    return n;
  };
  const ir::Kwargs contiguous{{"memory_format", ir::Arg::of_memory_format(c10::MemoryFormat::Contiguous)}};
  const at::Tensor gmeta = meta_of(gm);
  if (!meta_of(param).is_non_overlapping_and_dense())  // grad.clone(at::MemoryFormat::Contiguous)
    return call("_contiguous", "aten::clone.default", {ir::Arg::of_node(grad)}, contiguous,
                gmeta.clone(at::MemoryFormat::Contiguous));
  // empty_strided(param's sizes and strides).copy_(grad), as permute -> contiguous clone -> permute back:
  // the dims from the outermost (largest stride) in, so the clone's memory order is the parameter's.
  const int64_t rank = static_cast<int64_t>(param.sizes.size());
  std::vector<int64_t> perm(rank), inverse(rank);
  std::iota(perm.begin(), perm.end(), 0);
  std::stable_sort(perm.begin(), perm.end(), [&](int64_t a, int64_t b) { return param.strides[a] > param.strides[b]; });
  for (int64_t d = 0; d < rank; ++d) inverse[perm[d]] = d;
  const at::Tensor moved = gmeta.permute(perm);
  ir::Node* m = call("_moved", "aten::permute.default", {ir::Arg::of_node(grad), ir::Arg::of_list(ints(perm))}, {}, moved);
  const at::Tensor copied = moved.clone(at::MemoryFormat::Contiguous);
  ir::Node* c = call("_laid_out", "aten::clone.default", {ir::Arg::of_node(m)}, contiguous, copied);
  ir::Node* out = call("_like_param", "aten::permute.default", {ir::Arg::of_node(c), ir::Arg::of_list(ints(inverse))},
                       {}, copied.permute(inverse));
  TORCH_INTERNAL_ASSERT(obeys_grad_layout(out->type().tensor, param), "obey_grad_layout: %", out->name(),
                        " is not laid out like the parameter");
  return out;
}

}  // namespace torch_ext::passes
