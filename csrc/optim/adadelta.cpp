// Adadelta, as torch.optim.Adadelta's _single_tensor_adadelta (torch 2.9).
#include "optim/descriptor.h"

#include <ATen/ATen.h>
#include <torch/library.h>

namespace torch_ext::optim {
namespace {

void adadelta(Update& u) {
  at::Tensor& square_avg = u.slot("square_avg");
  at::Tensor& acc_delta = u.slot("acc_delta");
  const double rho = u.f("rho"), eps = u.f("eps");
  u.count_step();
  const at::Tensor grad = u.weight_decayed(u.descent_grad());
  u.write(square_avg, [&](at::Tensor& out, const at::Tensor& in) { at::mul_out(out, in, number(rho)); })
      .addcmul_(grad, grad, 1 - rho);
  const at::Tensor std = square_avg.add(eps).sqrt_();
  at::Tensor delta = acc_delta.add(eps).sqrt_();
  delta.div_(std).mul_(grad);
  u.write(acc_delta, [&](at::Tensor& out, const at::Tensor& in) { at::mul_out(out, in, number(rho)); })
      .addcmul_(delta, delta, 1 - rho);
  u.write(u.param, [&](at::Tensor& out, const at::Tensor& in) { at::add_out(out, in, delta, -u.lr); });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_ext, m) {
  using T = ScalarType;
  const std::vector<Scalar> scalars{
      {"rho", T::Float}, {"eps", T::Float}, {"weight_decay", T::Float}, {"maximize", T::Bool}};
  define(m, Descriptor{"adadelta", "Adadelta", {{"square_avg"}, {"acc_delta"}, {"step", SlotInit::StepCounter}},
                       scalars, &adadelta});
}

}  // namespace torch_ext::optim
