"""torch.optim.Adam and AdamW: kind "adam", or "adam_amsgrad" with amsgrad=True (csrc/optim/adam.cpp)."""
import torch

from ._registry import Registration, register


def _read(opt, group, param, gi):
    if any(isinstance(b, torch.Tensor) for b in group["betas"]):
        raise ValueError(f"{type(opt).__name__} param group {gi}: tensor betas are not supported")
    beta1, beta2 = group["betas"]
    decoupled = isinstance(opt, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))
    return dict(kind="adam_amsgrad" if group["amsgrad"] else "adam",
                hyper=dict(beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                           weight_decay=float(group["weight_decay"])),
                flags=dict(decoupled=decoupled, maximize=bool(group.get("maximize", False))))


register(Registration(torch.optim.Adam, _read))
register(Registration(torch.optim.AdamW, _read))
