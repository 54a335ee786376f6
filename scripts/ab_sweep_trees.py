#!/usr/bin/env python
"""A/B of two source trees on the sweep grid's arms and the TL batched sweep, side by side (issue 10).

    python scripts/ab_sweep_trees.py OLD_TREE NEW_TREE ROUNDS CASE:REPEATS ...
    e.g. python scripts/ab_sweep_trees.py /work/wt/old30 . 4 relu_64:15 sin_64:15 linear+gelu_64:10 \
             relu_384:5 sin_384:5 tl128:5

Each case of each tree runs in its own subprocess (PYTHONPATH=<tree>:<tree>/scripts, cwd <tree>; both
trees built, their libraries copied into <tree>/torch_ext), the two trees alternated (ABBA) round by
round, every run under flock /tmp/torch_ext_bench.lock. Cases: <op>_<d> (bench_sweep.py's grid cell:
arms full = Executor per site, sweep = torch_ext.sweep, cone = _C.Engine.evaluate_patched, us per site)
and tl<d> (part 2 at batch 8: eager hooks, batch_sites=True, and with reads declared, ms per sweep).
Times: thread CPU time (time.thread_time) and wall, median of the in-process repeats, then median over
rounds. The arms' metrics are checked equal (grid: bit for bit; TL: within 1e-5 of eager), as in bench_sweep.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time


def timeit(arms, repeats):
    for fn, _ in arms.values():
        fn()
    th = {k: [] for k in arms}; wa = {k: [] for k in arms}
    for _ in range(repeats):
        for k, (fn, per) in arms.items():
            t0 = time.thread_time(); w0 = time.perf_counter()
            fn()
            th[k].append((time.thread_time() - t0) / per * 1e6); wa[k].append((time.perf_counter() - w0) / per * 1e6)
    return {k: {"th_med": statistics.median(th[k]), "th_min": min(th[k]),
                "wall_med": statistics.median(wa[k]), "wall_min": min(wa[k])} for k in arms}


def grid(op, d, repeats, n=160, every=4):
    from bench_sweep import _GridChain, _grid_full_graph
    torch.manual_seed(0)
    model = _GridChain(op, d, n).eval()
    x = torch.randn(d, d)
    rg = torch_ext.ReactiveGraph(model, (x,))
    nodes = rg.nodes()
    site_idx = list(range(every, n + 1, every))
    sites = [nodes[i - 1] for i in site_idx]
    pre = {s: rg.value(s) * 0.5 for s in sites}
    extra = [model.lin.weight.detach(), model.lin.bias.detach()] if op == "linear+gelu" else []
    exe = {s: torch_ext.Executor(Graph.parse(_grid_full_graph(op, d, n, i))) for s, i in zip(sites, site_idx)}
    eng = rg._engine._e if hasattr(rg._engine, "_e") else rg._engine
    S = len(sites)
    res = {}
    def full():
        res["full"] = {s: float(exe[s](x, pre[s], *extra)[0].sum()) for s in sites}
    def sweep():
        res["sweep"] = torch_ext.sweep(rg, sites, lambda v, s: pre[s], lambda o: o.sum(), progress=False)
    def cone():
        for s in sites:
            eng.evaluate_patched(s, pre[s])
    with torch.no_grad():
        t = timeit({"full": (full, S), "sweep": (sweep, S), "cone": (cone, S)}, repeats)
    r = res["sweep"]
    assert all(r.metrics[s] == res["full"][s] for s in sites), "arms disagree"
    assert r.measured_evaluations == r.predicted_evaluations
    return t, {"rho": r.rho, "S": S}


def tl(d, B, repeats):
    from bench_sweep import tl_setup, resid_pos_sites, metric
    from _bench_util import eager_hook_sweep, resid_pre_cache
    model, clean, corrupt = tl_setup(d=d, B=B)
    T = clean.shape[1]; L = len(model.blocks)
    cache = resid_pre_cache(model, corrupt)
    rg = torch_ext.ReactiveGraph(model, (clean,))
    resid = ["add"] + [rg.nodes(f"blocks.{i}")[-1] for i in range(L - 1)]
    layer_of = {node: i for i, node in enumerate(resid)}
    sites, patch = resid_pos_sites(cache, resid, T)
    reads = {"logits": (slice(None), -1, [3, 5])}
    res = {}
    def eager():
        res["eager"] = eager_hook_sweep(model, clean, cache, T, metric)
    def batched():
        res["batched"] = torch_ext.sweep(rg, sites, patch, metric, progress=False, batch_sites=True)
    def batched_r():
        res["batched_r"] = torch_ext.sweep(rg, sites, patch, metric, progress=False, batch_sites=True, reads=reads)
    with torch.no_grad():
        batched()
        t = timeit({"eager": (eager, 1), "batched": (batched, 1), "batched_r": (batched_r, 1)}, repeats)
    e = res["eager"]
    for k in ("batched", "batched_r"):
        diff = max(abs(e[(layer_of[n], p)] - res[k].metrics[(n, p)]) for n, p in sites)
        assert diff <= 1e-5, (k, diff)
    return t, {"sites": len(sites)}


def worker(case: str, repeats: int) -> None:
    global torch, torch_ext, Graph
    import torch
    import torch_ext
    from torch_ext.ir import Graph
    torch.set_num_threads(1)
    if case.startswith("tl"):
        t, info = tl(int(case[2:]), 8, repeats)
    else:
        op, d = case.rsplit("_", 1)
        t, info = grid(op, int(d), repeats)
    print("JSON" + json.dumps({"case": case, "times": t, "info": info, "file": torch_ext.__file__,
                               "load": os.getloadavg()[0]}))


def run(TREES, tree, case, reps):
    p = TREES[tree]
    env = {"PYTHONPATH": f"{p}:{p}/scripts", "PATH": "/usr/bin:/bin:" + os.environ["PATH"],
           "OMP_NUM_THREADS": "1", "HOME": os.environ.get("HOME", "/tmp")}
    cmd = ["flock", "/tmp/torch_ext_bench.lock", sys.executable, os.path.abspath(__file__), "--worker", case, str(reps)]
    out = subprocess.run(cmd, cwd=p, env=env, capture_output=True, text=True)
    line = [l for l in out.stdout.splitlines() if l.startswith("JSON")]
    if not line:
        print(out.stdout, out.stderr[-3000:])
        raise SystemExit(f"{tree} {case} failed")
    j = json.loads(line[0][4:])
    assert j["file"].startswith(p), j["file"]  # the tree's own torch_ext, not the editable install
    return j


def main() -> int:
    if sys.argv[1] == "--worker":
        return worker(sys.argv[2], int(sys.argv[3]))
    TREES = {"old": os.path.abspath(sys.argv[1]), "new": os.path.abspath(sys.argv[2])}
    rounds = int(sys.argv[3]); spec = sys.argv[4:]  # case:reps
    res: dict = {}
    for r in range(rounds):
        for i, cs in enumerate(spec):
            case, reps = cs.split(":")
            order = ["old", "new"] if (r + i) % 2 == 0 else ["new", "old"]
            for t in order:
                j = run(TREES, t, case, int(reps))
                res.setdefault(case, {}).setdefault(t, []).append(j)
                print(f"round {r} {case} {t}: " + ", ".join(f"{k} {v['th_med']:.1f}" for k, v in j["times"].items())
                      + f" (load {j['load']:.2f})", flush=True)
    print("\nmedian over rounds of each run's median; us per site (grid) or ms per sweep (tl); thread CPU / wall")
    for case, by in res.items():
        arms = list(by["old"][0]["times"])
        for a in arms:
            row = []
            for key in ("th_med", "wall_med"):
                o = statistics.median(j["times"][a][key] for j in by["old"])
                m = statistics.median(j["times"][a][key] for j in by["new"])
                sc = 1e-3 if case.startswith("tl") else 1
                row.append(f"{o*sc:9.2f} {m*sc:9.2f} {m/o:6.3f}")
            print(f"{case:12s} {a:10s} thread old/new/ratio {row[0]}   wall {row[1]}")
        if not case.startswith("tl"):
            rho = by["old"][0]["info"]["rho"]
            for t in ("old", "new"):
                f = statistics.median(j["times"]["full"]["wall_med"] for j in by[t])
                s = statistics.median(j["times"]["sweep"]["wall_med"] for j in by[t])
                ft = statistics.median(j["times"]["full"]["th_med"] for j in by[t])
                st = statistics.median(j["times"]["sweep"]["th_med"] for j in by[t])
                print(f"{case:12s} {t:6s} full/sweep / rho: wall {f/s/rho:.3f}, thread {ft/st/rho:.3f} (rho {rho:.3f})")
    return 0

if __name__ == "__main__":
    sys.exit(main())
