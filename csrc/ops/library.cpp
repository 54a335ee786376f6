// The one TORCH_LIBRARY of torch_ext: every schema, then the CPU kernels.
//
// Functional ops (used by the pure training step) return fresh tensors and never alias their
// inputs. The in-place variants (trailing underscore) declare every tensor they write with
// Tensor(x!) and return nothing; they are for eager training scripts.
#include "ops/optimizers.h"
#include "ops/random.h"

#include <ATen/ATen.h>
#include <torch/library.h>

namespace torch_ext::ops {
namespace {

double scalar_of(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.numel() == 1, what, " must be a 1-element tensor, got shape ", t.sizes());
  return t.item<double>();
}

void check_like(const at::Tensor& param, const at::Tensor& other, const char* what) {
  TORCH_CHECK(other.sizes() == param.sizes(), what, " has shape ", other.sizes(), " but the parameter has shape ",
              param.sizes());
  TORCH_CHECK(at::isFloatingType(param.scalar_type()), "parameter must be floating point, got ", param.scalar_type());
}

void check_step(const at::Tensor& step) {
  TORCH_CHECK(step.numel() == 1, "step must be a 1-element tensor, got shape ", step.sizes());
}

at::Tensor sgd_update(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& lr, double weight_decay,
                      bool maximize) {
  check_like(param, grad, "grad");
  at::Tensor p = param.clone();
  sgd_inplace(p, grad, scalar_of(lr, "lr"), weight_decay, maximize);
  return p;
}

void sgd_update_(at::Tensor param, const at::Tensor& grad, const at::Tensor& lr, double weight_decay, bool maximize) {
  check_like(param, grad, "grad");
  sgd_inplace(param, grad, scalar_of(lr, "lr"), weight_decay, maximize);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> sgd_momentum_update(
    const at::Tensor& param, const at::Tensor& grad, const at::Tensor& momentum_buffer, const at::Tensor& step,
    const at::Tensor& lr, double momentum, double dampening, double weight_decay, bool nesterov, bool maximize) {
  check_like(param, grad, "grad");
  check_like(param, momentum_buffer, "momentum_buffer");
  check_step(step);
  at::Tensor p = param.clone(), buf = momentum_buffer.clone(), s = step.clone();
  sgd_momentum_inplace(p, grad, buf, s, scalar_of(lr, "lr"), momentum, dampening, weight_decay, nesterov, maximize);
  return {p, buf, s};
}

void sgd_momentum_update_(at::Tensor param, const at::Tensor& grad, at::Tensor momentum_buffer, at::Tensor step,
                          const at::Tensor& lr, double momentum, double dampening, double weight_decay, bool nesterov,
                          bool maximize) {
  check_like(param, grad, "grad");
  check_like(param, momentum_buffer, "momentum_buffer");
  check_step(step);
  sgd_momentum_inplace(param, grad, momentum_buffer, step, scalar_of(lr, "lr"), momentum, dampening, weight_decay,
                       nesterov, maximize);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> adam_update(
    const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
    const at::Tensor& step, const at::Tensor& lr, double beta1, double beta2, double eps, double weight_decay,
    bool decoupled, bool maximize) {
  check_like(param, grad, "grad");
  check_like(param, exp_avg, "exp_avg");
  check_like(param, exp_avg_sq, "exp_avg_sq");
  check_step(step);
  at::Tensor p = param.clone(), m = exp_avg.clone(), v = exp_avg_sq.clone(), s = step.clone();
  adam_inplace(p, grad, m, v, nullptr, s, scalar_of(lr, "lr"), beta1, beta2, eps, weight_decay, decoupled, maximize);
  return {p, m, v, s};
}

void adam_update_(at::Tensor param, const at::Tensor& grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                  at::Tensor step, const at::Tensor& lr, double beta1, double beta2, double eps, double weight_decay,
                  bool decoupled, bool maximize) {
  check_like(param, grad, "grad");
  check_like(param, exp_avg, "exp_avg");
  check_like(param, exp_avg_sq, "exp_avg_sq");
  check_step(step);
  adam_inplace(param, grad, exp_avg, exp_avg_sq, nullptr, step, scalar_of(lr, "lr"), beta1, beta2, eps, weight_decay,
               decoupled, maximize);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> adam_amsgrad_update(
    const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
    const at::Tensor& max_exp_avg_sq, const at::Tensor& step, const at::Tensor& lr, double beta1, double beta2,
    double eps, double weight_decay, bool decoupled, bool maximize) {
  check_like(param, grad, "grad");
  check_like(param, exp_avg, "exp_avg");
  check_like(param, exp_avg_sq, "exp_avg_sq");
  check_like(param, max_exp_avg_sq, "max_exp_avg_sq");
  check_step(step);
  at::Tensor p = param.clone(), m = exp_avg.clone(), v = exp_avg_sq.clone(), vmax = max_exp_avg_sq.clone(),
             s = step.clone();
  adam_inplace(p, grad, m, v, &vmax, s, scalar_of(lr, "lr"), beta1, beta2, eps, weight_decay, decoupled, maximize);
  return {p, m, v, vmax, s};
}

void adam_amsgrad_update_(at::Tensor param, const at::Tensor& grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                          at::Tensor max_exp_avg_sq, at::Tensor step, const at::Tensor& lr, double beta1, double beta2,
                          double eps, double weight_decay, bool decoupled, bool maximize) {
  check_like(param, grad, "grad");
  check_like(param, exp_avg, "exp_avg");
  check_like(param, exp_avg_sq, "exp_avg_sq");
  check_like(param, max_exp_avg_sq, "max_exp_avg_sq");
  check_step(step);
  adam_inplace(param, grad, exp_avg, exp_avg_sq, &max_exp_avg_sq, step, scalar_of(lr, "lr"), beta1, beta2, eps,
               weight_decay, decoupled, maximize);
}

std::tuple<at::Tensor, at::Tensor> muon_update(const at::Tensor& param, const at::Tensor& grad,
                                               const at::Tensor& momentum_buffer, const at::Tensor& lr,
                                               double weight_decay, double momentum, bool nesterov, double a, double b,
                                               double c, int64_t ns_steps, double eps, double lr_ratio) {
  check_like(param, grad, "grad");
  check_like(param, momentum_buffer, "momentum_buffer");
  at::Tensor p = param.clone(), buf = momentum_buffer.clone();
  muon_inplace(p, grad, buf, scalar_of(lr, "lr"), weight_decay, momentum, nesterov, a, b, c, ns_steps, eps, lr_ratio);
  return {p, buf};
}

void muon_update_(at::Tensor param, const at::Tensor& grad, at::Tensor momentum_buffer, const at::Tensor& lr,
                  double weight_decay, double momentum, bool nesterov, double a, double b, double c, int64_t ns_steps,
                  double eps, double lr_ratio) {
  check_like(param, grad, "grad");
  check_like(param, momentum_buffer, "momentum_buffer");
  muon_inplace(param, grad, momentum_buffer, scalar_of(lr, "lr"), weight_decay, momentum, nesterov, a, b, c, ns_steps,
               eps, lr_ratio);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> rmsprop_update(
    const at::Tensor& param, const at::Tensor& grad, const at::Tensor& square_avg, const at::Tensor& grad_avg,
    const at::Tensor& momentum_buffer, const at::Tensor& step, const at::Tensor& lr, double alpha, double eps,
    double weight_decay, double momentum, bool centered, bool maximize) {
  check_like(param, grad, "grad");
  check_like(param, square_avg, "square_avg");
  check_like(param, grad_avg, "grad_avg");
  check_like(param, momentum_buffer, "momentum_buffer");
  check_step(step);
  at::Tensor p = param.clone(), sq = square_avg.clone(), ga = grad_avg.clone(), buf = momentum_buffer.clone(),
             s = step.clone();
  rmsprop_inplace(p, grad, sq, ga, buf, s, scalar_of(lr, "lr"), alpha, eps, weight_decay, momentum, centered,
                  maximize);
  return {p, sq, ga, buf, s};
}

void rmsprop_update_(at::Tensor param, const at::Tensor& grad, at::Tensor square_avg, at::Tensor grad_avg,
                     at::Tensor momentum_buffer, at::Tensor step, const at::Tensor& lr, double alpha, double eps,
                     double weight_decay, double momentum, bool centered, bool maximize) {
  check_like(param, grad, "grad");
  check_like(param, square_avg, "square_avg");
  check_like(param, grad_avg, "grad_avg");
  check_like(param, momentum_buffer, "momentum_buffer");
  check_step(step);
  rmsprop_inplace(param, grad, square_avg, grad_avg, momentum_buffer, step, scalar_of(lr, "lr"), alpha, eps,
                  weight_decay, momentum, centered, maximize);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> adagrad_update(const at::Tensor& param, const at::Tensor& grad,
                                                              const at::Tensor& state_sum, const at::Tensor& step,
                                                              const at::Tensor& lr, double lr_decay,
                                                              double weight_decay, double eps, bool maximize) {
  check_like(param, grad, "grad");
  check_like(param, state_sum, "sum");
  check_step(step);
  at::Tensor p = param.clone(), sum = state_sum.clone(), s = step.clone();
  adagrad_inplace(p, grad, sum, s, scalar_of(lr, "lr"), lr_decay, weight_decay, eps, maximize);
  return {p, sum, s};
}

void adagrad_update_(at::Tensor param, const at::Tensor& grad, at::Tensor state_sum, at::Tensor step,
                     const at::Tensor& lr, double lr_decay, double weight_decay, double eps, bool maximize) {
  check_like(param, grad, "grad");
  check_like(param, state_sum, "sum");
  check_step(step);
  adagrad_inplace(param, grad, state_sum, step, scalar_of(lr, "lr"), lr_decay, weight_decay, eps, maximize);
}

}  // namespace

TORCH_LIBRARY(torch_ext, m) {
  m.def("sgd_update(Tensor param, Tensor grad, Tensor lr, float weight_decay, bool maximize) -> Tensor");
  m.def("sgd_update_(Tensor(a!) param, Tensor grad, Tensor lr, float weight_decay, bool maximize) -> ()");
  m.def(
      "sgd_momentum_update(Tensor param, Tensor grad, Tensor momentum_buffer, Tensor step, Tensor lr, float momentum, "
      "float dampening, float weight_decay, bool nesterov, bool maximize) -> (Tensor, Tensor, Tensor)");
  m.def(
      "sgd_momentum_update_(Tensor(a!) param, Tensor grad, Tensor(b!) momentum_buffer, Tensor(c!) step, Tensor lr, "
      "float momentum, float dampening, float weight_decay, bool nesterov, bool maximize) -> ()");
  m.def(
      "adam_update(Tensor param, Tensor grad, Tensor exp_avg, Tensor exp_avg_sq, Tensor step, Tensor lr, float beta1, "
      "float beta2, float eps, float weight_decay, bool decoupled, bool maximize) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "adam_update_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, Tensor(d!) step, "
      "Tensor lr, float beta1, float beta2, float eps, float weight_decay, bool decoupled, bool maximize) -> ()");
  m.def(
      "adam_amsgrad_update(Tensor param, Tensor grad, Tensor exp_avg, Tensor exp_avg_sq, Tensor max_exp_avg_sq, "
      "Tensor step, Tensor lr, float beta1, float beta2, float eps, float weight_decay, bool decoupled, bool maximize) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "adam_amsgrad_update_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
      "Tensor(d!) max_exp_avg_sq, Tensor(e!) step, Tensor lr, float beta1, float beta2, float eps, "
      "float weight_decay, bool decoupled, bool maximize) -> ()");
  m.def(
      "muon_update(Tensor param, Tensor grad, Tensor momentum_buffer, Tensor lr, float weight_decay, float momentum, "
      "bool nesterov, float a, float b, float c, int ns_steps, float eps, float lr_ratio) -> (Tensor, Tensor)");
  m.def(
      "muon_update_(Tensor(a!) param, Tensor grad, Tensor(b!) momentum_buffer, Tensor lr, float weight_decay, "
      "float momentum, bool nesterov, float a, float b, float c, int ns_steps, float eps, float lr_ratio) -> ()");
  m.def(
      "rmsprop_update(Tensor param, Tensor grad, Tensor square_avg, Tensor grad_avg, Tensor momentum_buffer, "
      "Tensor step, Tensor lr, float alpha, float eps, float weight_decay, float momentum, bool centered, "
      "bool maximize) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "rmsprop_update_(Tensor(a!) param, Tensor grad, Tensor(b!) square_avg, Tensor(c!) grad_avg, "
      "Tensor(d!) momentum_buffer, Tensor(e!) step, Tensor lr, float alpha, float eps, float weight_decay, "
      "float momentum, bool centered, bool maximize) -> ()");
  m.def(
      "adagrad_update(Tensor param, Tensor grad, Tensor sum, Tensor step, Tensor lr, float lr_decay, "
      "float weight_decay, float eps, bool maximize) -> (Tensor, Tensor, Tensor)");
  m.def(
      "adagrad_update_(Tensor(a!) param, Tensor grad, Tensor(b!) sum, Tensor(c!) step, Tensor lr, float lr_decay, "
      "float weight_decay, float eps, bool maximize) -> ()");
  // Random ops with explicit generator state (see ops/random.h); used by passes/thread_rng.h.
  m.def(
      "native_dropout_rng(Tensor input, float p, bool? train, Tensor rng_state) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(torch_ext, CPU, m) {
  m.impl("sgd_update", &sgd_update);
  m.impl("sgd_update_", &sgd_update_);
  m.impl("sgd_momentum_update", &sgd_momentum_update);
  m.impl("sgd_momentum_update_", &sgd_momentum_update_);
  m.impl("adam_update", &adam_update);
  m.impl("adam_update_", &adam_update_);
  m.impl("adam_amsgrad_update", &adam_amsgrad_update);
  m.impl("adam_amsgrad_update_", &adam_amsgrad_update_);
  m.impl("muon_update", &muon_update);
  m.impl("muon_update_", &muon_update_);
  m.impl("rmsprop_update", &rmsprop_update);
  m.impl("rmsprop_update_", &rmsprop_update_);
  m.impl("adagrad_update", &adagrad_update);
  m.impl("adagrad_update_", &adagrad_update_);
  m.impl("native_dropout_rng", &native_dropout_rng);
}

}  // namespace torch_ext::ops
