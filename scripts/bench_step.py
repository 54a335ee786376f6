"""Steps per second: eager torch.optim loop vs the pure step (C++ executor) vs the AOTInductor step.

Prints one table measured in one run (interleaved rounds, median per round) so the ratios are
comparable on a noisy machine. Targets: executor >= 1.0x eager, AOTInductor >= 1.3x eager.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_ext
from torch_ext.models import TinyTransformer


def mlp_case():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    batch = (torch.randn(32, 64), torch.randint(0, 10, (32,)))
    return "mlp 64-128-128-10, batch 32", model, lambda m, x, y: F.cross_entropy(m(x), y), batch


def transformer_case():
    torch.manual_seed(0)
    model = TinyTransformer(vocab=64, d_model=32, n_heads=4, n_layers=2, seq=16)
    batch = (torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16)))
    return ("transformer 2x32, seq 16, batch 4", model,
            lambda m, i, t: F.cross_entropy(m(i).reshape(-1, 64), t.reshape(-1)), batch)


def time_loop(fn, iters):
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def bench(case, iters, rounds, aoti):
    name, model, loss_fn, batch = case
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = torch_ext.make_train_step(model, opt, loss_fn, batch)
    state = {"s": step.init_state()}

    def eager():
        opt.zero_grad()
        loss_fn(model, *batch).backward()
        opt.step()

    def pure():
        _, state["s"] = step(state["s"], *batch)

    runners = {"eager": eager, "executor": pure}
    if aoti:
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            pkg = torch._inductor.aoti_compile_and_package(step.program, package_path=f"{d}/step.pt2")
            compile_s = time.perf_counter() - t0
            compiled = torch._inductor.aoti_load_package(pkg)
        n_state = len(step.state_names)
        flat = {"f": step.flat_inputs(step.init_state(), *batch)}

        def aoti_step():
            outs = compiled(*flat["f"])
            flat["f"] = list(outs[1:]) + flat["f"][n_state:]

        runners["aoti"] = aoti_step
    else:
        compile_s = float("nan")
    for fn in runners.values():
        time_loop(fn, 5)
    samples = {k: [] for k in runners}
    for _ in range(rounds):
        for k, fn in runners.items():
            samples[k].append(time_loop(fn, iters))
    med = {k: statistics.median(v) for k, v in samples.items()}
    return name, med, compile_s


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--no-aoti", action="store_true", help="skip the AOTInductor column (it compiles for ~1 min)")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; AdamW; median of {args.rounds} rounds "
          f"x {args.iters} steps")
    print(f"{'case':36} {'eager st/s':>11} {'executor':>10} {'aoti':>10} {'exec/eager':>11} {'aoti/eager':>11}")
    for case in (mlp_case(), transformer_case()):
        name, med, compile_s = bench(case, args.iters, args.rounds, not args.no_aoti)
        sps = {k: 1.0 / v for k, v in med.items()}
        aoti = sps.get("aoti", float("nan"))
        print(f"{name:36} {sps['eager']:11.1f} {sps['executor']:10.1f} {aoti:10.1f} "
              f"{sps['executor'] / sps['eager']:10.2f}x {aoti / sps['eager']:10.2f}x"
              + (f"   (aoti compile {compile_s:.0f} s)" if compile_s == compile_s else ""))
    print("targets: executor >= 1.00x eager, aoti >= 1.30x eager")


if __name__ == "__main__":
    main()
