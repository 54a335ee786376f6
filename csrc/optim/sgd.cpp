// SGD, as torch.optim.SGD's _single_tensor_sgd (torch 2.9): "sgd" without momentum, and
// "sgd_momentum", whose step counter says whether the momentum buffer exists yet (0: torch.optim
// has no buffer, and the first update copies the gradient into it).
#include "optim/descriptor.h"

#include <ATen/ATen.h>
#include <torch/library.h>

namespace torch_ext::optim {
namespace {

void sgd(Update& u) {
  const at::Tensor grad = u.weight_decayed(u.descent_grad());
  u.write(u.param, [&](at::Tensor& out, const at::Tensor& in) { at::add_out(out, in, grad, -u.lr); });
}

void sgd_momentum(Update& u) {
  at::Tensor grad = u.weight_decayed(u.descent_grad());
  at::Tensor& buf = u.slot("momentum_buffer");
  at::Tensor& step = u.slot("step");
  const double momentum = u.f("momentum");
  if (momentum == 0) {  // a scheduled momentum may reach 0: torch.optim then leaves the buffer alone
    u.write(u.param, [&](at::Tensor& out, const at::Tensor& in) { at::add_out(out, in, grad, -u.lr); });
    return;
  }
  if (step.item<double>() == 0) {
    u.write(buf, [&](at::Tensor& out, const at::Tensor&) { out.copy_(grad); });  // torch.optim: buf = grad.clone()
  } else {
    u.write(buf, [&](at::Tensor& out, const at::Tensor& in) { at::mul_out(out, in, number(momentum)); })
        .add_(grad, 1 - u.f("dampening"));
  }
  u.count_step();
  grad = u.b("nesterov") ? grad.add(buf, momentum) : buf;
  u.write(u.param, [&](at::Tensor& out, const at::Tensor& in) { at::add_out(out, in, grad, -u.lr); });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_ext, m) {
  using T = ScalarType;
  define(m, Descriptor{"sgd", "SGD", {}, {{"weight_decay", T::Float}, {"maximize", T::Bool}}, &sgd,
                       /*elementwise=*/true, /*blocked=*/false});
  const std::vector<Scalar> scalars{{"momentum", T::Float, /*schedulable=*/true}, {"dampening", T::Float}, {"weight_decay", T::Float},
                                    {"nesterov", T::Bool}, {"maximize", T::Bool}};
  define(m, Descriptor{"sgd_momentum", "SGD", {{"momentum_buffer"}, {"step", SlotInit::StepCounter}}, scalars,
                       &sgd_momentum, /*elementwise=*/true, /*blocked=*/false});
}

}  // namespace torch_ext::optim
