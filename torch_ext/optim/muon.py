"""torch.optim.Muon: kind "muon" (csrc/optim/muon.cpp). It has no foreach path, and its update
needs the whole matrix (no ZeRO-1 sharding)."""
import math

import torch

from ._registry import Registration, refuse_rounded_tensor_lr, register


def _read(opt, group, param, gi):
    # torch.optim.Muon keeps a 0-dim tensor lr a tensor (_to_scalar): lr * ratio and 1 - lr * weight_decay in
    # its dtype (fuzz_step 22:68, 23:84 ...: a float32 lr trained 1 ulp off, silently).
    refuse_rounded_tensor_lr(opt, group, gi, "its adjusted lr lr * ratio and decay factor 1 - lr * weight_decay")
    a_dim, b_dim = param.shape[:2]
    fn = group["adjust_lr_fn"]
    if fn is None or fn == "original":
        ratio = math.sqrt(max(1, a_dim / b_dim))
    elif fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(a_dim, b_dim))
    else:
        ratio = 1.0
    a, b, c = group["ns_coefficients"]
    return dict(kind="muon",
                hyper=dict(weight_decay=float(group["weight_decay"]), momentum=float(group["momentum"]),
                           a=float(a), b=float(b), c=float(c), ns_steps=float(group["ns_steps"]),
                           eps=float(group["eps"]), lr_ratio=float(ratio)),
                flags=dict(nesterov=bool(group["nesterov"])))


register(Registration(torch.optim.Muon, _read, foreach_exact=False, scheduled={"momentum": ("momentum", None)}))
