"""torch.optim.Adagrad: kind "adagrad" (csrc/optim/adagrad.cpp). Unlike the others, torch.optim
creates its state in the constructor: ``sum`` filled with initial_accumulator_value, step 0."""
import torch

from ._onnx import dconst, f64, grad_of, op, plus_one, scalar
from ._registry import F64, Registration, aten_grad, default_initial_state, once, refuse_rounded_tensor_lr, register


def _read(opt, group, param, gi):
    if float(group["lr_decay"]) != 0:  # with lr_decay 0, clr = lr / 1 keeps lr's value exactly
        refuse_rounded_tensor_lr(opt, group, gi, "its decayed rate lr / (1 + (t - 1) * lr_decay)")
    return dict(kind="adagrad",
                hyper=dict(lr_decay=float(group["lr_decay"]), weight_decay=float(group["weight_decay"]),
                           eps=float(group["eps"])),
                flags=dict(maximize=bool(group.get("maximize", False))))


def _initial_state(kind, st, param, group):
    out = default_initial_state(kind, st, param, group)
    if st.get("sum") is None:
        out["sum"] = torch.full_like(param, float(group.get("initial_accumulator_value", 0.0)),
                                     memory_format=torch.preserve_format)
    return out


def _torch_state(kind, values, group):
    return {"step": values["step"].clone(), "sum": values["sum"].clone()}


def _aten_adagrad_update(param, grad, sum, step, lr, lr_decay, weight_decay, eps, maximize):  # noqa: A002
    new_step = step + 1
    g = aten_grad(param, grad, weight_decay, maximize)
    clr = lr.to(F64) / (1 + (new_step.to(F64) - 1) * lr_decay)
    new_sum = torch.addcmul(sum, g, g)
    std = new_sum.sqrt() + eps
    return param + once((-clr).to(param.dtype)) * g / std, new_sum, new_step


def _onnx_adagrad_update(param, grad, sum, step, lr, lr_decay, weight_decay, eps, maximize):  # noqa: A002
    new_step = plus_one(step)
    g = grad_of(param, grad, weight_decay, maximize)
    s64 = f64(new_step)
    clr = op.Div(f64(lr), op.Add(dconst(1.0), op.Mul(op.Sub(s64, dconst(1.0)), dconst(lr_decay))))
    new_sum = op.Add(sum, op.Mul(g, g))
    std = op.Add(op.Sqrt(new_sum), scalar(op.Constant(value_float=eps), param))
    return op.Sub(param, op.Mul(op.Div(g, std), op.CastLike(clr, param))), new_sum, new_step


register(Registration(torch.optim.Adagrad, _read, _initial_state, _torch_state, aten={"adagrad": _aten_adagrad_update},
                      onnx={"adagrad": _onnx_adagrad_update}))
