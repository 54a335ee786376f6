"""torch.optim.Adamax: kind "adamax" (csrc/optim/adamax.cpp)."""
import torch

from ._onnx import dconst, f64, grad_of, one_minus, op, plus_one, scalar, scheduled
from ._registry import F64, Registration, aten_grad, once, operand, read_betas, refuse_rounded_tensor_lr, register


def _read(opt, group, param, gi):
    beta1, beta2 = read_betas(opt, group, gi)
    refuse_rounded_tensor_lr(opt, group, gi, "its step size lr / (1 - beta1^t)")
    return dict(kind="adamax",
                hyper=dict(beta1=beta1, beta2=beta2, eps=float(group["eps"]),
                           weight_decay=float(group["weight_decay"])),
                flags=dict(maximize=bool(group.get("maximize", False))))


def _aten_adamax_update(param, grad, exp_avg, exp_inf, step, lr, beta1, beta2, eps, weight_decay, maximize):
    new_step = step + 1
    g = aten_grad(param, grad, weight_decay, maximize)
    m = torch.lerp(exp_avg, g, operand(1 - beta1, param.dtype))  # beta1: a float, or scheduled (a tensor)
    u = torch.maximum(exp_inf * beta2, g.abs() + eps)
    clr = lr.to(F64) / (1 - torch.pow(beta1, new_step.to(F64)))
    return param + once((-clr).to(param.dtype)) * m / u, m, u, new_step


def _onnx_adamax_update(param, grad, exp_avg, exp_inf, step, lr, beta1, beta2, eps, weight_decay, maximize):
    """csrc/optim/adamax.cpp line by line, in onnxscript."""
    new_step = plus_one(step)
    g = grad_of(param, grad, weight_decay, maximize)
    m = op.Add(exp_avg, op.Mul(op.Sub(g, exp_avg), one_minus(beta1, param)))
    norm = op.Add(op.Abs(g), scalar(op.Constant(value_float=eps), param))
    u = op.Max(op.Mul(exp_inf, scalar(op.Constant(value_float=beta2), param)), norm)
    clr = op.Div(f64(lr), op.Sub(dconst(1.0), op.Pow(beta1 if scheduled(beta1) else dconst(beta1), f64(new_step))))
    return op.Sub(param, op.Mul(op.Div(m, u), op.CastLike(clr, param))), m, u, new_step


register(Registration(torch.optim.Adamax, _read, aten={"adamax": _aten_adamax_update},
                      onnx={"adamax": _onnx_adamax_update},
                      scheduled={"beta1": ("betas", 0)}))
