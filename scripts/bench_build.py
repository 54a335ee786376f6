#!/usr/bin/env python
"""The build cost of a ReactiveGraph, end to end (issue 10 item 5, issue 12's end-to-end targets). CPU, one thread.

    python scripts/bench_build.py [--repeats 3] [--cold-repeats 2] [--parts split sweep patching] [--clock thread]

1. split: where ``ReactiveGraph(model, inputs)`` spends its time, per front end (torch.export against
   make_fx), cache off: trace, import (functionalize, hook names, IR), bind (kernels), first run. A
   4-layer d_model 128 TinyTransformer and the issue-12 TransformerBridge, seq 20, batch 1 and 8. Each
   row also gives the floor of the build: the time inside torch's own tracer (make_fx's
   ``_MakefxTracer.trace``, or ``torch.export.export``), which torch_ext does not control.
2. sweep (issue 10): one 80-site residual sweep (4 layers x 20 positions) of the TinyTransformer, building
   included, against the eager forward-hook sweep. Target >= 2x.
3. patching (issue 12): torch_ext.patching against transformer_lens.patching on the TransformerBridge,
   get_act_patch_resid_pre (target >= 3x) and get_act_patch_attn_head_out_by_pos (target >= 5x), building
   included, seq 20, batch 1 and 8.

Each end-to-end comparison is reported these ways, and says which include a cache hit:
- cold: the first call in a fresh Python process (imports excluded, tracer and kernels cold), each
  side in its own process, medians over --cold-repeats interleaved runs; ours twice: with the on-disk
  build cache off (TORCH_EXT_CACHE=0: it traces), and with a hit in it (a temporary cache folder,
  filled by one run before the timed ones: no trace, no torch._dynamo import);
- build, no cache: in a warm process, the graph traced again (build cache off);
- cache hit: a fresh model object of the same architecture (other weights): the per-process build
  cache supplies the graph, only weights are bound;
- warm (patching only): the same model again, its built graph reused.
In-process arms each start from a collected heap (``gc.collect()``, untimed; see ``_GcClock``) and report the
cyclic-GC time inside them: a full collection left pending by a tracing arm is not charged to the next arm.
Results are checked against the reference (eager hooks / TransformerLens) every time.

Floors, measured beside the sweep: a cold build with the cache off imports torch._dynamo (torch 2.9's make_fx
does, in ``_MakefxTracer._trace_inner``, as torch.export does), timed in a fresh process; a rebuilt sweep
cannot take less than torch's tracer plus the cache-hit sweep, so ``eager / (tracer + cache-hit arm)`` is
about the best ratio any build around that tracer could reach (the "ceiling" printed on the in-process
line: an estimate from arms timed apart, so a noisy run can land above it).

``--clock thread`` times with this thread's CPU time (``time.thread_time``) instead of the wall clock: on a
shared, loaded machine. build_stats' phases stay wall-clock seconds.
"""
from __future__ import annotations

import argparse
import copy
import gc
import importlib
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_util import FAILURES, check, eager_hook_sweep, header, resid_pre_cache, summary, target  # noqa: E402

L, D, H, T, V = 4, 128, 4, 20, 500
CLOCK = time.perf_counter  # --clock thread: time.thread_time


class _TracerClock:
    """Seconds inside torch's own tracer while the block runs: make_fx's ``_MakefxTracer.trace`` and
    ``torch.export.export`` (outermost calls only: export traces with make_fx), timed with ``CLOCK``."""

    def __init__(self):
        self.s, self._depth, self._saved = 0.0, 0, []

    def _timed(self, fn):
        def call(*args, **kw):
            self._depth += 1
            t0 = CLOCK()
            try:
                return fn(*args, **kw)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.s += CLOCK() - t0
        return call

    def __enter__(self):
        from torch.fx.experimental import proxy_tensor

        self.s = 0.0
        for owner, name in ((proxy_tensor._MakefxTracer, "trace"), (torch.export, "export")):
            fn = vars(owner)[name]
            self._saved.append((owner, name, fn))
            setattr(owner, name, self._timed(fn))
        return self

    def __exit__(self, *exc):
        for owner, name, fn in reversed(self._saved):
            setattr(owner, name, fn)
        self._saved.clear()


