// CPU kernels of the optimizer updates, written as the exact op sequence of torch.optim's
// single-tensor implementations (torch 2.9: _single_tensor_sgd / _single_tensor_adam /
// _single_tensor_muon), so a pure step matches eager bit for bit when its gradients do.
//
// Each function updates its tensors in place. Scalars that torch.optim keeps as Python floats
// (lr, bias corrections) are computed in double here, exactly as Python computes them.
#pragma once

#include <ATen/core/Tensor.h>

namespace torch_ext::ops {

// Plain SGD (momentum == 0).
void sgd_inplace(at::Tensor& param, const at::Tensor& grad, double lr, double weight_decay, bool maximize);

// SGD with momentum. `step` counts applied steps (0 means the momentum buffer is not yet
// initialised, as torch.optim's missing buffer); it is incremented.
void sgd_momentum_inplace(at::Tensor& param, const at::Tensor& grad, at::Tensor& momentum_buffer, at::Tensor& step,
                          double lr, double momentum, double dampening, double weight_decay, bool nesterov,
                          bool maximize);

// Adam / AdamW (decoupled weight decay). `max_exp_avg_sq` is undefined unless amsgrad.
void adam_inplace(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                  at::Tensor* max_exp_avg_sq, at::Tensor& step, double lr, double beta1, double beta2, double eps,
                  double weight_decay, bool decoupled, bool maximize);

// Muon: momentum, Newton–Schulz orthogonalisation in bfloat16, decoupled weight decay.
// `lr_ratio` is torch.optim.Muon's _adjust_lr ratio for this parameter's shape.
void muon_inplace(at::Tensor& param, const at::Tensor& grad, at::Tensor& momentum_buffer, double lr,
                  double weight_decay, double momentum, bool nesterov, double a, double b, double c, int64_t ns_steps,
                  double eps, double lr_ratio);

// RMSprop (torch 2.9 _single_tensor_rmsprop). `grad_avg` is used only when centered and
// `momentum_buffer` only when momentum > 0; both are still carried so the op has one signature.
void rmsprop_inplace(at::Tensor& param, const at::Tensor& grad, at::Tensor& square_avg, at::Tensor& grad_avg,
                     at::Tensor& momentum_buffer, at::Tensor& step, double lr, double alpha, double eps,
                     double weight_decay, double momentum, bool centered, bool maximize);

// Adagrad, dense gradients (torch 2.9 _single_tensor_adagrad).
void adagrad_inplace(at::Tensor& param, const at::Tensor& grad, at::Tensor& state_sum, at::Tensor& step, double lr,
                     double lr_decay, double weight_decay, double eps, bool maximize);

}  // namespace torch_ext::ops
