"""Lion: the eager optimizer torch_ext.optim.Lion and its registration as kind "lion" (csrc/optim/lion.cpp).

Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") as lion-pytorch and optax
define it, per parameter with gradient g and momentum m:
    p *= 1 - lr * weight_decay              (decoupled weight decay)
    p -= lr * sign(beta1 * m + (1 - beta1) * g)
    m = beta2 * m + (1 - beta2) * g
"""
from __future__ import annotations

import torch

from ._registry import F64, Registration, operand, read_betas, register

__all__ = ["Lion"]


class Lion(torch.optim.Optimizer):
    """``Lion(params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0)``; its state per parameter is
    ``exp_avg``, the momentum. ``step`` runs the same kernel as the pure step (torch_ext::lion_update_)."""

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0):
        if not lr > 0.0:
            raise ValueError(f"Lion: lr must be positive, got {lr}")
        if len(betas) != 2 or not all(0.0 <= b <= 1.0 for b in betas):
            raise ValueError(f"Lion: betas must be two values in [0, 1], got {betas}")
        if not weight_decay >= 0.0:
            raise ValueError(f"Lion: weight_decay must be >= 0, got {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr = torch.tensor(float(group["lr"]), dtype=torch.float64)
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p)
                torch.ops.torch_ext.lion_update_(p, p.grad, state["exp_avg"], lr, float(beta1), float(beta2),
                                                 float(group["weight_decay"]))
        return loss


def _read(opt, group, param, gi):
    beta1, beta2 = read_betas(opt, group, gi)
    return dict(kind="lion", hyper=dict(beta1=beta1, beta2=beta2,
                                        weight_decay=float(group["weight_decay"])), flags={})


def _aten_lion_update(param, grad, exp_avg, lr, beta1, beta2, weight_decay):
    """csrc/optim/lion.cpp line by line, functional (for Inductor to fuse)."""
    param = param * (1 - lr.to(F64) * weight_decay).to(param.dtype)
    if isinstance(beta1, torch.Tensor):  # scheduled (alpha= takes no tensor): within rounding of the kernel
        update = (exp_avg * operand(beta1, param.dtype) + grad * operand(1 - beta1, param.dtype)).sign()
    else:
        update = torch.add(exp_avg * beta1, grad, alpha=1 - beta1).sign()
    new_param = param + update * (-lr.to(F64)).to(param.dtype)
    return new_param, torch.add(exp_avg * beta2, grad, alpha=1 - beta2)


register(Registration(Lion, _read, aten={"lion": _aten_lion_update}, scheduled={"beta1": ("betas", 0)}))
