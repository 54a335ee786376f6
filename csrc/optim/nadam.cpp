// NAdam, as torch.optim.NAdam's _single_tensor_nadam (torch 2.9), with or without decoupled weight
// decay. `mu_product`, the running product of the momentum schedule mu_t, is an f32[] per parameter
// as in torch.optim (SlotInit::ScalarOne); the factors built from it are computed in double from its
// float32 value, as torch.optim computes them from Python floats.
#include "optim/descriptor.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>

namespace torch_ext::optim {
namespace {

void nadam(Update& u) {
  at::Tensor& exp_avg = u.slot("exp_avg");
  at::Tensor& exp_avg_sq = u.slot("exp_avg_sq");
  at::Tensor& mu_product = u.slot("mu_product");
  const double lr = u.lr, beta1 = u.f("beta1"), beta2 = u.f("beta2");
  const double momentum_decay = u.f("momentum_decay");
  at::Tensor grad = u.descent_grad();
  const double step = u.count_step().item<double>();
  const double bias_correction2 = 1 - std::pow(beta2, step);
  grad = u.weight_decayed(std::move(grad), u.b("decoupled"));
  const double mu = beta1 * (1.0 - 0.5 * std::pow(0.96, step * momentum_decay));
  const double mu_next = beta1 * (1.0 - 0.5 * std::pow(0.96, (step + 1) * momentum_decay));
  u.write(mu_product, [&](at::Tensor& out, const at::Tensor& in) { at::mul_out(out, in, number(mu)); });
  u.update_moments(grad, beta1, beta2);
  at::Tensor denom = exp_avg_sq.div(bias_correction2).sqrt_();
  const double mu_product_now = mu_product.item<double>();
  const double mu_product_next = mu_product_now * mu_next;
  denom.add_(u.f("eps"));
  u.write(u.param, [&](at::Tensor& out, const at::Tensor& in) {
    at::addcdiv_out(out, in, grad, denom, -lr * (1.0 - mu) / (1.0 - mu_product_now));
  });
  u.param.addcdiv_(exp_avg, denom, (-lr * mu_next) / (1.0 - mu_product_next));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_ext, m) {
  using T = ScalarType;
  const std::vector<Slot> slots{
      {"exp_avg"}, {"exp_avg_sq"}, {"mu_product", SlotInit::ScalarOne}, {"step", SlotInit::StepCounter}};
  const std::vector<Scalar> scalars{{"beta1", T::Float, /*schedulable=*/true},
                                    {"beta2", T::Float},
                                    {"eps", T::Float},
                                    {"weight_decay", T::Float},
                                    {"momentum_decay", T::Float},
                                    {"decoupled", T::Bool},
                                    {"maximize", T::Bool}};
  define(m, Descriptor{"nadam", "NAdam", slots, scalars, &nadam});
}

}  // namespace torch_ext::optim
