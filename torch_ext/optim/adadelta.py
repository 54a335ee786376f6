"""torch.optim.Adadelta: kind "adadelta" (csrc/optim/adadelta.cpp)."""
import torch

from ._onnx import grad_of, op, plus_one, scalar
from ._registry import F64, Registration, aten_grad, once, register


def _read(opt, group, param, gi):
    return dict(kind="adadelta",
                hyper=dict(rho=float(group["rho"]), eps=float(group["eps"]), weight_decay=float(group["weight_decay"])),
                flags=dict(maximize=bool(group.get("maximize", False))))


def _aten_adadelta_update(param, grad, square_avg, acc_delta, step, lr, rho, eps, weight_decay, maximize):
    g = aten_grad(param, grad, weight_decay, maximize)
    sq = torch.addcmul(square_avg * rho, g, g, value=1 - rho)
    delta = (acc_delta + eps).sqrt() / (sq + eps).sqrt() * g
    acc = torch.addcmul(acc_delta * rho, delta, delta, value=1 - rho)
    return param + once((-lr.to(F64)).to(param.dtype)) * delta, sq, acc, step + 1


def _onnx_adadelta_update(param, grad, square_avg, acc_delta, step, lr, rho, eps, weight_decay, maximize):
    """csrc/optim/adadelta.cpp line by line, in onnxscript."""
    new_step = plus_one(step)
    g = grad_of(param, grad, weight_decay, maximize)
    rho_ = scalar(op.Constant(value_float=rho), param)
    one_minus_rho = scalar(op.Constant(value_float=1.0 - rho), param)
    eps_ = scalar(op.Constant(value_float=eps), param)
    sq = op.Add(op.Mul(square_avg, rho_), op.Mul(op.Mul(g, g), one_minus_rho))
    std = op.Sqrt(op.Add(sq, eps_))
    delta = op.Mul(op.Div(op.Sqrt(op.Add(acc_delta, eps_)), std), g)
    acc = op.Add(op.Mul(acc_delta, rho_), op.Mul(op.Mul(delta, delta), one_minus_rho))
    return op.Sub(param, op.Mul(delta, scalar(lr, param))), sq, acc, new_step


register(Registration(torch.optim.Adadelta, _read, aten={"adadelta": _aten_adadelta_update},
                      onnx={"adadelta": _onnx_adadelta_update}))
