"""torch.optim.Adafactor: kind "adafactor" for a parameter of 2 or more dims (its second moment factored into
``row_var`` and ``col_var``, slots whose shapes the descriptor derives from the parameter's: one of its last two
dims reduced to 1), "adafactor_vector" for a 0-d or 1-d one (a full ``variance``) (csrc/optim/adafactor.cpp).

torch.optim resolves ``eps=(None, eps2)`` per param group as ``torch.finfo(dtype).eps`` of the first parameter
it updates; here per parameter, so a group of mixed dtypes with eps1=None is refused. Its default foreach=None
runs the single-tensor path on every device (unlike the other optimizers), which is the one the kernel replays.
"""
import torch

from ._onnx import dconst, f64, op, plus_one
from ._registry import F64, Registration, once, refuse_rounded_tensor_lr, register


def _number(opt, group, gi, key, value):
    if isinstance(value, torch.Tensor):
        raise ValueError(f"{type(opt).__name__} param group {gi}: a tensor {key} is not supported (got {value!r}); "
                         "pass it as a Python float")
    return float(value)


def _read(opt, group, param, gi):
    refuse_rounded_tensor_lr(opt, group, gi, "rho = min(lr, 1 / sqrt(step)), the update's scale from it and the "
                                             "decay factor 1 - lr * weight_decay")
    eps1, eps2 = group["eps"]
    if eps1 is None:
        dtypes = sorted({str(p.dtype) for p in group["params"]})
        if len(dtypes) > 1:
            raise ValueError(f"{type(opt).__name__} param group {gi}: eps=(None, ...) takes torch.finfo(dtype).eps of "
                             f"the first parameter torch.optim updates, and this group mixes dtypes ({', '.join(dtypes)}); "
                             "pass eps1 as a float or put each dtype in its own group")
        eps1 = torch.finfo(param.dtype).eps
    return dict(kind="adafactor" if param.dim() > 1 else "adafactor_vector",
                hyper=dict(beta2_decay=_number(opt, group, gi, "beta2_decay", group["beta2_decay"]),
                           eps1=_number(opt, group, gi, "eps[0]", eps1), eps2=_number(opt, group, gi, "eps[1]", eps2),
                           d=_number(opt, group, gi, "d", group["d"]),
                           weight_decay=_number(opt, group, gi, "weight_decay", group["weight_decay"])),
                flags=dict(maximize=bool(group.get("maximize", False))))


def _aten(param, grad, row_var, col_var, variance, step, lr, beta2_decay, eps1, eps2, d, weight_decay, maximize):
    """csrc/optim/adafactor.cpp line by line, functional: its Python-float scalars as float64 0-d tensors."""
    g = grad.neg() if maximize else grad
    new_step = step + 1
    s = new_step.to(F64)
    lr64 = lr.to(F64)
    one_minus_beta2_t = once(torch.pow(s, beta2_decay).to(param.dtype))
    rho_t = torch.minimum(lr64, 1 / torch.pow(s, 0.5))
    rms = torch.linalg.vector_norm(param).to(F64) / param.numel() ** 0.5
    alpha = torch.clamp_min(rms, eps2) * rho_t
    if weight_decay != 0:
        param = param * once((1 - lr64 * weight_decay).to(param.dtype))
    if variance is None:
        row_mean = torch.linalg.vector_norm(g, dim=-1, keepdim=True).square() / g.size(-1)
        row_var = torch.lerp(row_var, row_mean, one_minus_beta2_t)
        col_mean = torch.linalg.vector_norm(g, dim=-2, keepdim=True).square() / g.size(-2)
        col_var = torch.lerp(col_var, col_mean, one_minus_beta2_t)
        var_estimate = (row_var @ col_var) / row_var.mean(dim=-2, keepdim=True).clamp_min(eps1)
    else:
        variance = torch.lerp(variance, g * g, one_minus_beta2_t)
        var_estimate = variance
    update = var_estimate.clamp_min(eps1 * eps1).rsqrt() * g
    denom = torch.clamp_min(torch.linalg.vector_norm(update).to(F64) / (update.numel() ** 0.5 * d), 1.0)
    new_param = param + update * once((-alpha / denom).to(param.dtype))
    return new_param, row_var, col_var, variance, new_step


