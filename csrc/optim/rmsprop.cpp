// RMSprop, as torch.optim.RMSprop's _single_tensor_rmsprop (torch 2.9). `grad_avg` is used only
// when centered and `momentum_buffer` only when momentum > 0; both are still carried so the op
// has one signature.
#include "optim/descriptor.h"

#include <ATen/ATen.h>
#include <torch/library.h>

namespace torch_ext::optim {
namespace {

void rmsprop(Update& u) {
  at::Tensor& square_avg = u.slot("square_avg");
  at::Tensor& grad_avg = u.slot("grad_avg");
  at::Tensor& momentum_buffer = u.slot("momentum_buffer");
  const double alpha = u.f("alpha"), momentum = u.f("momentum");
  u.count_step();
  const at::Tensor grad = u.weight_decayed(u.descent_grad());
  u.write(square_avg, [&](at::Tensor& out, const at::Tensor& in) { at::mul_out(out, in, number(alpha)); })
      .addcmul_(grad, grad, 1 - alpha);
  at::Tensor avg;
  if (u.b("centered")) {
    u.write(grad_avg, [&](at::Tensor& out, const at::Tensor& in) { at::lerp_out(out, in, grad, 1 - alpha); });
    avg = square_avg.addcmul(grad_avg, grad_avg, -1).sqrt_();
  } else {
    avg = square_avg.sqrt();
  }
  avg.add_(u.f("eps"));
  if (momentum > 0) {
    u.write(momentum_buffer, [&](at::Tensor& out, const at::Tensor& in) { at::mul_out(out, in, number(momentum)); })
        .addcdiv_(grad, avg);
    u.write(u.param, [&](at::Tensor& out, const at::Tensor& in) { at::add_out(out, in, momentum_buffer, -u.lr); });
  } else {
    u.write(u.param, [&](at::Tensor& out, const at::Tensor& in) { at::addcdiv_out(out, in, grad, avg, -u.lr); });
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_ext, m) {
  using T = ScalarType;
  const std::vector<Slot> slots{{"square_avg"}, {"grad_avg"}, {"momentum_buffer"}, {"step", SlotInit::StepCounter}};
  const std::vector<Scalar> scalars{{"alpha", T::Float},    {"eps", T::Float},     {"weight_decay", T::Float},
                                    {"momentum", T::Float, /*schedulable=*/true}, {"centered", T::Bool}, {"maximize", T::Bool}};
  define(m, Descriptor{"rmsprop", "RMSprop", slots, scalars, &rmsprop});
}

}  // namespace torch_ext::optim
