"""The update ops as ATen math, for compilers that fuse (``TrainStep.to_aoti``).

In the pure step's program each parameter's update is one ``torch_ext::<kind>_update`` call, whose
kernel is C++ (csrc/optim/<kind>.cpp) made of eager ATen calls. AOTInductor cannot look inside it:
it calls the kernel as an opaque fallback, one eager op (and one allocation) per line of the
update, and the update costs most of a step (ResNet-18 with AdamW: 83% of the AOTInductor step's CPU time).
Written here as functional ATen, the same formula is fused by Inductor into a kernel or two per
parameter. The C++ kernel stays the reference (the executor and the arena run it bit-exact with
torch.optim); these follow it line by line, in the same dtypes (scalars that torch.optim keeps as
Python floats are computed in float64), so they agree with it to float32 rounding (tested in
tests/python/test_optim_decompositions.py). A kind without an entry still works in AOTInductor,
unfused.
"""
from __future__ import annotations

import torch

__all__ = ["decompositions"]

f64 = torch.float64


def _grad(param, grad, weight_decay, maximize):
    g = grad.neg() if maximize else grad
    return g.add(param, alpha=weight_decay) if weight_decay != 0 else g


def _adam(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, decoupled,
          maximize):
    g = grad.neg() if maximize else grad
    new_step = step + 1
    lr64 = lr.to(f64)
    if weight_decay != 0:
        if decoupled:
            param = param * (1 - lr64 * weight_decay).to(param.dtype)
        else:
            g = g.add(param, alpha=weight_decay)
    m = torch.lerp(exp_avg, g, 1 - beta1)
    v = torch.addcmul(exp_avg_sq * beta2, g, g, value=1 - beta2)
    s = new_step.to(f64)
    bias_correction1 = 1 - torch.pow(beta1, s)
    bias_correction2_sqrt = torch.pow(1 - torch.pow(beta2, s), 0.5)
    step_size = lr64 / bias_correction1
    new_max = torch.maximum(max_exp_avg_sq, v) if max_exp_avg_sq is not None else None
    denom = (v if new_max is None else new_max).sqrt() / bias_correction2_sqrt.to(param.dtype) + eps
    new_param = param + (-step_size).to(param.dtype) * m / denom
    return new_param, m, v, new_max, new_step


def adam_update(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, decoupled, maximize):
    p, m, v, _, s = _adam(param, grad, exp_avg, exp_avg_sq, None, step, lr, beta1, beta2, eps, weight_decay,
                          decoupled, maximize)
    return p, m, v, s


def adam_amsgrad_update(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay,
                        decoupled, maximize):
    return _adam(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay,
                 decoupled, maximize)


def sgd_update(param, grad, lr, weight_decay, maximize):
    return param + _grad(param, grad, weight_decay, maximize) * (-lr.to(f64)).to(param.dtype)


def sgd_momentum_update(param, grad, momentum_buffer, step, lr, momentum, dampening, weight_decay, nesterov,
                        maximize):
    g = _grad(param, grad, weight_decay, maximize)
    # torch.optim starts the buffer as a copy of the first gradient.
    buf = torch.where(step == 0, g, torch.add(momentum_buffer * momentum, g, alpha=1 - dampening))
    d = g.add(buf, alpha=momentum) if nesterov else buf
    return param + d * (-lr.to(f64)).to(param.dtype), buf, step + 1


def rmsprop_update(param, grad, square_avg, grad_avg, momentum_buffer, step, lr, alpha, eps, weight_decay, momentum,
                   centered, maximize):
    g = _grad(param, grad, weight_decay, maximize)
    sq = torch.addcmul(square_avg * alpha, g, g, value=1 - alpha)
    ga = grad_avg
    if centered:
        ga = torch.lerp(grad_avg, g, 1 - alpha)
        avg = torch.addcmul(sq, ga, ga, value=-1).sqrt()
    else:
        avg = sq.sqrt()
    avg = avg + eps
    neg_lr = (-lr.to(f64)).to(param.dtype)
    buf = momentum_buffer
    if momentum > 0:
        buf = momentum_buffer * momentum + g / avg
        new_param = param + neg_lr * buf
    else:
        new_param = param + neg_lr * g / avg
    return new_param, sq, ga, buf, step + 1


def adagrad_update(param, grad, sum, step, lr, lr_decay, weight_decay, eps, maximize):  # noqa: A002
    new_step = step + 1
    g = _grad(param, grad, weight_decay, maximize)
    clr = lr.to(f64) / (1 + (new_step.to(f64) - 1) * lr_decay)
    new_sum = torch.addcmul(sum, g, g)
    std = new_sum.sqrt() + eps
    return param + (-clr).to(param.dtype) * g / std, new_sum, new_step


def decompositions() -> dict:
    """{torch_ext update OpOverload: its ATen implementation above}."""
    ops = torch.ops.torch_ext
    return {ops.adam_update.default: adam_update, ops.adam_amsgrad_update.default: adam_amsgrad_update,
            ops.sgd_update.default: sgd_update, ops.sgd_momentum_update.default: sgd_momentum_update,
            ops.rmsprop_update.default: rmsprop_update, ops.adagrad_update.default: adagrad_update}
