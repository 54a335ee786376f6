"""A/B of AOTInductor packages: eager and prebuilt packages of one bench_step case (each built by
``step.to_aoti(path, donate=True)`` at some commit, for this case's step), run through
``torch_ext.load_step`` and interleaved round by round in one process, one thread; ms/step (median
and min), ratio to eager, minor page faults per step. ``--nopool`` adds each package run without
load_step's call pool. Run it under the heavy lock:

    flock /tmp/torch_ext_heavy.lock python3 scripts/bench_aoti_packages.py --case resnet18 a.pt2 b.pt2
"""
import argparse, os, resource, sys, time, statistics
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ap = argparse.ArgumentParser(); ap.add_argument("--case", default="gpt2"); ap.add_argument("pkgs", nargs="+")
ap.add_argument("--iters", type=int, default=5); ap.add_argument("--rounds", type=int, default=5)
ap.add_argument("--nopool", action="store_true", help="also run each package without the pool")
ap.add_argument("--only-nopool", action="store_true")
args = ap.parse_args()
import torch, torch_ext
from bench_step import eager_and_pure_step
torch.set_num_threads(1)
name, eager, step, batch = eager_and_pure_step(args.case)
runs = {"eager": eager}
def mk(pkg, pooled):
    box = {"s": step.init_state(seed=0)}
    if not pooled: pkg._pool = None
    def f():
        _, box["s"] = pkg(box["s"], *batch)[:2]
    return f
for p in args.pkgs:
    if not args.only_nopool: runs[os.path.basename(p)] = mk(torch_ext.load_step(p), True)
    if args.nopool or args.only_nopool: runs[os.path.basename(p) + "/nopool"] = mk(torch_ext.load_step(p), False)
for f in runs.values():
    for _ in range(3): f()
samp = {k: [] for k in runs}; flt = {k: [] for k in runs}
print(name, "load", open("/proc/loadavg").read().split()[:3], flush=True)
for _ in range(args.rounds):
    for k, f in runs.items():
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt; t0 = time.perf_counter()
        for _ in range(args.iters): f()
        samp[k].append((time.perf_counter() - t0) / args.iters * 1e3)
        flt[k].append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / args.iters)
e = statistics.median(samp["eager"])
for k in runs:
    m = statistics.median(samp[k])
    print(f"  {k:28s} {m:7.1f} ms/step {1e3/m:5.2f} steps/s  x{e/m:.2f} eager  faults/step {statistics.median(flt[k]):.0f}  min {min(samp[k]):.0f} (x{min(samp['eager'])/min(samp[k]):.2f})  samples {[round(x) for x in samp[k]]}")
print("load after", open("/proc/loadavg").read().split()[:3])
