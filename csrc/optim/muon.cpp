// Muon, as torch.optim.Muon's _single_tensor_muon (torch 2.9): momentum, Newton-Schulz
// orthogonalisation in bfloat16, decoupled weight decay. `lr_ratio` is torch.optim.Muon's
// _adjust_lr ratio for this parameter's shape (computed in Python from the param group).
#include "optim/descriptor.h"

#include <ATen/ATen.h>
#include <torch/library.h>

namespace torch_ext::optim {
namespace {

at::Tensor zeropower_via_newtonschulz(const at::Tensor& grad, double a, double b, double c, int64_t ns_steps,
                                      double eps) {
  TORCH_CHECK(ns_steps < 100, "muon: ns_steps must be less than 100, got ", ns_steps);
  TORCH_CHECK(grad.dim() == 2, "muon: the gradient must be a 2D matrix, got shape ", grad.sizes());
  at::Tensor ortho = grad.to(at::kBFloat16);
  const bool tall = grad.size(0) > grad.size(1);
  if (tall) ortho = ortho.t();
  ortho.div_(ortho.norm().clamp(eps));
  for (int64_t i = 0; i < ns_steps; ++i) {
    at::Tensor gram = at::matmul(ortho, ortho.t());
    at::Tensor gram_update = at::addmm(gram, gram, gram, b, c);
    ortho = at::addmm(ortho, gram_update, ortho, a);
  }
  if (tall) ortho = ortho.t();
  return ortho;
}

void muon(Update& u) {
  TORCH_CHECK(u.grad.dim() == 2, "muon: parameter gradient must be a 2D matrix, got shape ", u.grad.sizes());
  at::Tensor& buf = u.slot("momentum_buffer");
  const double momentum = u.f("momentum");
  u.write(buf, [&](at::Tensor& out, const at::Tensor& in) { at::lerp_out(out, in, u.grad, 1 - momentum); });
  at::Tensor update = u.b("nesterov") ? u.grad.lerp(buf, momentum) : buf;
  update = zeropower_via_newtonschulz(update, u.f("a"), u.f("b"), u.f("c"), u.i("ns_steps"), u.f("eps"));
  const double adjusted_lr = u.lr * u.f("lr_ratio");
  const double decay = 1 - u.lr * u.f("weight_decay");
  u.write(u.param, [&](at::Tensor& out, const at::Tensor& in) { at::mul_out(out, in, number(decay)); })
      .add_(update, -adjusted_lr);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_ext, m) {
  using T = ScalarType;
  const std::vector<Scalar> scalars{{"weight_decay", T::Float}, {"momentum", T::Float, /*schedulable=*/true}, {"nesterov", T::Bool},
                                    {"a", T::Float},            {"b", T::Float},        {"c", T::Float},
                                    {"ns_steps", T::Int},       {"eps", T::Float},      {"lr_ratio", T::Float}};
  define(m, Descriptor{"muon", "Muon", {{"momentum_buffer"}}, scalars, &muon, /*elementwise=*/false});
}

}  // namespace torch_ext::optim
