// Adam and AdamW (decoupled weight decay), as torch.optim.Adam's _single_tensor_adam (torch 2.9):
// "adam", and "adam_amsgrad", which also keeps the running maximum of exp_avg_sq. Scalars that
// torch.optim keeps as Python floats (bias corrections, step size) are computed in double here.
#include "optim/descriptor.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>

namespace torch_ext::optim {
namespace {

void adam_with(Update& u, at::Tensor* max_exp_avg_sq) {
  at::Tensor& param = u.param;
  at::Tensor& exp_avg = u.slot("exp_avg");
  at::Tensor& exp_avg_sq = u.slot("exp_avg_sq");
  const double lr = u.lr, beta1 = u.f("beta1"), beta2 = u.f("beta2"), eps = u.f("eps");
  at::Tensor grad = u.descent_grad();
  const double step = u.count_step().item<double>();
  grad = u.weight_decayed(std::move(grad), u.b("decoupled"));
  u.update_moments(grad, beta1, beta2);
  const double bias_correction1 = 1 - std::pow(beta1, step);
  const double bias_correction2 = 1 - std::pow(beta2, step);
  const double step_size = lr / bias_correction1;
  const double bias_correction2_sqrt = std::pow(bias_correction2, 0.5);
  // torch.optim: denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps); the division in
  // place on the fresh sqrt is the same kernel on the same values, one temporary less.
  if (max_exp_avg_sq != nullptr)
    u.write(*max_exp_avg_sq, [&](at::Tensor& out, const at::Tensor& in) { at::maximum_out(out, in, exp_avg_sq); });
  at::Tensor denom = (max_exp_avg_sq != nullptr ? *max_exp_avg_sq : exp_avg_sq).sqrt();
  denom.div_(bias_correction2_sqrt).add_(eps);
  u.write(param, [&](at::Tensor& out, const at::Tensor& in) { at::addcdiv_out(out, in, exp_avg, denom, -step_size); });
}

void adam(Update& u) { adam_with(u, nullptr); }
void adam_amsgrad(Update& u) { adam_with(u, &u.slot("max_exp_avg_sq")); }

}  // namespace

std::vector<Scalar> adam_scalars() {
  using T = ScalarType;
  return {{"beta1", T::Float, /*schedulable=*/true},  {"beta2", T::Float},     {"eps", T::Float},
          {"weight_decay", T::Float}, {"decoupled", T::Bool}, {"maximize", T::Bool}};
}

TORCH_LIBRARY_FRAGMENT(torch_ext, m) {
  const Slot step{"step", SlotInit::StepCounter};
  define(m, Descriptor{"adam", "Adam", {{"exp_avg"}, {"exp_avg_sq"}, step}, adam_scalars(), &adam});
  define(m, Descriptor{"adam_amsgrad", "Adam", {{"exp_avg"}, {"exp_avg_sq"}, {"max_exp_avg_sq"}, step},
                       adam_scalars(), &adam_amsgrad});
}

}  // namespace torch_ext::optim
