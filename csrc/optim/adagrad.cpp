// Adagrad with dense gradients, as torch.optim.Adagrad's _single_tensor_adagrad (torch 2.9).
// torch.optim fills `sum` with initial_accumulator_value; the Python registration does the same.
#include "optim/descriptor.h"

#include <ATen/ATen.h>
#include <torch/library.h>

namespace torch_ext::optim {
namespace {

void adagrad(Update& u) {
  at::Tensor& state_sum = u.slot("sum");
  const double step = u.count_step().item<double>();
  const at::Tensor grad = u.weight_decayed(u.descent_grad());
  const double clr = u.lr / (1 + (step - 1) * u.f("lr_decay"));
  u.write(state_sum, [&](at::Tensor& out, const at::Tensor& in) { at::addcmul_out(out, in, grad, grad, 1); });
  at::Tensor std = state_sum.sqrt().add_(u.f("eps"));
  u.write(u.param, [&](at::Tensor& out, const at::Tensor& in) { at::addcdiv_out(out, in, grad, std, -clr); });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_ext, m) {
  using T = ScalarType;
  const std::vector<Scalar> scalars{
      {"lr_decay", T::Float}, {"weight_decay", T::Float}, {"eps", T::Float}, {"maximize", T::Bool}};
  define(m, Descriptor{"adagrad", "Adagrad", {{"sum"}, {"step", SlotInit::StepCounter}}, scalars, &adagrad,
                       /*elementwise=*/true, /*blocked=*/false});
}

}  // namespace torch_ext::optim
