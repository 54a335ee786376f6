"""Probe: a model with a transposed nn.Parameter, trained by make_train_step, compiled with to_aoti.
Compares the AOTInductor package (load_step), the executor step(...) and eager torch.optim, every
parameter and optimizer slot, over 3 float32 steps; a contiguous control with the same values.

    python scripts/probe_aoti_transposed_param.py [--opt adam|adamw] [--out DIR]
"""
from __future__ import annotations

import argparse
import copy
import os
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_ext


class TransposedW(nn.Module):
    def __init__(self, transposed: bool):
        super().__init__()
        torch.manual_seed(0)
        w = torch.randn(16, 8)
        self.w = nn.Parameter(w.t() if transposed else w.t().contiguous())  # (8, 16), same values
        self.b = nn.Parameter(torch.randn(16) * 0.1)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(torch.tanh(x @ self.w + self.b))


def ce(m, x, y):
    return F.cross_entropy(m(x), y)


def batches(n=3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(n)]


def maxdiff(a, b):
    return float((a.double() - b.double()).abs().max())


def run_case(transposed, opt_name, out):
    model = TransposedW(transposed)
    ref = copy.deepcopy(model)
    make_opt = {"adam": lambda p: torch.optim.Adam(p, lr=1e-2),
                "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.01)}[opt_name]
    bs = batches()
    step = torch_ext.make_train_step(model, make_opt(model.parameters()), ce, bs[0])
    ref_opt = make_opt(ref.parameters())
    s0 = step.init_state()
    print(f"\n== {opt_name} transposed={transposed}: init_state w stride {s0.params['model.w'].stride()}")
    pkg = step.to_aoti(os.path.join(out, f"{opt_name}_{int(transposed)}.pt2"))
    loaded = torch_ext.load_step(pkg)
    print("   layout input_strides:", loaded.layout.get("input_strides"))
    se, sa = step.init_state(), step.init_state()
    names = {id(p): n for n, p in ref.named_parameters()}
    for i, (x, y) in enumerate(bs):
        ref_opt.zero_grad()
        lref = ce(ref, x, y)
        lref.backward()
        ref_opt.step()
        le, se = step(se, x, y)
        la, sa = loaded(sa, x, y)
        print(f" step {i + 1}: loss eager {lref.item():.9g} exec==eager {torch.equal(le, lref.detach())} "
              f"aoti==exec {torch.equal(la, le)} (|d| {maxdiff(la, le):.3g})")
        for n, p in ref.named_parameters():
            k = "model." + n
            e, a = se.params[k], sa.params[k]
            print(f"   param {n:12s} exec==eager {torch.equal(e, p.detach())} aoti==exec {torch.equal(a, e)} "
                  f"max|aoti-exec| {maxdiff(a, e):.3g} aoti stride {tuple(a.stride())} exec stride {tuple(e.stride())}")
        for p, slots in ref_opt.state.items():
            for slot, v in slots.items():
                k = f"opt:model.{names[id(p)]}:{slot}"
                e, a = se.opt[k], sa.opt[k]
                v = v.to(e.dtype).reshape(e.shape)
                print(f"   slot {k:26s} exec==eager {torch.equal(e, v)} aoti==exec {torch.equal(a, e)} "
                      f"max|aoti-exec| {maxdiff(a, e):.3g}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--opt", default="adam,adamw")
    ap.add_argument("--cases", default="1,0")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = args.out or tempfile.mkdtemp()
    for opt_name in args.opt.split(","):
        for t in args.cases.split(","):
            run_case(bool(int(t)), opt_name, out)


if __name__ == "__main__":
    main()
