"""Peak memory and time of one training step: eager torch.optim, torch.utils.checkpoint on every
block, the planned pure step, and the planned step under memory budgets (rematerialization).

Configs (issue 17):
  * parameter-heavy: an MLP of 8 layers of 1024x1024, batch 16, Adam and SGD-momentum;
  * activation-heavy: a CNN at batch 64, SGD-momentum;
  * GPT-style: 4 layers, d_model 256, seq 256, batch 8, AdamW (--gpt-seq/--gpt-batch to shrink);
  * Hugging Face GPT-2 (transformers.GPT2LMHeadModel, its dropouts on) at the same sizes, vocabulary 256,
    AdamW; torch.utils.checkpoint on every block through its own gradient_checkpointing_enable().
Every peak is measured the same way: torch.profiler's allocation events over one step, plus the
state and batch held (and the arena, for the planned steps). Times are measured side by side in one
run: every round times one step of each runner (eager, checkpoint/block, the unplanned executor and
every plan) back to back, and each column is the median over --rounds rounds of wall time (step ms),
so the ratios compare runners under the same machine load (t arena/exec: a plan's median over the
unplanned executor's; the summary line also gives the executor over eager).
"""
from __future__ import annotations

import argparse
import copy
import os
import pathlib
import re
import resource
import statistics
import sys
import time
import types

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import torch_ext
from torch_ext.memory import _eager_peak, measured_peak
from torch_ext.models import TinyTransformer, relu_mlp

TARGETS = {"param-heavy adam": 0.80, "param-heavy sgd-momentum": 0.73, "activation-heavy cnn": 0.85, "gpt-style": 0.85,
           "hf gpt-2": 0.85}


def mlp():
    model = relu_mlp()
    loss = lambda m, x, y: F.mse_loss(m(x), y)  # noqa: E731
    return model, loss, None, (torch.randn(16, 1024), torch.randn(16, 1024))


def cnn():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(32, 10))

    def ckpt_loss(m, x, y):  # each conv+relu block checkpointed
        for i in range(0, 6, 2):
            x = checkpoint(m[i:i + 2], x, use_reentrant=False)
        return F.cross_entropy(m[6:](x), y)

    return (model, lambda m, x, y: F.cross_entropy(m(x), y), ckpt_loss,
            (torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))))


def gpt(seq=256, batch=8):
    torch.manual_seed(0)
    model = TinyTransformer(vocab=256, d_model=256, n_heads=4, n_layers=4, seq=seq)

    def loss(m, i, t):
        return F.cross_entropy(m(i).reshape(-1, 256), t.reshape(-1))

    def ckpt_loss(m, i, t):
        x = m.tok(i) + m.pos[: i.shape[1]]
        for blk in m.blocks:
            x = checkpoint(blk, x, use_reentrant=False)
        return F.cross_entropy((m.ln_f(x) @ m.tok.weight.t()).reshape(-1, 256), t.reshape(-1))

    return model, loss, ckpt_loss, (torch.randint(0, 256, (batch, seq)), torch.randint(0, 256, (batch, seq)))


def hf_gpt2(seq=256, batch=8):
    import transformers

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "python"))
    from real_models import causal_lm_loss  # the loss the real-model tests train with

    cfg = transformers.GPT2Config(vocab_size=256, n_positions=seq, n_embd=256, n_layer=4, n_head=4, bos_token_id=0,
                                  eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).train()

    def ckpt_loss(m, ids):  # every GPT2Block under torch.utils.checkpoint (non-reentrant)
        if not m.is_gradient_checkpointing:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return causal_lm_loss(m, ids)

    return model, causal_lm_loss, ckpt_loss, (torch.randint(0, 256, (batch, seq)),)


