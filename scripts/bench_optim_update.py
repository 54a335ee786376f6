"""The optimizer update alone: eager ``torch.optim`` (single-tensor path, what eager training runs
on CPU) against torch_ext's update ops, which run large parameters block by block
(``csrc/optim/define.cpp``: 256 KiB slices, each slice's passes stay in cache; the same ATen ops on
the same values, so bit-exact).

Parameter sets: torchvision ResNet-18 (11.7M parameters in 62 tensors), one 50257x256 embedding
(GPT-2's vocabulary: 12.9M in one tensor) and an 8192x256 one (bench_step's GPT-2). Optimizers:
AdamW, RMSprop (centered, momentum), Adamax, NAdam, RAdam, Adadelta and Rprop, blocked, and Adagrad and SGD
with momentum, run whole (``Descriptor::blocked``: they measured 0.8-0.93x blocked). Arms, interleaved per round, medians reported:

- eager: ``opt.step()`` with the gradients set;
- ops: ``torch.ops.torch_ext.<kind>_update_`` per parameter (the in-place op the planned arena runs;
  the executor's functional op runs the same blocks into the recycled memory of its result pool,
  measured within whole steps by ``bench_step.py``).

Both start from the same parameters, gradients and state, and after the timed rounds the op's
parameters and state must equal eager's bit for bit (checked: the exit status is 1 otherwise).
Target: at least 0.95x eager everywhere (no regression on small tensors; noise), and faster where
tensors exceed the cache.

    python scripts/bench_optim_update.py [--threads 1] [--rounds 9] [--optimizers AdamW,NAdam]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import _bench_util as bu  # noqa: E402

import torch_ext  # noqa: E402,F401  (registers the ops)


def param_sets():
    import torchvision

    yield "ResNet-18", [p.detach() for p in torchvision.models.resnet18().parameters()]
    yield "embedding 50257x256", [torch.randn(50257, 256)]
    yield "embedding 8192x256", [torch.randn(8192, 256)]


OPTIMIZERS = {
    "AdamW": (lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=1e-2), "adam",
              ("exp_avg", "exp_avg_sq", "step"), (0.9, 0.999, 1e-8, 1e-2, True, False)),
    "RMSprop": (lambda ps: torch.optim.RMSprop(ps, lr=1e-3, centered=True, momentum=0.5), "rmsprop",
                ("square_avg", "grad_avg", "momentum_buffer", "step"), (0.99, 1e-8, 0.0, 0.5, True, False)),
    "Adagrad": (lambda ps: torch.optim.Adagrad(ps, lr=1e-2), "adagrad", ("sum", "step"), (0.0, 0.0, 1e-10, False)),
    "SGD momentum": (lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9), "sgd_momentum",
                     ("momentum_buffer", "step"), (0.9, 0.0, 0.0, False, False)),
    "Adamax": (lambda ps: torch.optim.Adamax(ps, lr=2e-3), "adamax", ("exp_avg", "exp_inf", "step"),
               (0.9, 0.999, 1e-8, 0.0, False)),
    "NAdam": (lambda ps: torch.optim.NAdam(ps, lr=2e-3, weight_decay=1e-2, decoupled_weight_decay=True), "nadam",
              ("exp_avg", "exp_avg_sq", "mu_product", "step"), (0.9, 0.999, 1e-8, 1e-2, 4e-3, True, False)),
    "RAdam": (lambda ps: torch.optim.RAdam(ps, lr=1e-3), "radam", ("exp_avg", "exp_avg_sq", "step"),
              (0.9, 0.999, 1e-8, 0.0, False, False)),
    "Adadelta": (lambda ps: torch.optim.Adadelta(ps), "adadelta", ("square_avg", "acc_delta", "step"),
                 (0.9, 1e-6, 0.0, False)),
    "Rprop": (lambda ps: torch.optim.Rprop(ps, lr=1e-2), "rprop", ("prev", "step_size", "step"),
              (0.5, 1.2, 1e-6, 50.0, False)),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS),
                    help=f"comma-separated subset of: {', '.join(OPTIMIZERS)}")
    args = ap.parse_args()
    chosen = args.optimizers.split(",")
    unknown = [o for o in chosen if o not in OPTIMIZERS]
    if unknown:
        ap.error(f"--optimizers: unknown {', '.join(unknown)} (known: {', '.join(OPTIMIZERS)})")
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    bu.header(f"optimizer update alone, {args.threads} thread(s), ms per step, median of {args.rounds} interleaved rounds")
    print(f"{'parameters':<22}{'optimizer':<14}{'eager':>8}{'ops':>8}{'eager/ops':>11}")
    for set_name, tensors in param_sets():
        g = torch.Generator().manual_seed(0)
        grads = [torch.randn(t.shape, generator=g) for t in tensors]
        for opt_name, (make, kind, slots, scalars) in OPTIMIZERS.items():
            if opt_name not in chosen:
                continue
            eager_params = [torch.nn.Parameter(t.clone()) for t in tensors]
            for p, gr in zip(eager_params, grads):
                p.grad = gr
            opt = make(eager_params)
            opt.step()  # creates eager's state; the ops start from a copy of it
            # torch.optim.SGD keeps no step count; the op's counter says its buffer exists (1 after a step).
            state_of = lambda p: [opt.state[p][s] if s in opt.state[p] else torch.ones(())  # noqa: E731
                                  for s in slots]
            inplace = [[p.detach().clone()] + [t.clone() for t in state_of(p)] for p in eager_params]
            lr = torch.tensor([opt.param_groups[0]["lr"]], dtype=torch.float64)
            op_ = getattr(torch.ops.torch_ext, f"{kind}_update_")

            def eager():
                opt.step()

            def run_inplace():
                for (p, *st), gr in zip(inplace, grads):
                    op_(p, gr, *st, lr, *scalars)

            times = {f: [] for f in (eager, run_inplace)}
            for f in times:
                f()
            for _ in range(args.rounds):
                for f, acc in times.items():
                    t = time.perf_counter()
                    f()
                    acc.append(time.perf_counter() - t)
            ms = {f.__name__: statistics.median(v) * 1e3 for f, v in times.items()}
            same = all(torch.equal(row[0], p.detach()) and all(
                torch.equal(a, opt.state[p][s].to(a.dtype)) for a, s in zip(row[1:], slots) if s in opt.state[p])
                for row, p in zip(inplace, eager_params))
            bu.check(same, f"{set_name}, {opt_name}: parameters and state equal eager's bit for bit")
            ratio = ms["eager"] / ms["run_inplace"]
            print(f"{set_name:<22}{opt_name:<14}{ms['eager']:8.2f}{ms['run_inplace']:8.2f}{ratio:10.2f}x")
            bu.target(ratio >= 0.95, f"{set_name} {opt_name}: update ops >= 0.95x eager (got {ratio:.2f}x)")
    return bu.summary(t0)


if __name__ == "__main__":
    sys.exit(main())
