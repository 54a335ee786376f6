"""torch.optim.Adadelta: kind "adadelta" (csrc/optim/adadelta.cpp)."""
import torch

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


register(Registration(torch.optim.Adadelta, _read, aten={"adadelta": _aten_adadelta_update}))
