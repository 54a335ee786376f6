"""torch.optim.NAdam: kind "nadam" (csrc/optim/nadam.cpp), with its per-parameter ``mu_product``
(an f32[] slot that starts at 1)."""
import torch

from ._onnx import dconst, f64, one_minus, op, plus_one, scalar, scheduled
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


def _onnx_nadam_update(param, grad, exp_avg, exp_avg_sq, mu_product, step, lr, beta1, beta2, eps, weight_decay,
                       momentum_decay, decoupled, maximize):
    """csrc/optim/nadam.cpp line by line, in onnxscript: the momentum schedule in double, the
    float32 mu_product times mu in float32 (the kernel's wrapped scalar)."""
    g = op.Neg(grad) if maximize else grad
    new_step = plus_one(step)
    s = f64(new_step)
    lr64 = f64(lr)
    one = dconst(1.0)
    bias_correction2 = op.Sub(one, op.Pow(dconst(beta2), s))
    p = param
    if weight_decay != 0:
        if decoupled:
            p = op.Mul(p, op.CastLike(op.Sub(one, op.Mul(lr64, dconst(weight_decay))), param))
        else:
            g = op.Add(g, op.Mul(param, scalar(op.Constant(value_float=weight_decay), param)))
    b1 = beta1 if scheduled(beta1) else dconst(beta1)

    def mu_at(t):  # beta1 * (1 - 0.5 * 0.96^(t * momentum_decay))
        return op.Mul(b1, op.Sub(one, op.Mul(dconst(0.5), op.Pow(dconst(0.96), op.Mul(t, dconst(momentum_decay))))))

    mu, mu_next = mu_at(s), mu_at(op.Add(s, one))
    new_mu_product = op.Mul(mu_product, op.CastLike(mu, mu_product))
    m = op.Add(exp_avg, op.Mul(op.Sub(g, exp_avg), one_minus(beta1, param)))
    v = op.Add(op.Mul(exp_avg_sq, scalar(op.Constant(value_float=beta2), param)),
               op.Mul(op.Mul(g, g), scalar(op.Constant(value_float=1.0 - beta2), param)))
    denom = op.Add(op.Sqrt(op.Div(v, op.CastLike(bias_correction2, param))),
                   scalar(op.Constant(value_float=eps), param))
    mu_product_now = f64(new_mu_product)
    mu_product_next = op.Mul(mu_product_now, mu_next)
    neg_lr = op.Neg(lr64)
    c_grad = op.Div(op.Mul(neg_lr, op.Sub(one, mu)), op.Sub(one, mu_product_now))
    c_avg = op.Div(op.Mul(neg_lr, mu_next), op.Sub(one, mu_product_next))
    p = op.Add(p, op.Mul(op.Div(g, denom), op.CastLike(c_grad, param)))
    p = op.Add(p, op.Mul(op.Div(m, denom), op.CastLike(c_avg, param)))
    return p, m, v, new_mu_product, new_step


register(Registration(torch.optim.NAdam, _read, foreach_exact=False,
                      aten={"nadam": _aten_nadam_update}, onnx={"nadam": _onnx_nadam_update},
                      scheduled={"beta1": ("betas", 0)}))
