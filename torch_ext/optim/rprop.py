"""torch.optim.Rprop: kind "rprop" (csrc/optim/rprop.cpp). torch.optim fills ``step_size`` with the group's lr
when it creates the state (on the first step); the update never reads the lr again."""
import torch

from ._onnx import op, plus_one, scalar
from ._registry import Registration, default_initial_state, register


def _read(opt, group, param, gi):
    etaminus, etaplus = group["etas"]
    step_size_min, step_size_max = group["step_sizes"]
    return dict(kind="rprop",
                hyper=dict(etaminus=float(etaminus), etaplus=float(etaplus), step_size_min=float(step_size_min),
                           step_size_max=float(step_size_max)),
                flags=dict(maximize=bool(group.get("maximize", False))))


def _initial_state(kind, st, param, group):
    out = default_initial_state(kind, st, param, group)
    if st.get("step_size") is None:
        lr = group["lr"]
        out["step_size"] = torch.full_like(param, lr.item() if isinstance(lr, torch.Tensor) else lr,
                                           memory_format=torch.preserve_format)
    return out


def _aten_rprop_update(param, grad, prev, step_size, step, lr, etaminus, etaplus, step_size_min, step_size_max,
                       maximize):
    """csrc/optim/rprop.cpp line by line, functional (for Inductor to fuse)."""
    g = grad.neg() if maximize else grad
    sign = (g * prev).sign()
    sign = sign.masked_fill(sign.gt(0), etaplus)
    sign = sign.masked_fill(sign.lt(0), etaminus)
    sign = sign.masked_fill(sign.eq(0), 1)
    new_step_size = (step_size * sign).clamp(step_size_min, step_size_max)
    kept = g.masked_fill(sign.eq(etaminus), 0)
    return torch.addcmul(param, kept.sign(), new_step_size, value=-1), kept, new_step_size, step + 1


def _onnx_rprop_update(param, grad, prev, step_size, step, lr, etaminus, etaplus, step_size_min, step_size_max,
                       maximize):
    """csrc/optim/rprop.cpp line by line, in onnxscript: its masked fills, in order, as Where."""
    def c(x):
        return scalar(op.Constant(value_float=x), param)

    new_step = plus_one(step)
    g = op.Neg(grad) if maximize else grad
    zero = c(0.0)
    sign = op.Sign(op.Mul(g, prev))
    sign = op.Where(op.Greater(sign, zero), c(etaplus), sign)
    sign = op.Where(op.Less(sign, zero), c(etaminus), sign)
    sign = op.Where(op.Equal(sign, zero), c(1.0), sign)
    new_step_size = op.Min(op.Max(op.Mul(step_size, sign), c(step_size_min)), c(step_size_max))
    kept = op.Where(op.Equal(sign, c(etaminus)), zero, g)
    return op.Sub(param, op.Mul(op.Sign(kept), new_step_size)), kept, new_step_size, new_step


register(Registration(torch.optim.Rprop, _read, _initial_state, aten={"rprop": _aten_rprop_update},
                      onnx={"rprop": _onnx_rprop_update}))
