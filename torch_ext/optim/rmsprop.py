"""torch.optim.RMSprop: kind "rmsprop" (csrc/optim/rmsprop.cpp)."""
import torch

from ._registry import Registration, register


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


register(Registration(torch.optim.RMSprop, _read, torch_state=_torch_state))
