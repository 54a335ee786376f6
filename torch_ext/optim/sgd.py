"""torch.optim.SGD: kind "sgd" (momentum == 0) or "sgd_momentum" (csrc/optim/sgd.cpp)."""
import torch

from ._onnx import dconst, grad_of, hyper, op, plus_one, scalar, scheduled
from ._registry import F64, Registration, aten_grad, operand, register


def _read(opt, group, param, gi):
    maximize = bool(group.get("maximize", False))
    if group["momentum"] == 0:
        if group["nesterov"]:
            raise ValueError(f"SGD param group {gi}: nesterov requires momentum > 0")
        return dict(kind="sgd", hyper=dict(weight_decay=float(group["weight_decay"])), flags=dict(maximize=maximize))
    return dict(kind="sgd_momentum",
                hyper=dict(momentum=float(group["momentum"]), dampening=float(group["dampening"]),
                           weight_decay=float(group["weight_decay"])),
                flags=dict(nesterov=bool(group["nesterov"]), maximize=maximize))


def _initial_state(kind, st, param, group):
    if kind == "sgd":
        return {}
    # torch.optim keeps no step for SGD: the counter only says whether the buffer exists yet.
    buf = st.get("momentum_buffer")
    return {"momentum_buffer": buf.detach().clone() if buf is not None else torch.zeros_like(param),
            "step": torch.tensor(0.0 if buf is None else 1.0)}


def _torch_state(kind, values, group):
    if kind == "sgd" or float(values["step"]) == 0:
        return {}
    return {"momentum_buffer": values["momentum_buffer"].clone()}


def _aten_sgd_update(param, grad, lr, weight_decay, maximize):
    return param + aten_grad(param, grad, weight_decay, maximize) * (-lr.to(F64)).to(param.dtype)


def _aten_sgd_momentum_update(param, grad, momentum_buffer, step, lr, momentum, dampening, weight_decay, nesterov,
                              maximize):
    g = aten_grad(param, grad, weight_decay, maximize)
    # torch.optim starts the buffer as a copy of the first gradient.
    neg_lr = (-lr.to(F64)).to(param.dtype)
    if isinstance(momentum, torch.Tensor):  # scheduled: a tensor (no alpha=), which may reach 0 (then plain SGD)
        m = operand(momentum, param.dtype)
        buf = torch.where(step == 0, g, torch.add(momentum_buffer * m, g, alpha=1 - dampening))
        d = g + buf * m if nesterov else buf
        on = momentum != 0
        return (param + torch.where(on, d, g) * neg_lr, torch.where(on, buf, momentum_buffer),
                torch.where(on, step + 1, step))
    buf = torch.where(step == 0, g, torch.add(momentum_buffer * momentum, g, alpha=1 - dampening))
    d = g.add(buf, alpha=momentum) if nesterov else buf
    return param + d * neg_lr, buf, step + 1


def _onnx_sgd_update(param, grad, lr, weight_decay, maximize):
    g = grad_of(param, grad, weight_decay, maximize)
    return op.Sub(param, op.Mul(g, scalar(lr, param)))


def _onnx_sgd_momentum_update(param, grad, momentum_buffer, step, lr, momentum, dampening, weight_decay, nesterov,
                              maximize):
    g = grad_of(param, grad, weight_decay, maximize)
    first = op.Equal(step, op.CastLike(op.Constant(value_float=0.0), step))
    mixed = op.Add(op.Mul(momentum_buffer, hyper(momentum, param)),
                   op.Mul(g, scalar(op.Constant(value_float=1.0 - dampening), param)))
    buf = op.Where(first, g, mixed)
    update = op.Add(g, op.Mul(buf, hyper(momentum, param))) if nesterov else buf
    new_step = plus_one(step)
    if scheduled(momentum):  # it may reach 0: torch.optim then takes a plain SGD step, the buffer kept
        on = op.Not(op.Equal(momentum, dconst(0.0)))
        update, buf, new_step = op.Where(on, update, g), op.Where(on, buf, momentum_buffer), \
            op.Where(on, new_step, step)
    new_param = op.Sub(param, op.Mul(update, scalar(lr, param)))
    return new_param, buf, new_step


register(Registration(torch.optim.SGD, _read, _initial_state, _torch_state,
                      aten={"sgd": _aten_sgd_update, "sgd_momentum": _aten_sgd_momentum_update},
                      onnx={"sgd": _onnx_sgd_update, "sgd_momentum": _onnx_sgd_momentum_update},
                      scheduled={"momentum": ("momentum", None)}))
