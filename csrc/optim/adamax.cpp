// Adamax, as torch.optim.Adamax's _single_tensor_adamax (torch 2.9): Adam with the infinity norm,
// exp_inf = max(beta2 * exp_inf, |g| + eps), and the bias-corrected rate lr / (1 - beta1^t) in double.
#include "optim/descriptor.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>

namespace torch_ext::optim {
namespace {

void adamax(Update& u) {
  at::Tensor& exp_avg = u.slot("exp_avg");
  at::Tensor& exp_inf = u.slot("exp_inf");
  const double beta1 = u.f("beta1"), beta2 = u.f("beta2");
  const double step = u.count_step().item<double>();
  const at::Tensor grad = u.weight_decayed(u.descent_grad());
  u.write(exp_avg, [&](at::Tensor& out, const at::Tensor& in) { at::lerp_out(out, in, grad, 1 - beta1); });
  // torch.maximum(exp_inf.mul_(beta2), grad.abs().add_(eps), out=exp_inf)
  const at::Tensor norm = grad.abs().add_(u.f("eps"));
  u.write(exp_inf, [&](at::Tensor& out, const at::Tensor& in) { at::mul_out(out, in, number(beta2)); });
  at::maximum_out(exp_inf, exp_inf, norm);
  const double clr = u.lr / (1 - std::pow(beta1, step));
  u.write(u.param, [&](at::Tensor& out, const at::Tensor& in) { at::addcdiv_out(out, in, exp_avg, exp_inf, -clr); });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_ext, m) {
  using T = ScalarType;
  const std::vector<Scalar> scalars{{"beta1", T::Float, /*schedulable=*/true},
                                    {"beta2", T::Float},
                                    {"eps", T::Float},
                                    {"weight_decay", T::Float},
                                    {"maximize", T::Bool}};
  define(m, Descriptor{"adamax", "Adamax", {{"exp_avg"}, {"exp_inf"}, {"step", SlotInit::StepCounter}}, scalars,
                       &adamax});
}

}  // namespace torch_ext::optim
