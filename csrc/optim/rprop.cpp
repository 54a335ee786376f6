// Rprop, as torch.optim.Rprop's _single_tensor_rprop (torch 2.9). The lr only seeds `step_size`
// (the Python registration fills it with the group's lr, as torch.optim does on its first step);
// the update itself never reads it.
#include "optim/descriptor.h"

#include <ATen/ATen.h>
#include <torch/library.h>

namespace torch_ext::optim {
namespace {

void rprop(Update& u) {
  at::Tensor& prev = u.slot("prev");
  at::Tensor& step_size = u.slot("step_size");
  const double etaminus = u.f("etaminus"), etaplus = u.f("etaplus");
  u.count_step();
  const at::Tensor grad = u.descent_grad();
  // sign[sign.gt(0)] = etaplus; sign[sign.lt(0)] = etaminus; sign[sign.eq(0)] = 1
  at::Tensor sign = grad.mul(prev).sign_();
  sign.masked_fill_(sign.gt(0), etaplus);
  sign.masked_fill_(sign.lt(0), etaminus);
  sign.masked_fill_(sign.eq(0), 1);
  u.write(step_size, [&](at::Tensor& out, const at::Tensor& in) { at::mul_out(out, in, sign); })
      .clamp_(u.f("step_size_min"), u.f("step_size_max"));
  // grad = grad.clone(); grad[sign.eq(etaminus)] = 0
  const at::Tensor kept = grad.masked_fill(sign.eq(etaminus), 0);
  u.write(u.param, [&](at::Tensor& out, const at::Tensor& in) {
    at::addcmul_out(out, in, kept.sign(), step_size, -1);
  });
  u.write(prev, [&](at::Tensor& out, const at::Tensor&) { out.copy_(kept); });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_ext, m) {
  using T = ScalarType;
  const std::vector<Scalar> scalars{{"etaminus", T::Float},      {"etaplus", T::Float}, {"step_size_min", T::Float},
                                    {"step_size_max", T::Float}, {"maximize", T::Bool}};
  define(m, Descriptor{"rprop", "Rprop", {{"prev"}, {"step_size"}, {"step", SlotInit::StepCounter}}, scalars, &rprop});
}

}  // namespace torch_ext::optim