# ---------------------------------------------------------------------------- models
def tiny(seed: int = 0):
    from torch_ext.models import TinyTransformer

    torch.manual_seed(seed)
    return TinyTransformer(vocab=V, d_model=D, n_heads=H, n_layers=L, seq=T).eval()


def bridge(seed: int = 0):
    import transformer_lens as tl

    cfg = tl.TransformerBridgeConfig(n_layers=L, d_model=D, n_heads=H, d_head=D // H, d_mlp=4 * D, n_ctx=32,
                                     d_vocab=V, act_fn="gelu", normalization_type="LN", seed=seed)
    return tl.TransformerBridge.boot_native(cfg).eval()


def prompts(batch: int):
    g = torch.Generator().manual_seed(batch)
    clean = torch.randint(0, V, (batch, T), generator=g)
    corrupted = clean.clone()
    corrupted[:, T // 4] = (corrupted[:, T // 4] + 7) % V
    return clean, corrupted


def metric(logits):
    return logits[:, -1, 3].mean() - logits[:, -1, 4].mean()


# ---------------------------------------------------------------------------- 2. the residual sweep
def eager_sweep(model, clean, cache):
    return eager_hook_sweep(model, clean, cache, T, metric)


def reactive_sweep(model, clean, corrupt_cache, skip_identical: bool = True, **kw):
    """Build the graph on the clean prompt, then sweep every (resid_pre node, position); ``skip_identical``
    defaults to torch_ext.sweep's own default (True)."""
    import torch_ext

    with torch.no_grad():
        rg = torch_ext.ReactiveGraph(model, (clean,), **kw)
        resid = ["add"] + [rg.nodes(f"blocks.{i}")[-1] for i in range(L - 1)]
        layer_of = {n: i for i, n in enumerate(resid)}

        def patch(v, site):
            v = v.clone()
            v[:, site[1]] = corrupt_cache[layer_of[site[0]]][:, site[1]]
            return v

        r = torch_ext.sweep(rg, [(n, p) for n in resid for p in range(T)], patch, metric, progress=False,
                            skip_identical=skip_identical)
    return {(layer_of[n], p): v for (n, p), v in r.metrics.items()}, rg


# ---------------------------------------------------------------------------- cold: one call per fresh process
def child(spec: dict) -> dict:
    """Runs in a fresh process: sets up, then times the first call of one side."""
    torch.set_num_threads(1)
    global CLOCK
    CLOCK = time.thread_time if spec.get("clock") == "thread" else time.perf_counter
    if spec["part"] == "dynamo_import":  # the floor of a cold trace: torch's tracers import torch._dynamo
        import torch_ext  # noqa: F401  (imports excluded, as in the other children)

        assert "torch._dynamo" not in sys.modules, "torch._dynamo imported before the build"
        t0 = CLOCK()
        importlib.import_module("torch._dynamo")
        return {"wall": CLOCK() - t0}
    batch = spec["batch"]
    clean, corrupted = prompts(batch)
    if spec["part"] == "sweep":
        model = tiny()
        cache = resid_pre_cache(model, corrupted)
        t0 = CLOCK()
        if spec["side"] == "eager":
            res = eager_sweep(model, clean, cache)
            stats = {}
        else:
            res, rg = reactive_sweep(model, clean, cache, skip_identical=spec["side"] == "ours_skip")
            stats = {k: v for k, v in rg.build_stats.items() if k != "fallback_reason"}
        wall = CLOCK() - t0
        return {"wall": wall, "result": [res[k] for k in sorted(res)], "stats": stats}
    import transformer_lens.patching as tl_patching

    from torch_ext import patching

    model = bridge()
    _, cache = model.run_with_cache(clean)
    fn = getattr(tl_patching if spec["side"] == "tl" else patching, spec["fn"])
    t0 = CLOCK()
    out = fn(model, corrupted, cache, metric)
    wall = CLOCK() - t0
    stats = {}
    if spec["side"] != "tl":
        from torch_ext.patching import _GRAPHS

        rg = next(iter(_GRAPHS[model].values()))[0]
        stats = {k: v for k, v in rg.build_stats.items() if k != "fallback_reason"}
    return {"wall": wall, "result": out.flatten().tolist(), "stats": stats}


_CACHE_DIR = None  # a temporary on-disk build cache for the children (never the user's)


class _GcClock:
    """Times one in-process arm from a collected heap, and the cyclic-GC time spent inside it.

    Python's full (generation 2) collection is triggered by the allocations of everything before it: once
    the tracers (make_fx, torch._dynamo, sympy) are imported the heap holds ~250k tracked objects and one
    full pass costs ~0.1 s here, paid by whichever arm happens to cross the threshold. A tracing arm (cache
    off) leaves ~4.6k objects of cyclic garbage (the tracer's closures) and most of the pending count; the
    next arm, a cache hit that allocates almost nothing, then paid that arm's full collection (in one of
    the two timed iterations of ``--repeats 2``: 1.26x instead of 3.15x; the cold arms only shifted which
    arm crossed the threshold). So every arm starts from ``gc.collect()`` (untimed) and keeps the
    collector on: the collections its own allocations trigger stay in its time, and are reported (GC ms,
    full passes) next to it. The price: a tracing arm's amortized share of full passes (in this loop
    about one pass per three or four iterations) is in no arm's time now; before, it was charged to
    whichever arm crossed the threshold."""

    def __init__(self):
        self.gc_s, self.full, self._t = 0.0, 0, None

    def _cb(self, phase, info):
        if phase == "start":
            self._t = CLOCK()
        elif self._t is not None:
            self.gc_s += CLOCK() - self._t
            self.full += info["generation"] == 2
            self._t = None

    def __call__(self, fn, *args, **kw):
        """(fn's result, its wall seconds, the GC seconds and the full collections inside it)."""
        gc.collect()
        self.gc_s, self.full, self._t = 0.0, 0, None
        gc.callbacks.append(self._cb)
        try:
            t0 = CLOCK()
            out = fn(*args, **kw)
            wall = CLOCK() - t0
        finally:
            gc.callbacks.remove(self._cb)
        return out, wall, self.gc_s, self.full


def _gc_note(gcs: dict, full: dict) -> str:
    """Median GC ms inside each arm and its full collections over the timed iterations."""
    return "; GC inside (median ms, full passes): " + ", ".join(
        f"{k} {statistics.median(v[1:]) * 1e3:.1f}/{sum(full[k][1:])}" for k, v in gcs.items())


def cold(spec: dict) -> dict:
    env = dict(os.environ, PYTHONWARNINGS="ignore", TORCH_EXT_CACHE_DIR=_CACHE_DIR)
    if spec["side"] == "ours":
        env["TORCH_EXT_CACHE"] = "0"
    elif spec["side"] in ("ours_disk", "ours_skip"):
        env["TORCH_EXT_CACHE"] = "1"
    spec = {**spec, "clock": "thread" if CLOCK is time.thread_time else "wall"}
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)], capture_output=True,
                       text=True, env=env, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"child {spec} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def cold_pair(base: dict, sides: tuple, repeats: int):
    """Interleaved fresh-process runs of every side; medians of the walls, the last results and stats.
    A side "ours_disk" is run once first, untimed, to fill the on-disk cache it then hits."""
    walls = {s: [] for s in sides}
    last = {}
    if repeats and "ours_disk" in sides:
        primed = cold({**base, "side": "ours_disk"})
        check(primed["stats"]["disk_cache"] in ("stored", "hit"), f"{base}: disk cache not filled: {primed['stats']}")
    for _ in range(repeats):
        for s in sides:
            r = cold({**base, "side": s})
            walls[s].append(r["wall"])
            last[s] = r
    return {s: statistics.median(w) for s, w in walls.items() if w}, last


