"""Peak memory and time of one training step: eager torch.optim, torch.utils.checkpoint on every
block, the planned pure step, and the planned step under memory budgets (rematerialization).

Configs (issue 17):
  * parameter-heavy: an MLP of 8 layers of 1024x1024, batch 16, Adam and SGD-momentum;
  * activation-heavy: a CNN at batch 64, SGD-momentum;
  * GPT-style: 4 layers, d_model 256, seq 256, batch 8, AdamW (--gpt-seq/--gpt-batch to shrink);
  * Hugging Face GPT-2 (transformers.GPT2LMHeadModel, its dropouts on) at the same sizes, vocabulary 256,
    AdamW; torch.utils.checkpoint on every block through its own gradient_checkpointing_enable().
Every peak is measured the same way: torch.profiler's allocation events over one step, plus the
state and batch held (and the arena, for the planned steps). Times are medians in one run, the
unplanned executor interleaved with the arena executor, best of 6 each in process CPU time (column
t arena/exec; the step ms column is wall time).
"""
from __future__ import annotations

import argparse
import pathlib
import re
import sys
import time
import types

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import torch_ext
from torch_ext.memory import _eager_peak, measured_peak
from torch_ext.memory import _time_step as median_time  # the timing memory_report uses
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


def paired_min_times(fa, fb, rounds=6):
    """Best-of-rounds times of fa and fb, alternating, so both see the same machine load. Process
    CPU time (both threads), which another job on the same cores disturbs less than wall time."""
    ta, tb = [], []
    for _ in range(rounds):
        for f, out in ((fa, ta), (fb, tb)):
            t0 = time.process_time()
            f()
            out.append(time.process_time() - t0)
    return min(ta), min(tb)


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
    args = ap.parse_args()
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
        em, eo = __import__("copy").deepcopy((model, make_opt(model)))
        eo = make_opt(em)
        t_eager = median_time(eager_runner(em, eo, loss_fn, batch), n=1)
        rows = [("eager", eager_peak, None, t_eager, None)]
        lb = None
        if ckpt_loss is not None:
            cm = __import__("copy").deepcopy(model)
            co = make_opt(cm)
            shim = types.SimpleNamespace(model=cm, optimizers=[co], loss_fn=ckpt_loss)
            ck_peak, _ = _eager_peak(shim, batch)
            rows.append(("checkpoint/block", ck_peak, None, median_time(eager_runner(cm, co, ckpt_loss, batch), n=1), None))
        unplanned = step.compile(plan=False, donate=False)
        budgets = [None] + ([0.7, 0.5, 0.35] if ckpt_loss is not None else [])
        if ckpt_loss is not None:
            budgets.append(("at checkpoint peak", rows[1][1]))
        ratios, below_lb = [], 0
        for b in budgets:
            label, budget = (b if isinstance(b, tuple) else (("planned" if b is None else f"budget {b}"), b))
            try:
                planned = step.compile(plan=True, donate=True, memory_budget=budget)
            except ValueError as e:
                found = int(re.search(r"smallest planned peak found is (\d+) bytes", str(e)).group(1))
                rows.append((label, None, None, None, f"infeasible: smallest planned peak found {found / mib:.2f} MiB "
                                                      f"= {found / eager_peak:.3f} of eager"))
                continue
            peak, _ = measured_peak(planned, step.init_state(), batch)
            t_plan, t_exec = paired_min_times(step_runner(planned, step.init_state(), batch),
                                              step_runner(unplanned, step.init_state(), batch))
            ratios.append(t_plan / t_exec)
            lb = (planned.plan["lb_graph"], planned.plan["lb_sched"]) if b is None else lb
            extra = (f"lb_graph {planned.plan['lb_graph'] / eager_peak:.3f}, t arena/exec {t_plan / t_exec:.3f}"
                     + (f", recomputed {len(planned.remat['recomputed'])}, +{planned.remat['added_flops'] / max(planned.remat['forward_flops'], 1):.1%} FLOPs"
                        if planned.remat else ""))
            below_lb += planned.peak_bytes < planned.plan["lb_graph"] or planned.peak_bytes < planned.plan["lb_sched"]
            rows.append((label, peak, planned.peak_bytes, median_time(step_runner(planned, step.init_state(), batch), n=1),
                         extra))
        print(f"\n== {name}: eager peak {eager_peak / mib:.2f} MiB, eager step {t_eager * 1e3:.1f} ms "
              f"(target planned/eager <= {TARGETS[name]})")
        print(f"{'':22} {'measured':>9} {'/eager':>7} {'planned':>9} {'/eager':>7} {'step ms':>8} {'/eager':>7}  notes")
        for label, peak, plan_peak, t, extra in rows:
            if peak is None:
                print(f"{label:22} {'':>9} {'':>7} {'':>9} {'':>7} {'':>8} {'':>7}  {extra}")
                continue
            pp = f"{plan_peak / mib:9.2f} {plan_peak / eager_peak:7.3f}" if plan_peak else f"{'':>9} {'':>7}"
            print(f"{label:22} {peak / mib:9.2f} {peak / eager_peak:7.3f} {pp} {t * 1e3:8.1f} {t / t_eager:7.3f}  {extra or ''}")
        if ckpt_loss is not None:
            ck = rows[1]
            at = [r for r in rows if r[0] == "at checkpoint peak" and r[1] is not None]
            if at:
                print(f"at the checkpoint-per-block peak: {ck[3] / at[0][3]:.3f}x the steps/s of torch.utils.checkpoint "
                      f"(target >= 1.15)")
        print(f"plans below their own LB_graph or LB_sched: {below_lb}")
        print(f"arena time / unplanned executor: max {max(ratios):.3f} over {len(ratios)} plans (target <= 1.0)")


if __name__ == "__main__":
    main()
