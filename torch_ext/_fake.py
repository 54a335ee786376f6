"""Fake (meta) kernels for torch.ops.torch_ext.*, so the ops trace through torch.export and AOTInductor.

The schemas and the CPU kernels live in csrc/ops/library.cpp.
"""
import torch


def _like(*ts):
    return tuple(torch.empty_like(t) for t in ts)


@torch.library.register_fake("torch_ext::sgd_update")
def _(param, grad, lr, weight_decay, maximize):
    return torch.empty_like(param)


@torch.library.register_fake("torch_ext::sgd_momentum_update")
def _(param, grad, momentum_buffer, step, lr, momentum, dampening, weight_decay, nesterov, maximize):
    return _like(param, momentum_buffer, step)


@torch.library.register_fake("torch_ext::adam_update")
def _(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, decoupled, maximize):
    return _like(param, exp_avg, exp_avg_sq, step)


@torch.library.register_fake("torch_ext::adam_amsgrad_update")
def _(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, decoupled,
      maximize):
    return _like(param, exp_avg, exp_avg_sq, max_exp_avg_sq, step)


@torch.library.register_fake("torch_ext::muon_update")
def _(param, grad, momentum_buffer, lr, weight_decay, momentum, nesterov, a, b, c, ns_steps, eps, lr_ratio):
    return _like(param, momentum_buffer)


@torch.library.register_fake("torch_ext::rmsprop_update")
def _(param, grad, square_avg, grad_avg, momentum_buffer, step, lr, alpha, eps, weight_decay, momentum, centered,
      maximize):
    return _like(param, square_avg, grad_avg, momentum_buffer, step)


@torch.library.register_fake("torch_ext::adagrad_update")
def _(param, grad, sum, step, lr, lr_decay, weight_decay, eps, maximize):
    return _like(param, sum, step)


for _name in ("sgd_update_", "sgd_momentum_update_", "adam_update_", "adam_amsgrad_update_", "muon_update_",
              "rmsprop_update_", "adagrad_update_"):
    torch.library.register_fake(f"torch_ext::{_name}")(lambda *args, **kwargs: None)


@torch.library.register_fake("torch_ext::native_dropout_rng")
def _(input, p, train, rng_state):
    # (output, bool mask, advanced generator state), shaped as aten::native_dropout's outputs.
    return torch.empty_like(input), torch.empty_like(input, dtype=torch.bool), torch.empty_like(rng_state)