def interleaved_medians(runners, rounds, warmup=2):
    """({name: median wall seconds per step}, {name: median process CPU seconds per step}, {name: minor page
    faults per step}): each round runs every
    runner once, back to back, so all see the same machine load; a noisy round shifts every column
    alike and the median drops it. Page faults (fresh memory from the OS, first touched) are a large
    part of a CPU step's time and depend on what the allocator kept, so they are reported too. CPU time
    (time.process_time, every thread of this process) is the second measurement: other processes on a
    loaded machine stretch wall time but not, to first order, the CPU time a step consumes."""
    for fn in runners.values():
        for _ in range(warmup):
            fn()
    times, cpu, faults = {k: [] for k in runners}, {k: [] for k in runners}, {k: 0 for k in runners}
    for _ in range(rounds):
        for k, fn in runners.items():
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            times[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
            faults[k] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    med = lambda d: {k: statistics.median(v) for k, v in d.items()}  # noqa: E731
    return med(times), med(cpu), {k: v / rounds for k, v in faults.items()}


def eager_runner(model, opt, loss_fn, batch):
    def one():
        opt.zero_grad(set_to_none=True)
        loss_fn(model, *batch).backward()
        opt.step()
    return one


def step_runner(fn, state, batch):
    box = [state]

    def one():
        _, box[0] = fn(box[0], *batch)
    return one


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpt-seq", type=int, default=256)
    ap.add_argument("--gpt-batch", type=int, default=8)
    ap.add_argument("--only", default="", help="comma-separated config names")
    ap.add_argument("--rounds", type=int, default=9, help="interleaved timing rounds (one step of every runner each)")
    ap.add_argument("--threads", type=int, help="torch.set_num_threads for every runner (default: torch's)")
    args = ap.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    configs = [
        ("param-heavy adam", mlp, lambda m: torch.optim.Adam(m.parameters(), lr=1e-4)),
        ("param-heavy sgd-momentum", mlp, lambda m: torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9)),
        ("activation-heavy cnn", cnn, lambda m: torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9)),
        ("gpt-style", lambda: gpt(args.gpt_seq, args.gpt_batch), lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3)),
        ("hf gpt-2", lambda: hf_gpt2(args.gpt_seq, args.gpt_batch), lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3)),
    ]
    if args.only:
        configs = [c for c in configs if c[0] in args.only.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; gpt seq {args.gpt_seq} batch {args.gpt_batch}")
    mib = 2 ** 20
    for name, make, make_opt in configs:
        model, loss_fn, ckpt_loss, batch = make()
        step = torch_ext.make_train_step(model, make_opt(model), loss_fn, batch)
        eager_peak, _ = _eager_peak(step, batch)
        em = copy.deepcopy(model)
        runners = {"eager": eager_runner(em, make_opt(em), loss_fn, batch)}
        rows = [["eager", eager_peak, None, None]]
        if ckpt_loss is not None:
            cm = copy.deepcopy(model)
            co = make_opt(cm)
            shim = types.SimpleNamespace(model=cm, optimizers=[co], loss_fn=ckpt_loss)
            ck_peak, _ = _eager_peak(shim, batch)
            runners["checkpoint/block"] = eager_runner(cm, co, ckpt_loss, batch)
            rows.append(["checkpoint/block", ck_peak, None, None])
        runners["executor"] = step_runner(step.compile(plan=False, donate=False), step.init_state(), batch)
        budgets = [None] + ([0.7, 0.5, 0.35] if ckpt_loss is not None else [])
        if ckpt_loss is not None:
            budgets.append(("at checkpoint peak", rows[1][1]))
        below_lb, plans = 0, {}
        for b in budgets:
            label, budget = (b if isinstance(b, tuple) else (("planned" if b is None else f"budget {b}"), b))
            try:
                planned = step.compile(plan=True, donate=True, memory_budget=budget)
            except ValueError as e:
                found = int(re.search(r"smallest planned peak found is (\d+) bytes", str(e)).group(1))
                rows.append([label, None, None, f"infeasible: smallest planned peak found {found / mib:.2f} MiB "
                                                f"= {found / eager_peak:.3f} of eager"])
                continue
            peak, _ = measured_peak(planned, step.init_state(), batch)
            plans[label] = planned
            runners[label] = step_runner(planned, step.init_state(), batch)
            if planned.remat:  # the same recomputing graph on the unplanned executor: what the arena itself costs
                same = torch_ext._C.Executor(planned.graph._g)
                flat = step.flat_inputs(step.init_state(), *batch)
                runners[label + " (executor)"] = lambda same=same, flat=flat: same.run(flat)
            below_lb += planned.peak_bytes < planned.plan["lb_graph"] or planned.peak_bytes < planned.plan["lb_sched"]
            rows.append([label, peak, planned.peak_bytes, None])
        t, cpu, faults = interleaved_medians(runners, args.rounds)
        t_eager, t_exec = t["eager"], t["executor"]
        ratios, cpu_ratios = {}, {}
        for row in rows:
            label, planned = row[0], plans.get(row[0])
            if planned is None:
                continue
            ratios[label] = t[label] / t_exec
            cpu_ratios[label] = cpu[label] / cpu["executor"]
            same = label + " (executor)"
            row[3] = (f"lb_graph {planned.plan['lb_graph'] / eager_peak:.3f}, t arena/exec {ratios[label]:.3f} "
                      f"(cpu {cpu_ratios[label]:.3f})"
                      + (f", arena / executor on the same recomputing graph {t[label] / t[same]:.3f} "
                         f"(cpu {cpu[label] / cpu[same]:.3f})" if same in t else "")
                      + (f", recomputed {len(planned.remat['recomputed'])}, +{planned.remat['added_flops'] / max(planned.remat['forward_flops'], 1):.1%} FLOPs"
                         if planned.remat else ""))
        print(f"\n== {name}: eager peak {eager_peak / mib:.2f} MiB, eager step {t_eager * 1e3:.1f} ms "
              f"(target planned/eager <= {TARGETS[name]})")
        print(f"{'':22} {'measured':>9} {'/eager':>7} {'planned':>9} {'/eager':>7} {'step ms':>8} {'/eager':>7}  notes")
        for label, peak, plan_peak, extra in rows:
            if peak is None:
                print(f"{label:22} {'':>9} {'':>7} {'':>9} {'':>7} {'':>8} {'':>7}  {extra}")
                continue
            pp = f"{plan_peak / mib:9.2f} {plan_peak / eager_peak:7.3f}" if plan_peak else f"{'':>9} {'':>7}"
            print(f"{label:22} {peak / mib:9.2f} {peak / eager_peak:7.3f} {pp} {t[label] * 1e3:8.1f} "
                  f"{t[label] / t_eager:7.3f}  {extra + ', ' if extra else ''}{faults[label]:.0f} page faults/step")
        print(f"{'executor (unplanned)':22} {'':>9} {'':>7} {'':>9} {'':>7} {t_exec * 1e3:8.1f} {t_exec / t_eager:7.3f}  "
              f"{faults['executor']:.0f} page faults/step")
        if ckpt_loss is not None and "at checkpoint peak" in t:
            print(f"at the checkpoint-per-block peak: {t['checkpoint/block'] / t['at checkpoint peak']:.3f}x the steps/s "
                  f"of torch.utils.checkpoint (target >= 1.15)")
        print(f"plans below their own LB_graph or LB_sched: {below_lb}")
        print(f"arena time / unplanned executor: max {max(ratios.values()):.3f} wall, {max(cpu_ratios.values()):.3f} "
              f"process CPU, over {len(ratios)} plans (target <= 1.0); executor / eager {t_exec / t_eager:.3f} wall, "
              f"{cpu['executor'] / cpu['eager']:.3f} CPU (medians of {args.rounds} interleaved rounds; load average "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())})")


if __name__ == "__main__":
    main()
