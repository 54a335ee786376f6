"""torch.optim.RAdam: kind "radam" (csrc/optim/radam.cpp). Whether a step is rectified depends on the
step count, so the kernel, and the ATen and ONNX forms below (a where on the step input), decide it per step."""
import torch

from ._onnx import dconst, f64, one_minus, op, plus_one, scalar, scheduled
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


def _onnx_radam_update(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, decoupled,
                       maximize):
    """csrc/optim/radam.cpp line by line, in onnxscript; the rectification branch is a Where on the step."""
    g = op.Neg(grad) if maximize else grad
    new_step = plus_one(step)
    s = f64(new_step)
    lr64 = f64(lr)
    one = dconst(1.0)
    p = param
    if weight_decay != 0:
        if decoupled:
            p = op.Mul(p, op.CastLike(op.Sub(one, op.Mul(lr64, dconst(weight_decay))), param))
        else:
            g = op.Add(g, op.Mul(param, scalar(op.Constant(value_float=weight_decay), param)))
    m = op.Add(exp_avg, op.Mul(op.Sub(g, exp_avg), one_minus(beta1, param)))
    v = op.Add(op.Mul(exp_avg_sq, scalar(op.Constant(value_float=beta2), param)),
               op.Mul(op.Mul(g, g), scalar(op.Constant(value_float=1.0 - beta2), param)))
    bias_correction1 = op.Sub(one, op.Pow(beta1 if scheduled(beta1) else dconst(beta1), s))
    beta2_t = op.Pow(dconst(beta2), s)
    bias_correction2 = op.Sub(one, beta2_t)
    update = op.Mul(op.Div(m, op.CastLike(bias_correction1, param)), op.CastLike(lr64, param))
    rho_inf = 2 / (1 - beta2) - 1
    rho_t = op.Sub(dconst(rho_inf), op.Div(op.Mul(op.Mul(dconst(2.0), s), beta2_t), bias_correction2))
    # (rho_t - 4)(rho_t - 2) rho_inf / ((rho_inf - 4)(rho_inf - 2) rho_t), clamped at 0 so that the
    # branch not taken (an unrectified step's ratio is negative) holds no NaN.
    ratio = op.Div(op.Mul(op.Mul(op.Sub(rho_t, dconst(4.0)), op.Sub(rho_t, dconst(2.0))), dconst(rho_inf)),
                   op.Mul(dconst((rho_inf - 4) * (rho_inf - 2)), rho_t))
    rect = op.Sqrt(op.Max(ratio, dconst(0.0)))
    adaptive_lr = op.Mul(op.Reciprocal(op.Add(op.Sqrt(v), scalar(op.Constant(value_float=eps), param))),
                         op.CastLike(op.Sqrt(bias_correction2), param))
    rectified = op.Mul(op.Mul(update, adaptive_lr), op.CastLike(rect, param))
    chosen = op.Where(op.Greater(rho_t, dconst(5.0)), rectified, update)
    return op.Sub(p, chosen), m, v, new_step


register(Registration(torch.optim.RAdam, _read, foreach_exact=False,
                      aten={"radam": _aten_radam_update}, onnx={"radam": _onnx_radam_update},
                      scheduled={"beta1": ("betas", 0)}))
