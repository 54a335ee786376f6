// Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), as lion-pytorch and
// optax define it: decoupled weight decay p *= 1 - lr*wd; update = sign(beta1*m + (1-beta1)*g);
// p -= lr*update; m = beta2*m + (1-beta2)*g. The op sequence is lion-pytorch's update_fn, so the
// eager torch_ext.optim.Lion (which calls lion_update_) and the pure step agree bit for bit.
#include "optim/descriptor.h"

#include <ATen/ATen.h>
#include <torch/library.h>

namespace torch_ext::optim {
namespace {

void lion(Update& u) {
  at::Tensor& exp_avg = u.slot("exp_avg");
  const double beta1 = u.f("beta1"), beta2 = u.f("beta2");
  const double decay = 1 - u.lr * u.f("weight_decay");
  u.write(u.param, [&](at::Tensor& out, const at::Tensor& in) { at::mul_out(out, in, number(decay)); });
  at::Tensor update = exp_avg.mul(beta1).add_(u.grad, 1 - beta1).sign_();
  u.param.add_(update, -u.lr);
  u.write(exp_avg, [&](at::Tensor& out, const at::Tensor& in) { at::mul_out(out, in, number(beta2)); })
      .add_(u.grad, 1 - beta2);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_ext, m) {
  using T = ScalarType;
  const std::vector<Scalar> scalars{{"beta1", T::Float, /*schedulable=*/true}, {"beta2", T::Float}, {"weight_decay", T::Float}};
  define(m, Descriptor{"lion", "Lion", {{"exp_avg"}}, scalars, &lion});
}

}  // namespace torch_ext::optim
