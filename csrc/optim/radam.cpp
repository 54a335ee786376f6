// RAdam, as torch.optim.RAdam's _single_tensor_radam (torch 2.9), with or without decoupled weight
// decay. Whether the variance is rectified depends on the step count (rho_t > 5, from step 6 on with
// the default betas), so the kernel decides it per call from the step slot, never at build time.
#include "optim/descriptor.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>

namespace torch_ext::optim {
namespace {

void radam(Update& u) {
  at::Tensor& exp_avg = u.slot("exp_avg");
  at::Tensor& exp_avg_sq = u.slot("exp_avg_sq");
  const double lr = u.lr, beta1 = u.f("beta1"), beta2 = u.f("beta2");
  at::Tensor grad = u.descent_grad();
  const double step = u.count_step().item<double>();
  grad = u.weight_decayed(std::move(grad), u.b("decoupled"));
  u.update_moments(grad, beta1, beta2);
  const double bias_correction1 = 1 - std::pow(beta1, step);
  const double bias_correction2 = 1 - std::pow(beta2, step);
  // torch.optim: bias_corrected_exp_avg * lr, then (rectified) * adaptive_lr * rect, with Python
  // floats as wrapped scalars; (bias_correction2 ** 0.5) / t is Tensor.__rtruediv__, t.reciprocal() * x.
  at::Tensor update = at::div(exp_avg, number(bias_correction1)).mul_(number(lr));
  const double rho_inf = 2 / (1 - beta2) - 1;
  const double rho_t = rho_inf - 2 * step * std::pow(beta2, step) / bias_correction2;
  if (rho_t > 5.0) {
    const at::Tensor adaptive_lr =
        exp_avg_sq.sqrt().add_(u.f("eps")).reciprocal_().mul_(number(std::pow(bias_correction2, 0.5)));
    const double rect =
        std::pow((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t), 0.5);
    update.mul_(adaptive_lr).mul_(number(rect));
  }
  u.write(u.param, [&](at::Tensor& out, const at::Tensor& in) { at::add_out(out, in, update, -1.0); });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_ext, m) {
  define(m, Descriptor{"radam", "RAdam", {{"exp_avg"}, {"exp_avg_sq"}, {"step", SlotInit::StepCounter}},
                       adam_scalars(), &radam});
}

}  // namespace torch_ext::optim
