"""torch.optim.Adam and AdamW: kind "adam", or "adam_amsgrad" with amsgrad=True (csrc/optim/adam.cpp)."""
import torch

from ._onnx import dconst, f64, one_minus, op, plus_one, scalar, scheduled
from ._registry import F64, Registration, once, operand, read_betas, refuse_rounded_tensor_lr, register


def _read(opt, group, param, gi):
    beta1, beta2 = read_betas(opt, group, gi)
    refuse_rounded_tensor_lr(opt, group, gi, "its step size lr / (1 - beta1^t) and decay factor 1 - lr * weight_decay")
    decoupled = isinstance(opt, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))
    return dict(kind="adam_amsgrad" if group["amsgrad"] else "adam",
                hyper=dict(beta1=beta1, beta2=beta2, eps=float(group["eps"]),
                           weight_decay=float(group["weight_decay"])),
                flags=dict(decoupled=decoupled, maximize=bool(group.get("maximize", False))))


def _adam(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, decoupled,
          maximize):
    g = grad.neg() if maximize else grad
    new_step = step + 1
    lr64 = lr.to(F64)
    if weight_decay != 0:
        if decoupled:
            param = param * once((1 - lr64 * weight_decay).to(param.dtype))
        else:
            g = g.add(param, alpha=weight_decay)
    m = torch.lerp(exp_avg, g, operand(1 - beta1, param.dtype))  # beta1: a float, or scheduled (a tensor)
    v = torch.addcmul(exp_avg_sq * beta2, g, g, value=1 - beta2)
    s = new_step.to(F64)
    bias_correction1 = 1 - torch.pow(beta1, s)
    bias_correction2_sqrt = torch.pow(1 - torch.pow(beta2, s), 0.5)
    step_size = lr64 / bias_correction1
    new_max = torch.maximum(max_exp_avg_sq, v) if max_exp_avg_sq is not None else None
    denom = (v if new_max is None else new_max).sqrt() / once(bias_correction2_sqrt.to(param.dtype)) + eps
    new_param = param + once((-step_size).to(param.dtype)) * m / denom
    return new_param, m, v, new_max, new_step


def _aten_adam_update(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, decoupled,
                      maximize):
    p, m, v, _, s = _adam(param, grad, exp_avg, exp_avg_sq, None, step, lr, beta1, beta2, eps, weight_decay,
                          decoupled, maximize)
    return p, m, v, s


def _aten_adam_amsgrad_update(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, lr, beta1, beta2, eps,
                              weight_decay, decoupled, maximize):
    return _adam(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay,
                 decoupled, maximize)


def _onnx_adam(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, decoupled,
               maximize):
    g = op.Neg(grad) if maximize else grad
    new_step = plus_one(step)
    lr64 = f64(lr)
    p = param
    if weight_decay != 0:
        if decoupled:
            p = op.Mul(p, op.CastLike(op.Sub(dconst(1.0), op.Mul(lr64, dconst(weight_decay))), param))
        else:
            g = op.Add(g, op.Mul(param, scalar(op.Constant(value_float=weight_decay), param)))
    m = op.Add(exp_avg, op.Mul(op.Sub(g, exp_avg), one_minus(beta1, param)))
    v = op.Add(op.Mul(exp_avg_sq, scalar(op.Constant(value_float=beta2), param)),
               op.Mul(op.Mul(g, g), scalar(op.Constant(value_float=1.0 - beta2), param)))
    s64 = f64(new_step)
    bc1 = op.Sub(dconst(1.0), op.Pow(beta1 if scheduled(beta1) else dconst(beta1), s64))
    bc2 = op.Sub(dconst(1.0), op.Pow(dconst(beta2), s64))
    step_size = op.Div(lr64, bc1)
    bc2_sqrt = op.Sqrt(bc2)
    new_max = op.Max(max_exp_avg_sq, v) if max_exp_avg_sq is not None else None
    second = new_max if new_max is not None else v
    denom = op.Add(op.Div(op.Sqrt(second), op.CastLike(bc2_sqrt, param)), scalar(op.Constant(value_float=eps), param))
    new_param = op.Sub(p, op.Mul(op.Div(m, denom), op.CastLike(step_size, param)))
    return new_param, m, v, new_max, new_step


def _onnx_adam_update(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, decoupled,
                      maximize):
    p, m, v, _, s = _onnx_adam(param, grad, exp_avg, exp_avg_sq, None, step, lr, beta1, beta2, eps, weight_decay,
                               decoupled, maximize)
    return p, m, v, s


def _onnx_adam_amsgrad_update(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, lr, beta1, beta2, eps,
                              weight_decay, decoupled, maximize):
    return _onnx_adam(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay,
                      decoupled, maximize)


_ATEN = {"adam": _aten_adam_update, "adam_amsgrad": _aten_adam_amsgrad_update}
_ONNX = {"adam": _onnx_adam_update, "adam_amsgrad": _onnx_adam_amsgrad_update}
_SCHEDULED = {"beta1": ("betas", 0)}
register(Registration(torch.optim.Adam, _read, aten=_ATEN, onnx=_ONNX, scheduled=_SCHEDULED))
register(Registration(torch.optim.AdamW, _read, aten=_ATEN, onnx=_ONNX, scheduled=_SCHEDULED))
