"""torch.optim.RMSprop: kind "rmsprop" (csrc/optim/rmsprop.cpp)."""
import torch

from ._onnx import dconst, grad_of, hyper, op, plus_one, scalar, scheduled
from ._registry import F64, Registration, aten_grad, operand, register


def _read(opt, group, param, gi):
    return dict(kind="rmsprop",
                hyper=dict(alpha=float(group["alpha"]), eps=float(group["eps"]),
                           weight_decay=float(group["weight_decay"]), momentum=float(group["momentum"])),
                flags=dict(centered=bool(group["centered"]), maximize=bool(group.get("maximize", False))))


def _torch_state(kind, values, group):
    # torch.optim creates grad_avg only when centered and momentum_buffer only when momentum > 0.
    if float(values["step"]) == 0:
        return {}
    st = {"step": values["step"].clone(), "square_avg": values["square_avg"].clone()}
    if group["momentum"] > 0:
        st["momentum_buffer"] = values["momentum_buffer"].clone()
    if group["centered"]:
        st["grad_avg"] = values["grad_avg"].clone()
    return st


def _aten_rmsprop_update(param, grad, square_avg, grad_avg, momentum_buffer, step, lr, alpha, eps, weight_decay, momentum,
                   centered, maximize):
    g = aten_grad(param, grad, weight_decay, maximize)
    sq = torch.addcmul(square_avg * alpha, g, g, value=1 - alpha)
    ga = grad_avg
    if centered:
        ga = torch.lerp(grad_avg, g, 1 - alpha)
        avg = torch.addcmul(sq, ga, ga, value=-1).sqrt()
    else:
        avg = sq.sqrt()
    avg = avg + eps
    neg_lr = (-lr.to(F64)).to(param.dtype)
    buf = momentum_buffer
    if isinstance(momentum, torch.Tensor):  # scheduled: the kernel's branch, taken per step
        on = momentum > 0
        buf = torch.where(on, momentum_buffer * operand(momentum, param.dtype) + g / avg, momentum_buffer)
        new_param = torch.where(on, param + neg_lr * buf, param + neg_lr * g / avg)
    elif momentum > 0:
        buf = momentum_buffer * momentum + g / avg
        new_param = param + neg_lr * buf
    else:
        new_param = param + neg_lr * g / avg
    return new_param, sq, ga, buf, step + 1


def _onnx_rmsprop_update(param, grad, square_avg, grad_avg, momentum_buffer, step, lr, alpha, eps, weight_decay,
                         momentum, centered, maximize):
    g = grad_of(param, grad, weight_decay, maximize)
    new_step = plus_one(step)
    sq = op.Add(op.Mul(square_avg, scalar(op.Constant(value_float=alpha), param)),
                op.Mul(op.Mul(g, g), scalar(op.Constant(value_float=1.0 - alpha), param)))
    ga = grad_avg
    if centered:
        ga = op.Add(grad_avg, op.Mul(op.Sub(g, grad_avg), scalar(op.Constant(value_float=1.0 - alpha), param)))
        avg = op.Sqrt(op.Sub(sq, op.Mul(ga, ga)))
    else:
        avg = op.Sqrt(sq)
    avg = op.Add(avg, scalar(op.Constant(value_float=eps), param))
    buf = momentum_buffer
    if scheduled(momentum):  # the kernel's branch, taken per step
        on = op.Greater(momentum, dconst(0.0))
        buf = op.Where(on, op.Add(op.Mul(momentum_buffer, hyper(momentum, param)), op.Div(g, avg)), momentum_buffer)
        new_param = op.Sub(param, op.Mul(op.Where(on, buf, op.Div(g, avg)), scalar(lr, param)))
    elif momentum > 0:
        buf = op.Add(op.Mul(momentum_buffer, scalar(op.Constant(value_float=momentum), param)), op.Div(g, avg))
        new_param = op.Sub(param, op.Mul(buf, scalar(lr, param)))
    else:
        new_param = op.Sub(param, op.Mul(op.Div(g, avg), scalar(lr, param)))
    return new_param, sq, ga, buf, new_step


register(Registration(torch.optim.RMSprop, _read, torch_state=_torch_state, aten={"rmsprop": _aten_rmsprop_update},
                      onnx={"rmsprop": _onnx_rmsprop_update},
                      scheduled={"momentum": ("momentum", None)}))
