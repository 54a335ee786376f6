// Adafactor, as torch.optim.Adafactor's _single_tensor_adafactor (torch 2.9). A parameter of 2 or more
// dims is "adafactor": its second moment is factored over the last two dims into row_var (the last dim
// reduced to 1) and col_var (the one before it reduced to 1), SlotInit::Factored slots whose shapes
// differ from the parameter's. A 0-d or 1-d parameter is "adafactor_vector", with a full `variance`.
// The update reads whole tensors (norms over the parameter and the update, means over rows and
// columns), so neither kind is elementwise: no blocked runs, no ZeRO-1 shards. The scalars torch.optim
// keeps as Python floats (beta2's complement, rho, alpha, the clipping denominator) are doubles here.
// eps1 is resolved in Python (torch.optim's None is finfo(dtype).eps).
#include "optim/descriptor.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

namespace torch_ext::optim {
namespace {

void adafactor(Update& u) {
  const double lr = u.lr, eps1 = u.f("eps1"), d = u.f("d");
  at::Tensor grad = u.descent_grad();
  const double step = u.count_step().item<double>();
  const double one_minus_beta2_t = std::pow(step, u.f("beta2_decay"));
  const double rho_t = std::min(lr, 1 / std::pow(step, 0.5));
  const double rms = at::linalg_vector_norm(u.param, 2).item<double>() / std::pow(static_cast<double>(u.param.numel()), 0.5);
  const double alpha = std::max(u.f("eps2"), rms) * rho_t;
  u.weight_decayed(grad, /*decoupled=*/true);  // param *= 1 - lr * weight_decay; grad unchanged
  at::Tensor var_estimate;
  if (grad.dim() > 1) {
    at::Tensor& row_var = u.slot("row_var");
    at::Tensor& col_var = u.slot("col_var");
    // torch.optim: (g * g).mean(dim) as a norm squared, without a g-sized intermediate.
    const at::Tensor row_mean = at::linalg_vector_norm(grad, 2, at::IntArrayRef{-1}, true).square_().div_(grad.size(-1));
    u.write(row_var, [&](at::Tensor& out, const at::Tensor& in) { at::lerp_out(out, in, row_mean, one_minus_beta2_t); });
    const at::Tensor col_mean = at::linalg_vector_norm(grad, 2, at::IntArrayRef{-2}, true).square_().div_(grad.size(-2));
    u.write(col_var, [&](at::Tensor& out, const at::Tensor& in) { at::lerp_out(out, in, col_mean, one_minus_beta2_t); });
    var_estimate = at::matmul(row_var, col_var);
    var_estimate.div_(row_var.mean(at::IntArrayRef{-2}, true).clamp_(at::Scalar(eps1), std::nullopt));
  } else {
    at::Tensor& variance = u.slot("variance");
    const at::Tensor grad_squared = grad * grad;
    u.write(variance, [&](at::Tensor& out, const at::Tensor& in) { at::lerp_out(out, in, grad_squared, one_minus_beta2_t); });
    var_estimate = variance.clone();
  }
  // eps1 squared, as the square root follows.
  at::Tensor update = var_estimate.clamp_(at::Scalar(eps1 * eps1), std::nullopt).rsqrt_();
  update.mul_(grad);
  const double update_rms = at::linalg_vector_norm(update, 2).item<double>() /
                            (std::pow(static_cast<double>(update.numel()), 0.5) * d);
  const double denom = std::max(1.0, update_rms);
  u.write(u.param, [&](at::Tensor& out, const at::Tensor& in) { at::add_out(out, in, update, -alpha / denom); });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_ext, m) {
  using T = ScalarType;
  const std::vector<Scalar> scalars{{"beta2_decay", T::Float}, {"eps1", T::Float},         {"eps2", T::Float},
                                    {"d", T::Float},           {"weight_decay", T::Float}, {"maximize", T::Bool}};
  const Slot step{"step", SlotInit::StepCounter};
  define(m, Descriptor{"adafactor", "Adafactor",
                       {{"row_var", SlotInit::Factored, -1}, {"col_var", SlotInit::Factored, -2}, step}, scalars,
                       &adafactor, /*elementwise=*/false});
  define(m, Descriptor{"adafactor_vector", "Adafactor", {{"variance"}, step}, scalars, &adafactor,
                       /*elementwise=*/false});
}

}  // namespace torch_ext::optim
