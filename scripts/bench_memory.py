"""Peak memory of one training step: eager torch.optim vs the planned pure step, side by side.

Configs (from the memory-planning issue):
  * parameter-heavy: an MLP of 8 layers of 1024x1024, batch 16, with Adam and with SGD-momentum;
  * activation-heavy: a CNN at a larger batch, SGD-momentum.
Also times the arena executor against the unplanned executor in the same run.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_ext

TARGETS = {"param-heavy adam": 0.80, "param-heavy sgd-momentum": 0.73, "activation-heavy cnn": 1.00}


def mlp():
    torch.manual_seed(0)
    layers = []
    for _ in range(8):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    model = nn.Sequential(*layers[:-1])
    return model, lambda m, x, y: F.mse_loss(m(x), y), (torch.randn(16, 1024), torch.randn(16, 1024))


def cnn():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(32, 10))
    return model, lambda m, x, y: F.cross_entropy(m(x), y), (torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,)))


def time_steps(fn, state, batch, n=5, rounds=5):
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            _, state = fn(state, *batch)
        out.append((time.perf_counter() - t0) / n)
    return statistics.median(out), state


def main():
    configs = [
        ("param-heavy adam", mlp, lambda m: torch.optim.Adam(m.parameters(), lr=1e-4)),
        ("param-heavy sgd-momentum", mlp, lambda m: torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9)),
        ("activation-heavy cnn", cnn, lambda m: torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9)),
    ]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    header = (f"{'config':26} {'eager MiB':>10} {'planned':>9} {'p/eager':>8} {'target':>7} {'arena/LB':>9} "
              f"{'merged/sep':>10} {'t arena/exec':>12} {'schedule':>12} aliases")
    print(header)
    for name, make, make_opt in configs:
        model, loss_fn, batch = make()
        step = torch_ext.make_train_step(model, make_opt(model), loss_fn, batch)
        report = torch_ext.memory_report(step, batch)
        r = report.ratios()
        planned = step.compile(plan=True, donate=True)
        t_plain, _ = time_steps(step, step.init_state(), batch)
        t_arena, _ = time_steps(planned, step.init_state(), batch)
        t_plain2, _ = time_steps(step, step.init_state(), batch)
        t_plain = min(t_plain, t_plain2)
        mib = 2 ** 20
        print(f"{name:26} {report.eager_peak / mib:10.2f} {report.merged_planned / mib:9.2f} "
              f"{r['planned/eager']:8.3f} {TARGETS[name]:7.2f} {r['arena/LB_sched(arena part)']:9.3f} "
              f"{r['planned/separate']:10.3f} {t_arena / t_plain:12.3f} {report.schedule:>12} "
              f"{report.aliases_applied}/{report.aliases_applied + report.aliases_refused}")
        print(f"{'':26} separate parts (MiB): " + ", ".join(f"{k} {v / mib:.2f}" for k, v in report.separate_parts.items())
              + f"; LB_sched {report.lb_sched / mib:.2f}, LB_graph {report.lb_graph / mib:.2f}, "
              f"unplanned merged {report.merged_unplanned / mib:.2f}; {report.fallback_nodes} nodes without out=")
    print("targets: planned/eager as listed; arena/LB_sched <= 1.05; merged/separate <= 0.60; "
          "arena time / unplanned executor <= 1.0")


if __name__ == "__main__":
    main()
