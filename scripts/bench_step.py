"""Steps per second of one AdamW training step, five ways, measured side by side in one run:

- eager: ``opt.zero_grad(); loss_fn(model, *batch).backward(); opt.step()``;
- executor: the pure step on the C++ executor (``step(state, *batch)``);
- arena: the planned step, one preallocated arena, donated state (``step.compile(plan=True, donate=True)``);
- aoti: the pure step compiled by AOTInductor, run through ``torch_ext.load_step(step.to_aoti(path))``;
- compile: what a user would pick instead, ``torch.compile`` of the whole eager step (the model
  compiled, and ``opt.step`` wrapped in ``torch.compile``).

Rounds are interleaved (each round times every runner back to back) and the median per runner is
reported, so the ratios are comparable on a noisy machine. Compile times: AOTInductor's package
build, and torch.compile's first two calls (forward, backward and the optimizer step), both with a
fresh Inductor cache directory unless --warm-cache.
Targets: aoti >= 1.0x compile and >= 1.3x eager; executor >= 1.0x eager.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time

if "--warm-cache" not in sys.argv:
    # Cold compile times: Inductor's on-disk caches (FX graphs, kernels) would otherwise make a
    # second run's torch.compile and AOTInductor look 10x faster. Set before torch reads its config.
    import atexit
    import shutil

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench_step_inductor_")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_ext
from torch_ext.models import TinyTransformer

COLUMNS = ("eager", "executor", "arena", "aoti", "compile")


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


def gpt2_case():
    import transformers

    vocab = 8192
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=128, n_embd=256, n_layer=2, n_head=4,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).train()  # tied embeddings, dropout 0.1
    ids = torch.randint(0, vocab, (8, 128))
    return (f"HF GPT-2 2x256, vocab {vocab}, seq 128, batch 8", model,
            lambda m, ids: m(input_ids=ids, labels=ids).loss, (ids,))


def resnet18_case():
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).train()
    batch = (torch.randn(16, 3, 64, 64), torch.randint(0, 10, (16,)))
    return "torchvision ResNet-18, 64x64, batch 16", model, lambda m, x, y: F.cross_entropy(m(x), y), batch


CASES = {"mlp": mlp_case, "transformer": transformer_case, "gpt2": gpt2_case, "resnet18": resnet18_case}


def time_loop(fn, iters):
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def runners_for(case, columns, tmpdir, errors):
    """{column: one-step callable}, {column: compile seconds}; columns that fail to build go to errors."""
    name, model, loss_fn, batch = case
    runners, compile_s = {}, {}

    eager_model = copy.deepcopy(model)
    eager_opt = torch.optim.AdamW(eager_model.parameters(), lr=1e-3)

    def eager():
        eager_opt.zero_grad()
        loss_fn(eager_model, *batch).backward()
        eager_opt.step()

    runners["eager"] = eager
    pure_model = copy.deepcopy(model)
    t0 = time.perf_counter()
    step = torch_ext.make_train_step(pure_model, torch.optim.AdamW(pure_model.parameters(), lr=1e-3), loss_fn, batch)
    compile_s["executor"] = time.perf_counter() - t0
    if "executor" in columns:
        box = {"s": step.init_state(seed=0)}

        def executor():
            box["s"] = step(box["s"], *batch)[1]

        runners["executor"] = executor
    def arena_runner():
        planned = step.compile(plan=True, donate=True)
        abox = {"s": step.init_state(seed=0)}

        def arena():
            abox["s"] = planned(abox["s"], *batch)[1]

        return arena

    def aoti_runner():
        loaded = torch_ext.load_step(step.to_aoti(f"{tmpdir}/step_aoti.pt2"))
        obox = {"s": step.init_state(seed=0)}

        def aoti():
            obox["s"] = loaded(obox["s"], *batch)[1]

        return aoti

    for col, build in (("arena", arena_runner), ("aoti", aoti_runner)):
        if col not in columns:
            continue
        t0 = time.perf_counter()
        try:
            runners[col] = build()
        except Exception as e:  # noqa: BLE001 - reported in the table's notes
            errors[col] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            continue
        compile_s[col] = time.perf_counter() - t0
    if "compile" in columns:
        c_model = torch.compile(copy.deepcopy(model))
        c_opt = torch.optim.AdamW(c_model.parameters(), lr=1e-3)

        @torch.compile(fullgraph=False)
        def opt_step():
            c_opt.step()

        def compiled():
            c_opt.zero_grad()
            loss_fn(c_model, *batch).backward()
            opt_step()

        t0 = time.perf_counter()
        try:
            compiled()
            compiled()  # the optimizer's state exists from the second step on: a second graph
            compile_s["compile"] = time.perf_counter() - t0
            runners["compile"] = compiled
        except Exception as e:  # noqa: BLE001 - reported in the table's notes
            errors["compile"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return {k: runners[k] for k in COLUMNS if k in runners}, compile_s


def bench(case, iters, rounds, columns, warmup):
    """({column: steps/s}, {column: compile s}, {column: error}); a runner that fails to build or run
    is reported with its error instead of stopping the other columns."""
    errors = {}
    with tempfile.TemporaryDirectory() as d:
        runners, compile_s = runners_for(case, columns, d, errors)
        for k, fn in list(runners.items()):
            try:
                time_loop(fn, warmup)
            except Exception as e:  # noqa: BLE001 - reported in the table's notes
                errors[k] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                del runners[k]
        samples = {k: [] for k in runners}
        for _ in range(rounds):
            for k, fn in runners.items():
                samples[k].append(time_loop(fn, iters))
    return {k: 1.0 / statistics.median(v) for k, v in samples.items()}, compile_s, errors


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=10, help="steps per timed round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    ap.add_argument("--no-aoti", action="store_true", help="skip the AOTInductor column (minutes on 2 cores)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile column (minutes on 2 cores)")
    ap.add_argument("--warm-cache", action="store_true",
                    help="reuse Inductor's on-disk cache (compile times then measure cache hits, not compiles)")
    args = ap.parse_args()
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; choose from {list(CASES)}")
    columns = [c for c in COLUMNS if not (c == "aoti" and args.no_aoti) and not (c == "compile" and args.no_compile)]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; AdamW; steps/s, median of {args.rounds} "
          f"interleaved rounds x {args.iters} steps; Inductor cache "
          + ("warm" if args.warm_cache else "cold (fresh dir)"))
    rows = []
    for key in cases:
        case = CASES[key]()
        sps, compile_s, errors = bench(case, args.iters, args.rounds, columns, args.warmup)
        rows.append((case[0], sps, compile_s, errors))
        print(f"  {case[0]}: " + ", ".join(f"{k} {v:.2f}" for k, v in sps.items())
              + "; build/compile s: " + ", ".join(f"{k} {v:.1f}" for k, v in compile_s.items()), flush=True)
    nan = float("nan")
    print()
    print(f"{'case':46}" + "".join(f"{c:>10}" for c in columns)
          + f"{'exec/eager':>11}{'arena/eager':>12}{'aoti/eager':>11}{'aoti/compile':>13}")
    for name, sps, _, _ in rows:
        ratio = lambda a, b: sps.get(a, nan) / sps.get(b, nan)  # noqa: E731
        print(f"{name:46}" + "".join(f"{sps.get(c, nan):10.2f}" for c in columns)
              + f"{ratio('executor', 'eager'):10.2f}x{ratio('arena', 'eager'):11.2f}x"
              + f"{ratio('aoti', 'eager'):10.2f}x{ratio('aoti', 'compile'):12.2f}x")
    print()
    print(f"{'compile / build seconds':46}" + "".join(f"{c:>10}" for c in ("executor", "arena", "aoti", "compile")))
    built = ("executor", "arena", "aoti", "compile")
    for name, _, compile_s, _ in rows:
        print(f"{name:46}" + "".join(f"{compile_s.get(c, nan):10.1f}" for c in built))
    for name, _, _, errors in rows:
        for col, err in errors.items():
            print(f"FAILED {name} / {col}: {err}")
    print("(executor: make_train_step (export + passes); arena: planning; aoti: step.to_aoti; compile: torch.compile's "
          "first two steps)")
    print("targets: executor >= 1.00x eager; aoti >= 1.30x eager and >= 1.00x compile")


if __name__ == "__main__":
    main()