def _aten_adafactor_update(param, grad, row_var, col_var, step, lr, beta2_decay, eps1, eps2, d, weight_decay,
                           maximize):
    p, r, c, _, s = _aten(param, grad, row_var, col_var, None, step, lr, beta2_decay, eps1, eps2, d, weight_decay,
                          maximize)
    return p, r, c, s


def _aten_adafactor_vector_update(param, grad, variance, step, lr, beta2_decay, eps1, eps2, d, weight_decay,
                                  maximize):
    p, _, _, v, s = _aten(param, grad, None, None, variance, step, lr, beta2_decay, eps1, eps2, d, weight_decay,
                          maximize)
    return p, v, s


def _onnx(param, grad, row_var, col_var, variance, step, lr, beta2_decay, eps1, eps2, d, weight_decay, maximize):
    """csrc/optim/adafactor.cpp line by line, in onnxscript: scalars in double, applied in the parameter's dtype."""
    def like(x):  # a double (tensor or Python float) in the parameter's dtype
        return op.CastLike(x if not isinstance(x, float) else dconst(x), param)

    def sqrt_numel(t):
        return op.Sqrt(op.Cast(op.Size(t), to=11))  # 11: DOUBLE

    g = op.Neg(grad) if maximize else grad
    new_step = plus_one(step)
    s = f64(new_step)
    lr64 = f64(lr)
    w = like(op.Pow(s, dconst(beta2_decay)))
    rho_t = op.Min(lr64, op.Div(dconst(1.0), op.Pow(s, dconst(0.5))))
    rms = op.Div(f64(op.ReduceL2(param, keepdims=0)), sqrt_numel(param))
    alpha = op.Mul(op.Max(rms, dconst(eps2)), rho_t)
    p = param
    if weight_decay != 0:
        p = op.Mul(p, like(op.Sub(dconst(1.0), op.Mul(lr64, dconst(weight_decay)))))

    def mean_square(axis):  # (g * g).mean(axis, keepdim=True), as a norm squared over the axis's size
        n = op.ReduceL2(g, op.Constant(value_ints=[axis]), keepdims=1)
        size = op.Shape(g, start=-1) if axis == -1 else op.Shape(g, start=-2, end=-1)
        return op.Div(op.Mul(n, n), op.CastLike(size, param))

    def lerp(a, b):
        return op.Add(a, op.Mul(op.Sub(b, a), w))

    if variance is None:
        row_var = lerp(row_var, mean_square(-1))
        col_var = lerp(col_var, mean_square(-2))
        row_mean_of = op.ReduceMean(row_var, op.Constant(value_ints=[-2]), keepdims=1)
        var_estimate = op.Div(op.MatMul(row_var, col_var), op.Max(row_mean_of, like(eps1)))
    else:
        variance = lerp(variance, op.Mul(g, g))
        var_estimate = variance
    update = op.Mul(op.Reciprocal(op.Sqrt(op.Max(var_estimate, like(eps1 * eps1)))), g)
    update_rms = op.Div(f64(op.ReduceL2(update, keepdims=0)), op.Mul(sqrt_numel(update), dconst(d)))
    denom = op.Max(update_rms, dconst(1.0))
    new_param = op.Sub(p, op.Mul(update, like(op.Div(alpha, denom))))
    return new_param, row_var, col_var, variance, new_step


def _onnx_adafactor_update(param, grad, row_var, col_var, step, lr, beta2_decay, eps1, eps2, d, weight_decay,
                           maximize):
    p, r, c, _, s = _onnx(param, grad, row_var, col_var, None, step, lr, beta2_decay, eps1, eps2, d, weight_decay,
                          maximize)
    return p, r, c, s


def _onnx_adafactor_vector_update(param, grad, variance, step, lr, beta2_decay, eps1, eps2, d, weight_decay,
                                  maximize):
    p, _, _, v, s = _onnx(param, grad, None, None, variance, step, lr, beta2_decay, eps1, eps2, d, weight_decay,
                          maximize)
    return p, v, s


register(Registration(torch.optim.Adafactor, _read, foreach_exact=False,
                      aten={"adafactor": _aten_adafactor_update, "adafactor_vector": _aten_adafactor_vector_update},
                      onnx={"adafactor": _onnx_adafactor_update, "adafactor_vector": _onnx_adafactor_vector_update}))
