"""torch.optim.NAdam: kind "nadam" (csrc/optim/nadam.cpp), with its per-parameter ``mu_product``
(an f32[] slot that starts at 1)."""
import torch

from ._registry import (F64, Registration, once, operand, read_betas, refuse_default_foreach, refuse_rounded_tensor_lr,
                        register)


def _read(opt, group, param, gi):
    name = type(opt).__name__
    beta1, beta2 = read_betas(opt, group, gi)
    refuse_default_foreach(opt, group, param, gi)
    refuse_rounded_tensor_lr(opt, group, gi, "its momentum factors lr * (1 - mu_t) / (1 - prod mu)")
    # torch.optim keeps mu_product in torch's scalar dtype (float64 under torch.set_default_dtype(torch.float64));
    # the step's slot is float32, so a float64 product would be rounded every step.
    mu_product = opt.state.get(param, {}).get("mu_product")
    dtype = mu_product.dtype if isinstance(mu_product, torch.Tensor) else torch.get_default_dtype()
    if dtype == torch.float64:
        raise ValueError(f"{name} param group {gi}: its mu_product is (or would be created as) a float64 tensor "
                         "(torch's default dtype is float64); the pure step keeps it in float32 as torch.optim does "
                         "under the default float32. Build the step with torch.get_default_dtype() == torch.float32")
    return dict(kind="nadam",
                hyper=dict(beta1=beta1, beta2=beta2, eps=float(group["eps"]),
                           weight_decay=float(group["weight_decay"]), momentum_decay=float(group["momentum_decay"])),
                flags=dict(decoupled=bool(group.get("decoupled_weight_decay", False)),
                           maximize=bool(group.get("maximize", False))))


def _aten_nadam_update(param, grad, exp_avg, exp_avg_sq, mu_product, step, lr, beta1, beta2, eps, weight_decay,
                       momentum_decay, decoupled, maximize):
    """csrc/optim/nadam.cpp line by line, functional (for Inductor to fuse)."""
    g = grad.neg() if maximize else grad
    new_step = step + 1
    s = new_step.to(F64)
    lr64 = lr.to(F64)
    bias_correction2 = 1 - torch.pow(beta2, s)
    if weight_decay != 0:
        if decoupled:
            param = param * once((1 - lr64 * weight_decay).to(param.dtype))
        else:
            g = g.add(param, alpha=weight_decay)
    mu = beta1 * (1.0 - 0.5 * torch.pow(0.96, s * momentum_decay))
    mu_next = beta1 * (1.0 - 0.5 * torch.pow(0.96, (s + 1) * momentum_decay))
    new_mu_product = mu_product * mu.to(mu_product.dtype)  # float32 * float32, as the kernel's wrapped scalar
    mu_product_now = new_mu_product.to(F64)
    m = torch.lerp(exp_avg, g, operand(1 - beta1, param.dtype))
    v = torch.addcmul(exp_avg_sq * beta2, g, g, value=1 - beta2)
    denom = (v / once(bias_correction2.to(param.dtype))).sqrt() + eps
    c_grad = -lr64 * (1.0 - mu) / (1.0 - mu_product_now)
    c_avg = (-lr64 * mu_next) / (1.0 - mu_product_now * mu_next)
    new_param = param + once(c_grad.to(param.dtype)) * g / denom + once(c_avg.to(param.dtype)) * m / denom
    return new_param, m, v, new_mu_product, new_step


register(Registration(torch.optim.NAdam, _read, foreach_exact=False,
                      aten={"nadam": _aten_nadam_update},
                      scheduled={"beta1": ("betas", 0)}))
