"""Steps per second of one AdamW training step, five ways, measured side by side in one run:

- eager: ``opt.zero_grad(); loss_fn(model, *batch).backward(); opt.step()``;
- executor: the pure step on the C++ executor (``step(state, *batch)``);
- arena: the planned step, one preallocated arena, donated state (``step.compile(plan=True, donate=True)``);
- aoti: the pure step compiled by AOTInductor as a donating package, run through
  ``torch_ext.load_step(step.to_aoti(path, donate=True))`` (the new state is stored into the state
  passed in, as the arena does); ``--aoti-plain`` adds aoti_plain, the package without donation;
- compile: what a user would pick instead, ``torch.compile`` of the whole eager step (the model
  compiled, and ``opt.step`` wrapped in ``torch.compile``).

Rounds are interleaved (each round times every runner back to back) and the median per runner is
reported, so the ratios are comparable on a noisy machine. Compile times: AOTInductor's package
build, and torch.compile's first two calls (forward, backward and the optimizer step), both with a
fresh Inductor cache directory unless --warm-cache.
Targets: aoti >= 1.0x compile and >= 1.3x eager; executor >= 1.0x eager.

What ran before a case in the same process changes its eager column (stop 30: eager GPT-2 3.02
steps/s first in a process, 3.55 after ResNet-18), so ``--both-orders`` runs the case list once per
rotation, each in a fresh process (a,b then b,a), and reports every case both first in a fresh
process and after the others (with eager's minor page faults per step, which is what changes);
a target counts as met only when it holds in both.

Every column must train as eager does: the first CHECK_STEPS losses of each (all on the same batch,
from the same initial state) are compared with eager's, bit for bit for the executor and the arena
(eager starts from torch.manual_seed(0), the pure step from init_state(seed=0)), and within the
case's tolerance for the Inductor-compiled columns (fused kernels; with dropout, AOTInductor and
torch.compile draw their own random streams); each column's loss must also fall over those steps.
A failed check makes the exit status 1.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import fcntl
import json
import os
import resource
import statistics
import subprocess
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

from _bench_util import check, summary, target

COLUMNS = ("eager", "executor", "arena", "aoti", "aoti_plain", "compile")
EXACT = ("executor", "arena")  # bit-exact with eager; the others within the case's tolerance
CHECK_STEPS = 3
# Loss tolerance of the Inductor-compiled columns, relative to the largest eager loss: float32
# rounding of fused kernels, or (with dropout) another random stream over the same data.
TOL, TOL_DROPOUT = 1e-4, 3e-2


def mlp_case():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    batch = (torch.randn(32, 64), torch.randint(0, 10, (32,)))
    return "mlp 64-128-128-10, batch 32", model, lambda m, x, y: F.cross_entropy(m(x), y), batch, TOL


def transformer_case():
    torch.manual_seed(0)
    model = TinyTransformer(vocab=64, d_model=32, n_heads=4, n_layers=2, seq=16)
    batch = (torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16)))
    return ("transformer 2x32, seq 16, batch 4", model,
            lambda m, i, t: F.cross_entropy(m(i).reshape(-1, 64), t.reshape(-1)), batch, TOL)


def gpt2_case():
    import transformers

    vocab = 8192
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=128, n_embd=256, n_layer=2, n_head=4,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).train()  # tied embeddings, dropout 0.1
    ids = torch.randint(0, vocab, (8, 128))
    return (f"HF GPT-2 2x256, vocab {vocab}, seq 128, batch 8", model,
            lambda m, ids: m(input_ids=ids, labels=ids).loss, (ids,), TOL_DROPOUT)


def resnet18_case():
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).train()
    batch = (torch.randn(16, 3, 64, 64), torch.randint(0, 10, (16,)))
    return ("torchvision ResNet-18, 64x64, batch 16", model, lambda m, x, y: F.cross_entropy(m(x), y), batch,
            TOL)


CASES = {"mlp": mlp_case, "transformer": transformer_case, "gpt2": gpt2_case, "resnet18": resnet18_case}


def eager_and_pure_step(case_name: str):
    """(case name, eager AdamW step closure, pure TrainStep, batch) for CASES[case_name], each side on its
    own copy of the model (the setup the AOTInductor profiling and package A/B scripts share)."""
    name, model, loss_fn, batch, _ = CASES[case_name]()
    em = copy.deepcopy(model)
    opt = torch.optim.AdamW(em.parameters(), lr=1e-3)

    def eager():
        opt.zero_grad()
        loss_fn(em, *batch).backward()
        opt.step()

    pm = copy.deepcopy(model)
    step = torch_ext.make_train_step(pm, torch.optim.AdamW(pm.parameters(), lr=1e-3), loss_fn, batch)
    return name, eager, step, batch


def time_loop(fn, iters):
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def runners_for(case, columns, tmpdir, errors, losses):
    """{column: one-step callable}, {column: compile seconds}; columns that fail to build go to errors.
    Each runner appends its first CHECK_STEPS losses to losses[column]."""
    name, model, loss_fn, batch, _ = case
    runners, compile_s = {}, {}

    def recorded(col, loss):
        got = losses.setdefault(col, [])
        if len(got) < CHECK_STEPS:
            got.append(loss.detach().clone())

    eager_model = copy.deepcopy(model)
    eager_opt = torch.optim.AdamW(eager_model.parameters(), lr=1e-3)

    def eager():
        if "eager" not in losses:  # the stream init_state(seed=0) gives the pure step
            torch.manual_seed(0)
        eager_opt.zero_grad()
        loss = loss_fn(eager_model, *batch)
        loss.backward()
        eager_opt.step()
        recorded("eager", loss)

    runners["eager"] = eager
    pure_model = copy.deepcopy(model)
    t0 = time.perf_counter()
    step = torch_ext.make_train_step(pure_model, torch.optim.AdamW(pure_model.parameters(), lr=1e-3), loss_fn, batch)
    compile_s["executor"] = time.perf_counter() - t0

    def state_runner(col, fn):
        box = {"s": step.init_state(seed=0)}

        def run():
            loss, box["s"] = fn(box["s"], *batch)[:2]
            recorded(col, loss)

        return run

    builders = {
        "executor": lambda: state_runner("executor", step),
        "arena": lambda: state_runner("arena", step.compile(plan=True, donate=True)),
        "aoti": lambda: state_runner("aoti", torch_ext.load_step(step.to_aoti(f"{tmpdir}/aoti.pt2", donate=True))),
        "aoti_plain": lambda: state_runner("aoti_plain", torch_ext.load_step(step.to_aoti(f"{tmpdir}/plain.pt2"))),
    }
    for col, build in builders.items():
        if col not in columns:
            continue
        t0 = time.perf_counter()
        try:
            runners[col] = build()
        except Exception as e:  # noqa: BLE001 - reported in the table's notes
            errors[col] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            continue
        if col != "executor":
            compile_s[col] = time.perf_counter() - t0
    if "compile" in columns:
        c_model = torch.compile(copy.deepcopy(model))
        c_opt = torch.optim.AdamW(c_model.parameters(), lr=1e-3)

        @torch.compile(fullgraph=False)
        def opt_step():
            c_opt.step()

        def compiled():
            c_opt.zero_grad()
            loss = loss_fn(c_model, *batch)
            loss.backward()
            opt_step()
            recorded("compile", loss)

        t0 = time.perf_counter()
        try:
            compiled()
            compiled()  # the optimizer's state exists from the second step on: a second graph
            compile_s["compile"] = time.perf_counter() - t0
            runners["compile"] = compiled
        except Exception as e:  # noqa: BLE001 - reported in the table's notes
            errors["compile"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return {k: runners[k] for k in COLUMNS if k in runners}, compile_s


def check_losses(case, losses):
    """Every column's first CHECK_STEPS losses against eager's (see the module docstring)."""
    name, tol = case[0], case[4]
    want = torch.stack(losses["eager"])
    for col, got in losses.items():
        if col == "eager" or len(got) < CHECK_STEPS:
            continue
        got = torch.stack(got)
        # Relative to the largest eager loss: on the one repeated batch the loss falls 200x in three
        # steps (ResNet-18: 2.57, 0.146, 0.0124), so a per-step ratio would measure rounding against
        # a nearly-zero loss (torch.compile itself is 3e-3 off eager there).
        rel = float((got.double() - want.double()).abs().max() / want.double().abs().max())
        if col in EXACT:
            check(torch.equal(got, want), f"{name} / {col}: losses {got.tolist()} are not eager's {want.tolist()}")
        else:
            check(rel <= tol, f"{name} / {col}: losses {got.tolist()} differ from eager's {want.tolist()} by "
                              f"{rel:.2e} relative (tolerance {tol:.0e})")
        check(bool(got[-1] < got[0]), f"{name} / {col}: the loss did not fall over {CHECK_STEPS} steps: {got.tolist()}")
        print(f"    {col}: losses within {rel:.1e} of eager's")


@contextlib.contextmanager
def held(lock_path):
    """An exclusive flock on lock_path (none when it is None): the timed part of a case only, so a
    shared machine runs one measurement at a time without holding the lock through the compiles."""
    if lock_path is None:
        yield
        return
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def bench(case, iters, rounds, columns, warmup, lock_path=None):
    """({column: steps/s}, {column: compile s}, {column: error}, {column: minor page faults per step});
    a runner that fails to build or run is reported with its error instead of stopping the other columns."""
    errors, losses = {}, {}
    with tempfile.TemporaryDirectory() as d, contextlib.ExitStack() as stack:
        runners, compile_s = runners_for(case, columns, d, errors, losses)
        stack.enter_context(held(lock_path))
        print(f"  timing {case[0]} (load {os.getloadavg()[0]:.2f})", flush=True)
        for k, fn in list(runners.items()):
            try:
                time_loop(fn, max(warmup, CHECK_STEPS))
            except Exception as e:  # noqa: BLE001 - reported in the table's notes
                errors[k] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                del runners[k]
        check_losses(case, losses)
        samples = {k: [] for k in runners}
        faults = dict.fromkeys(runners, 0)  # first-touched pages: what the allocator's state costs a column
        for _ in range(rounds):
            for k, fn in runners.items():
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                samples[k].append(time_loop(fn, iters))
                faults[k] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    return ({k: 1.0 / statistics.median(v) for k, v in samples.items()}, compile_s, errors,
            {k: v / (rounds * iters) for k, v in faults.items()})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=10, help="steps per timed round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    ap.add_argument("--no-aoti", action="store_true", help="skip the AOTInductor column (minutes on 2 cores)")
    ap.add_argument("--aoti-plain", action="store_true",
                    help="add aoti_plain: the AOTInductor package without donation (another compile)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile column (minutes on 2 cores)")
    ap.add_argument("--threads", type=int, help="torch.set_num_threads for every column (default: torch's)")
    ap.add_argument("--lock", help="flock this file around each case's timed rounds (not its compiles)")
    ap.add_argument("--warm-cache", action="store_true",
                    help="reuse Inductor's on-disk cache (compile times then measure cache hits, not compiles)")
    ap.add_argument("--both-orders", action="store_true",
                    help="run the cases once per rotation of --cases, each rotation in a fresh process, and report "
                         "every case first in a process and after the others (eager depends on what ran before)")
    ap.add_argument("--json", help=argparse.SUPPRESS)  # where a --both-orders child writes its rows
    args = ap.parse_args()
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; choose from {list(CASES)}")
    if args.both_orders:
        return both_orders(cases, sys.argv[1:])
    skip = {"aoti": args.no_aoti, "aoti_plain": args.no_aoti or not args.aoti_plain, "compile": args.no_compile}
    columns = [c for c in COLUMNS if not skip.get(c)]
    t_start = time.perf_counter()
    if args.threads is not None:  # before any compile: Inductor's C++ kernels take the count at compile time
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; AdamW; steps/s, median of {args.rounds} "
          f"interleaved rounds x {args.iters} steps; Inductor cache "
          + ("warm" if args.warm_cache else "cold (fresh dir)"))
    rows = []
    for k, key in enumerate(cases):
        case = CASES[key]()
        sps, compile_s, errors, faults = bench(case, args.iters, args.rounds, columns, args.warmup, args.lock)
        rows.append((case[0], sps, compile_s, errors))
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps({"case": key, "name": case[0], "after": cases[:k], "sps": sps,
                                    "compile_s": compile_s, "errors": errors, "faults": faults}) + "\n")
        print(f"  {case[0]}: " + ", ".join(f"{k} {v:.2f}" for k, v in sps.items())
              + "; build/compile s: " + ", ".join(f"{k} {v:.1f}" for k, v in compile_s.items())
              + "; minor page faults per step: " + ", ".join(f"{k} {v:.0f}" for k, v in faults.items()), flush=True)
    nan = float("nan")
    print()
    print(f"{'case':46}" + "".join(f"{c:>11}" for c in columns)
          + f"{'exec/eager':>11}{'arena/eager':>12}{'aoti/eager':>11}{'aoti/compile':>13}{'aoti/plain':>11}")
    for name, sps, _, _ in rows:
        ratio = lambda a, b: sps.get(a, nan) / sps.get(b, nan)  # noqa: E731
        print(f"{name:46}" + "".join(f"{sps.get(c, nan):11.2f}" for c in columns)
              + f"{ratio('executor', 'eager'):10.2f}x{ratio('arena', 'eager'):11.2f}x"
              + f"{ratio('aoti', 'eager'):10.2f}x{ratio('aoti', 'compile'):12.2f}x{ratio('aoti', 'aoti_plain'):10.2f}x")
    print()
    built = [c for c in columns if c != "eager"]
    print(f"{'compile / build seconds':46}" + "".join(f"{c:>11}" for c in built))
    for name, _, compile_s, _ in rows:
        print(f"{name:46}" + "".join(f"{compile_s.get(c, nan):11.1f}" for c in built))
    for name, _, _, errors in rows:
        for col, err in errors.items():
            print(f"FAILED {name} / {col}: {err}")
    print("(executor: make_train_step (export + passes); arena: planning; aoti: step.to_aoti; compile: torch.compile's "
          "first two steps)")
    print("targets: executor >= 1.00x eager; aoti >= 1.30x eager and >= 1.00x compile")
    return summary(t_start)


def both_orders(cases: list[str], argv: list[str]) -> int:
    """Runs this script once per rotation of ``cases``, each in a fresh process, and prints every
    case's row first in its process and after the others; the exit status is the worst child's."""
    t_start = time.perf_counter()
    passed, skip = [], False
    for a in argv:  # the child gets every option but these two
        if skip:
            skip = False
        elif a in ("--both-orders",):
            continue
        elif a == "--cases":
            skip = True
        elif not a.startswith("--cases="):
            passed.append(a)
    rows, status = [], 0
    with tempfile.TemporaryDirectory() as d:
        for r in range(len(cases)):
            order = cases[r:] + cases[:r]
            out = os.path.join(d, f"rows{r}.json")
            print(f"\n### fresh process, cases in the order {','.join(order)}", flush=True)
            status = max(status, subprocess.call([sys.executable, os.path.abspath(__file__), "--cases", ",".join(order),
                                                  "--json", out, *passed]))
            if os.path.exists(out):
                with open(out) as f:
                    rows += [json.loads(line) for line in f]
    nan = float("nan")
    print(f"\n{'case':12}{'position':26}{'eager':>8}{'executor':>9}{'aoti':>8}{'compile':>9}"
          f"{'exec/eager':>11}{'aoti/eager':>11}{'aoti/compile':>13}{'aoti s':>8}{'compile s':>10}"
          f"{'eager faults':>13}")
    for key in cases:
        worst = {}
        for row in (r for r in rows if r["case"] == key):
            sps, cs = row["sps"], row["compile_s"]
            ratio = {"exec/eager": sps.get("executor", nan) / sps.get("eager", nan),
                     "aoti/eager": sps.get("aoti", nan) / sps.get("eager", nan),
                     "aoti/compile": sps.get("aoti", nan) / sps.get("compile", nan)}
            for k, v in ratio.items():
                worst[k] = min(worst.get(k, v), v)
            where = "first, fresh process" if not row["after"] else "after " + ",".join(row["after"])
            print(f"{key:12}{where:26}" + "".join(f"{sps.get(c, nan):{w}.2f}" for c, w in
                                                 (("eager", 8), ("executor", 9), ("aoti", 8), ("compile", 9)))
                  + f"{ratio['exec/eager']:10.2f}x{ratio['aoti/eager']:10.2f}x{ratio['aoti/compile']:12.2f}x"
                  + f"{cs.get('aoti', nan):8.1f}{cs.get('compile', nan):10.1f}"
                  + f"{row.get('faults', {}).get('eager', nan):13.0f}")
        for k, goal in (("exec/eager", 1.0), ("aoti/eager", 1.3), ("aoti/compile", 1.0)):
            if k in worst and worst[k] == worst[k]:  # nan: the column was not run
                target(worst[k] >= goal, f"{key} {k} {worst[k]:.2f}x in its worst order (target {goal:.2f}x)")
    print("targets: executor >= 1.00x eager; aoti >= 1.30x eager and >= 1.00x compile, in every position")
    return max(status, summary(t_start))


if __name__ == "__main__":
    sys.exit(main())