def fmt_split(st: dict) -> str:
    return (f"trace {st['trace_s'] * 1e3:7.1f}  import {st['import_s'] * 1e3:6.1f}  bind {st['bind_s'] * 1e3:5.1f}  "
            f"other {st['other_s'] * 1e3:5.1f}  first run {st['first_run_s'] * 1e3:5.1f} ms")


# ---------------------------------------------------------------------------- parts
def part_split(repeats: int) -> None:
    import torch_ext

    header("1. Build time split per front end (cache off), medians of interleaved repeats")
    for name, make in (("TinyTransformer", tiny), ("TransformerBridge", bridge)):
        model = make()
        for batch in (1, 8):
            clean, _ = prompts(batch)
            runs = {"export": [], "make_fx": []}
            for _ in range(repeats + 1):  # the first round warms the tracers
                for fe in runs:
                    with _TracerClock() as tracer:
                        t0 = CLOCK()
                        rg = torch_ext.ReactiveGraph(model, (clean,), front_end=fe, cache=False)
                        total = CLOCK() - t0
                    runs[fe].append((total, rg.build_stats, tracer.s))
            with torch.no_grad():
                check(torch.equal(rg.demand(), model(clean)), f"{name} b{batch}: graph output equals the model's")
            for fe, rs in runs.items():
                floor = statistics.median(r[2] for r in rs[1:])
                rs = sorted(rs[1:], key=lambda r: r[0])
                total, st, _ = rs[len(rs) // 2]
                print(f"  {name:17s} batch {batch}  {fe:8s} total {total * 1e3:7.1f} ms (torch's tracer {floor * 1e3:6.1f}, "
                      f"the rest {(total - floor) * 1e3:5.1f}): {fmt_split(st)}")


def part_sweep(repeats: int, cold_repeats: int) -> None:
    header(f"2. Issue 10: one {L * T}-site residual sweep of a {L}-layer d_model {D} TinyTransformer, building included")
    for batch in (1, 8):
        base = {"part": "sweep", "batch": batch}
        walls, last = cold_pair(base, ("eager", "ours", "ours_disk", "ours_skip"), cold_repeats)
        if cold_repeats:
            for side in ("ours", "ours_disk", "ours_skip"):
                diff = max(abs(a - b) for a, b in zip(last["eager"]["result"], last[side]["result"]))
                check(diff <= 1e-4, f"sweep b{batch} cold {side}: reactive vs eager max |diff| {diff:.2e}")
            check(last["ours"]["result"] == last["ours_disk"]["result"], f"sweep b{batch}: disk hit equals a cold build")
            check(last["ours_disk"]["stats"]["disk_cache"] == "hit", f"sweep b{batch}: {last['ours_disk']['stats']}")
            r = walls["eager"] / walls["ours"]
            dynamo = statistics.median(cold({"part": "dynamo_import", "side": "floor"})["wall"] for _ in range(cold_repeats))
            print(f"  batch {batch} cold (fresh process each), disk cache off, skip_identical=False: eager {walls['eager']:.3f} s, ours "
                  f"{walls['ours']:.3f} s ({fmt_split(last['ours']['stats'])}, front end "
                  f"{last['ours']['stats']['front_end']}) -> {r:.2f}x [target >= 2x: {target(r >= 2, f'sweep b{batch} cold >= 2x')}]; "
                  f"floor: torch's tracers import torch._dynamo, {dynamo:.3f} s in a fresh process: ceiling eager / "
                  f"(that + the disk-hit arm) {walls['eager'] / (dynamo + walls['ours_disk']):.2f}x")
            r = walls["eager"] / walls["ours_disk"]
            print(f"  batch {batch} cold (fresh process each), disk cache HIT, skip_identical=False: eager {walls['eager']:.3f} s, ours "
                  f"{walls['ours_disk']:.3f} s ({fmt_split(last['ours_disk']['stats'])}) -> {r:.2f}x "
                  f"[target >= 2x: {target(r >= 2, f'sweep b{batch} cold disk hit >= 2x')}]")
            check(last["ours_skip"]["result"] == last["ours_disk"]["result"], f"sweep b{batch}: skip_identical equals")
            r = walls["eager"] / walls["ours_skip"]
            print(f"  batch {batch} cold, disk cache HIT, sweep's default skip_identical=True (sites whose patch is "
                  f"bit-identical to the clean value take the clean outputs): {walls['ours_skip']:.3f} s -> "
                  f"{r:.2f}x [target >= 2x: {target(r >= 2, f'sweep b{batch} cold disk hit skip_identical >= 2x')}]")

        clean, corrupted = prompts(batch)
        model = tiny()
        cache = resid_pre_cache(model, corrupted)
        others = [tiny(seed=s + 1) for s in range(repeats + 1)]
        res, times, tracer = {}, {"eager": [], "nocache": [], "hit": []}, []
        gcs, full = {k: [] for k in times}, {k: [] for k in times}
        clock, rg = _GcClock(), None

        def arm(name, fn, *args, **kw):
            out, wall, g, f = clock(fn, *args, **kw)
            times[name].append(wall)
            gcs[name].append(g)
            full[name].append(f)
            return out

        for i in range(repeats + 1):
            res["eager"] = arm("eager", eager_sweep, model, clean, cache)
            rg = None  # the previous arm's graph is not freed inside the next arm's timer
            with _TracerClock() as tc:
                res["nocache"], rg = arm("nocache", reactive_sweep, model, clean, cache, cache=False)
            tracer.append(tc.s)
            check(rg.build_stats["cache"] == "off", "no-cache arm did not use the cache")
            other = others[i]
            other_cache = resid_pre_cache(other, corrupted)
            rg = None
            res["hit"], rg = arm("hit", reactive_sweep, other, clean, other_cache)
            if i > 0:
                check(rg.build_stats["cache"] == "hit", f"cache-hit arm: {rg.build_stats['cache']}")
        ref_other = eager_sweep(others[-1], clean, resid_pre_cache(others[-1], corrupted))
        for k, ref in (("nocache", res["eager"]), ("hit", ref_other)):
            diff = max(abs(ref[s] - res[k][s]) for s in ref)
            check(diff <= 1e-4, f"sweep b{batch} {k}: reactive vs eager max |diff| {diff:.2e}")
        med = {k: statistics.median(v[1:]) for k, v in times.items()}
        r1, r2 = med["eager"] / med["nocache"], med["eager"] / med["hit"]
        floor = statistics.median(tracer[1:])
        print(f"  batch {batch} in-process, the sweep's default skip_identical=True: eager {med['eager']:.3f} s; "
              f"ours, built again (cache off) {med['nocache']:.3f} s (torch's tracer {floor:.3f} s; ceiling eager / "
              f"(tracer + cache-hit arm) {med['eager'] / (floor + med['hit']):.2f}x) "
              f"-> {r1:.2f}x [{target(r1 >= 2, f'sweep b{batch} rebuilt >= 2x')}]; ours, fresh model object (cache HIT) "
              f"{med['hit']:.3f} s -> {r2:.2f}x [{target(r2 >= 2, f'sweep b{batch} cache hit >= 2x')}]"
              + _gc_note(gcs, full))


def part_patching(repeats: int, cold_repeats: int) -> None:
    import transformer_lens.patching as tl_patching

    from torch_ext import patching

    header(f"3. Issue 12: torch_ext.patching vs transformer_lens.patching on a TransformerBridge "
           f"(L={L}, d_model={D}, seq {T}), building included")
    goals = {"get_act_patch_resid_pre": 3, "get_act_patch_attn_head_out_by_pos": 5}
    model = bridge()
    for batch in (1, 8):
        clean, corrupted = prompts(batch)
        _, cache = model.run_with_cache(clean)
        for fn, goal in goals.items():
            base = {"part": "patching", "batch": batch, "fn": fn}
            walls, last = cold_pair(base, ("tl", "ours", "ours_disk"), cold_repeats)
            print(f"  {fn} batch {batch}")
            if cold_repeats:
                check(last["ours_disk"]["stats"]["disk_cache"] == "hit",
                      f"{fn} b{batch}: disk-cache arm did not hit: {last['ours_disk']['stats']}")
                for side, what in (("ours", "disk cache off"), ("ours_disk", "disk cache HIT")):
                    diff = max(abs(a - b) for a, b in zip(last["tl"]["result"], last[side]["result"]))
                    check(diff == 0, f"{fn} b{batch} cold {side}: max |ours - TL| {diff:.2e}")
                    r = walls["tl"] / walls[side]
                    print(f"    cold (fresh process each), {what}: TL {walls['tl']:.3f} s, ours {walls[side]:.3f} s "
                          f"({fmt_split(last[side]['stats'])}, disk {last[side]['stats'].get('disk_cache')}) -> {r:.2f}x "
                          f"[target >= {goal}x: {target(r >= goal, f'{fn} b{batch} cold {what} >= {goal}x')}]")
            times = {"tl": [], "nocache": [], "hit": [], "warm": []}
            gcs, full = {k: [] for k in times}, {k: [] for k in times}
            clock = _GcClock()

            def arm(name, *args):
                out, wall, g, f = clock(getattr(tl_patching if name == "tl" else patching, fn), *args)
                times[name].append(wall)
                gcs[name].append(g)
                full[name].append(f)
                return out

            for i in range(repeats + 1):
                ref = arm("tl", model, corrupted, cache, metric)
                fresh = copy.deepcopy(model)
                os.environ["TORCH_EXT_BUILD_CACHE"] = "0"
                try:
                    a = arm("nocache", fresh, corrupted, cache, metric)
                finally:
                    del os.environ["TORCH_EXT_BUILD_CACHE"]
                fresh = copy.deepcopy(model)
                b = arm("hit", fresh, corrupted, cache, metric)
                hit = next(iter(patching._GRAPHS[fresh].values()))[0].build_stats["cache"]
                if i > 0:
                    check(hit == "hit", f"{fn} b{batch} cache-hit arm: {hit}")
                c = arm("warm", fresh, corrupted, cache, metric)
                for what, x in (("no cache", a), ("cache hit", b), ("warm", c)):
                    check(torch.equal(x, ref), f"{fn} b{batch} {what}: equals TransformerLens")
            med = {k: statistics.median(v[1:]) for k, v in times.items()}
            ratios = {k: med["tl"] / med[k] for k in ("nocache", "hit", "warm")}
            print(f"    in-process: TL {med['tl']:.3f} s; ours built again (cache off) {med['nocache']:.3f} s -> "
                  f"{ratios['nocache']:.2f}x [{target(ratios['nocache'] >= goal, f'{fn} b{batch} rebuilt >= {goal}x')}]; "
                  f"fresh model object (cache HIT) {med['hit']:.3f} s -> {ratios['hit']:.2f}x "
                  f"[{target(ratios['hit'] >= goal, f'{fn} b{batch} cache hit >= {goal}x')}]; warm (graph reused) "
                  f"{med['warm']:.3f} s -> {ratios['warm']:.2f}x" + _gc_note(gcs, full))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cold-repeats", type=int, default=2)
    ap.add_argument("--parts", nargs="+", default=["split", "sweep", "patching"])
    ap.add_argument("--no-cold", action="store_true", help="skip the fresh-process (cold) measurements")
    ap.add_argument("--clock", choices=["wall", "thread"], default="wall",
                    help="what the arms time: wall clock, or this thread's CPU time (a shared, loaded machine)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    torch.set_num_threads(1)
    global _CACHE_DIR, CLOCK
    CLOCK = time.thread_time if args.clock == "thread" else time.perf_counter
    import tempfile

    tmp = tempfile.TemporaryDirectory(prefix="bench_build_cache_")
    _CACHE_DIR = tmp.name
    os.environ["TORCH_EXT_CACHE_DIR"] = _CACHE_DIR  # this process's builds too: never the user's cache
    t0 = time.perf_counter()
    print(f"load: {os.getloadavg()}; clock: {args.clock}")
    if "split" in args.parts:
        part_split(args.repeats)
    if "sweep" in args.parts:
        part_sweep(args.repeats, 0 if args.no_cold else args.cold_repeats)
    if "patching" in args.parts:
        part_patching(args.repeats, 0 if args.no_cold else args.cold_repeats)
    print(f"load: {os.getloadavg()}")
    return summary(t0)


if __name__ == "__main__":
    sys.exit(main())
