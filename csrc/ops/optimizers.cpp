#include "ops/optimizers.h"

#include <ATen/ATen.h>

#include <cmath>

namespace torch_ext::ops {

void sgd_inplace(at::Tensor& param, const at::Tensor& grad_in, double lr, double weight_decay, bool maximize) {
  at::Tensor grad = maximize ? at::neg(grad_in) : grad_in;
  if (weight_decay != 0) grad = grad.add(param, weight_decay);
  param.add_(grad, -lr);
}

void sgd_momentum_inplace(at::Tensor& param, const at::Tensor& grad_in, at::Tensor& buf, at::Tensor& step, double lr,
                          double momentum, double dampening, double weight_decay, bool nesterov, bool maximize) {
  at::Tensor grad = maximize ? at::neg(grad_in) : grad_in;
  if (weight_decay != 0) grad = grad.add(param, weight_decay);
  if (step.item<double>() == 0) {
    buf.copy_(grad);  // torch.optim: buf = grad.detach().clone()
  } else {
    buf.mul_(momentum).add_(grad, 1 - dampening);
  }
  step.add_(1);
  if (nesterov) {
    grad = grad.add(buf, momentum);
  } else {
    grad = buf;
  }
  param.add_(grad, -lr);
}

void adam_inplace(at::Tensor& param, const at::Tensor& grad_in, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                  at::Tensor* max_exp_avg_sq, at::Tensor& step_t, double lr, double beta1, double beta2, double eps,
                  double weight_decay, bool decoupled, bool maximize) {
  at::Tensor grad = maximize ? at::neg(grad_in) : grad_in;
  step_t.add_(1);
  if (weight_decay != 0) {
    if (decoupled) {
      param.mul_(1 - lr * weight_decay);
    } else {
      grad = grad.add(param, weight_decay);
    }
  }
  exp_avg.lerp_(grad, 1 - beta1);
  exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2);
  const double step = step_t.item<double>();
  const double bias_correction1 = 1 - std::pow(beta1, step);
  const double bias_correction2 = 1 - std::pow(beta2, step);
  const double step_size = lr / bias_correction1;
  const double bias_correction2_sqrt = std::pow(bias_correction2, 0.5);
  at::Tensor denom;
  if (max_exp_avg_sq != nullptr) {
    at::maximum_out(*max_exp_avg_sq, *max_exp_avg_sq, exp_avg_sq);
    denom = (max_exp_avg_sq->sqrt() / bias_correction2_sqrt).add_(eps);
  } else {
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps);
  }
  param.addcdiv_(exp_avg, denom, -step_size);
}

namespace {
at::Tensor zeropower_via_newtonschulz(const at::Tensor& grad, double a, double b, double c, int64_t ns_steps,
                                      double eps) {
  TORCH_CHECK(ns_steps < 100, "muon: ns_steps must be less than 100, got ", ns_steps);
  TORCH_CHECK(grad.dim() == 2, "muon: the gradient must be a 2D matrix, got shape ", grad.sizes());
  at::Tensor ortho = grad.to(at::kBFloat16);
  const bool tall = grad.size(0) > grad.size(1);
  if (tall) ortho = ortho.t();
  ortho.div_(ortho.norm().clamp(eps));
  for (int64_t i = 0; i < ns_steps; ++i) {
    at::Tensor gram = at::matmul(ortho, ortho.t());
    at::Tensor gram_update = at::addmm(gram, gram, gram, b, c);
    ortho = at::addmm(ortho, gram_update, ortho, a);
  }
  if (tall) ortho = ortho.t();
  return ortho;
}
}  // namespace

void muon_inplace(at::Tensor& param, const at::Tensor& grad, at::Tensor& buf, double lr, double weight_decay,
                  double momentum, bool nesterov, double a, double b, double c, int64_t ns_steps, double eps,
                  double lr_ratio) {
  TORCH_CHECK(grad.dim() == 2, "muon: parameter gradient must be a 2D matrix, got shape ", grad.sizes());
  buf.lerp_(grad, 1 - momentum);
  at::Tensor update = nesterov ? grad.lerp(buf, momentum) : buf;
  update = zeropower_via_newtonschulz(update, a, b, c, ns_steps, eps);
  const double adjusted_lr = lr * lr_ratio;
  param.mul_(1 - lr * weight_decay);
  param.add_(update, -adjusted_lr);
}

void rmsprop_inplace(at::Tensor& param, const at::Tensor& grad_in, at::Tensor& square_avg, at::Tensor& grad_avg,
                     at::Tensor& momentum_buffer, at::Tensor& step, double lr, double alpha, double eps,
                     double weight_decay, double momentum, bool centered, bool maximize) {
  at::Tensor grad = maximize ? at::neg(grad_in) : grad_in;
  step.add_(1);
  if (weight_decay != 0) grad = grad.add(param, weight_decay);
  square_avg.mul_(alpha).addcmul_(grad, grad, 1 - alpha);
  at::Tensor avg;
  if (centered) {
    grad_avg.lerp_(grad, 1 - alpha);
    avg = square_avg.addcmul(grad_avg, grad_avg, -1).sqrt_();
  } else {
    avg = square_avg.sqrt();
  }
  avg.add_(eps);
  if (momentum > 0) {
    momentum_buffer.mul_(momentum).addcdiv_(grad, avg);
    param.add_(momentum_buffer, -lr);
  } else {
    param.addcdiv_(grad, avg, -lr);
  }
}

void adagrad_inplace(at::Tensor& param, const at::Tensor& grad_in, at::Tensor& state_sum, at::Tensor& step_t,
                     double lr, double lr_decay, double weight_decay, double eps, bool maximize) {
  step_t.add_(1);
  const double step = step_t.item<double>();
  at::Tensor grad = maximize ? at::neg(grad_in) : grad_in;
  if (weight_decay != 0) grad = grad.add(param, weight_decay);
  const double clr = lr / (1 + (step - 1) * lr_decay);
  state_sum.addcmul_(grad, grad, 1);
  at::Tensor std = state_sum.sqrt().add_(eps);
  param.addcdiv_(grad, std, -clr);
}

}  // namespace torch_ext::ops
