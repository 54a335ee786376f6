"""torch.optim.RAdam: kind "radam" (csrc/optim/radam.cpp). Whether a step is rectified depends on the
step count, so the kernel, and the ATen form below (torch.where on the step input), decide it per step."""
import torch

from ._registry import (F64, Registration, once, operand, read_betas, refuse_default_foreach, refuse_rounded_tensor_lr,
                        register)


def _read(opt, group, param, gi):
    beta1, beta2 = read_betas(opt, group, gi)
    refuse_default_foreach(opt, group, param, gi)
    refuse_rounded_tensor_lr(opt, group, gi, "its decay factor 1 - lr * weight_decay and lr-scaled update")
    return dict(kind="radam",
                hyper=dict(beta1=beta1, beta2=beta2, eps=float(group["eps"]),
                           weight_decay=float(group["weight_decay"])),
                flags=dict(decoupled=bool(group.get("decoupled_weight_decay", False)),
                           maximize=bool(group.get("maximize", False))))


def _aten_radam_update(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, decoupled,
                       maximize):
    """csrc/optim/radam.cpp line by line, functional; the rectification branch is a torch.where on the step."""
    g = grad.neg() if maximize else grad
    new_step = step + 1
    s = new_step.to(F64)
    lr64 = lr.to(F64)
    if weight_decay != 0:
        if decoupled:
            param = param * once((1 - lr64 * weight_decay).to(param.dtype))
        else:
            g = g.add(param, alpha=weight_decay)
    m = torch.lerp(exp_avg, g, operand(1 - beta1, param.dtype))
    v = torch.addcmul(exp_avg_sq * beta2, g, g, value=1 - beta2)
    bias_correction1 = 1 - torch.pow(beta1, s)
    bias_correction2 = 1 - torch.pow(beta2, s)
    update = m / once(bias_correction1.to(param.dtype)) * once(lr64.to(param.dtype))
    rho_inf = 2 / (1 - beta2) - 1
    rho_t = rho_inf - 2 * s * torch.pow(beta2, s) / bias_correction2
    # Unrectified steps have a negative ratio: clamped so the branch not taken holds no NaN.
    rect = ((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)).clamp_min(0).sqrt()
    adaptive_lr = once(bias_correction2.sqrt().to(param.dtype)) / (v.sqrt() + eps)
    rectified = update * adaptive_lr * once(rect.to(param.dtype))
    return param - torch.where(rho_t > 5.0, rectified, update), m, v, new_step


register(Registration(torch.optim.RAdam, _read, foreach_exact=False,
                      aten={"radam": _aten_radam_update},
                      scheduled={"beta1": ("betas", 0)}))
