#!/usr/bin/env python
"""Where the token-granular sweep's time goes, op by op, against the eager-hook sweep (issue 11), and
the bound on their wall ratio that the GEMM rates set.

    python scripts/profile_positions_site.py [--vocab 500 4096] [--batch 1 8] [--repeats 5]

For each configuration of bench_sweep.py's part 4 (4-layer d_model 128 TinyTransformer, T = 16, the
residual stream entering each block x position: 64 sites, metric = last-position logit difference):

1. torch.profiler over one whole sweep of each arm (eager hooks, token-granular one site at a time,
   token-granular batch_sites=8, node-granular): ATen calls per site and self CPU time per site by op,
   the profiler's own FLOP count of the matrix products (addmm, mm, bmm), and the GEMM rate (those
   FLOPs over their self time). The profiler adds a fixed cost to every call, so its times are shares,
   not wall times.
2. Wall times (medians of interleaved repeats, no profiler) and the bound. With F the engine's FLOP
   count of what ran (its cost model) and r = F / wall each arm's FLOP rate,
       wall_eager / wall_token = rho_flops x r_token / r_eager        (an identity)
   so >= 10x needs r_token >= 10 / rho_flops x r_eager. The GEMM-only bound is
       wall_eager / wall_token <= wall_eager / gemm_time_token
   (a token sweep cannot take less than its own matrix products, even with every other cost gone);
   gemm_time_token comes from the profiler's share of GEMM self time applied to the wall time (an
   estimate that leaves the profiler's per-call cost out of the share) and, independently, from timing
   each GEMM shape the sweep runs on its own (the 'replayed' time: at::addmm / mm / bmm on the same
   shapes, no engine, no profiler).
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import torch_ext  # noqa: E402

from _bench_util import eager_hook_sweep, resid_pre_cache  # noqa: E402
from bench_sweep import GROUP, full_forward_cost, metric, positions_setup, resid_pos_sites  # noqa: E402

GEMMS = ("aten::addmm", "aten::mm", "aten::bmm")
SDPA = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math")


def profile(fn):
    """(calls, self_us, flops, shapes) per ATen op name over one call of fn."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_flops=True,
                                record_shapes=True) as prof:
        fn()
    calls, self_us, flops = collections.Counter(), collections.Counter(), collections.Counter()
    shapes = collections.Counter()
    for ev in prof.events():
        if not ev.name.startswith("aten::"):
            continue
        calls[ev.name] += 1
        self_us[ev.name] += ev.self_cpu_time_total
        flops[ev.name] += ev.flops or 0
        if ev.name in GEMMS:
            shapes[(ev.name, tuple(tuple(s) for s in ev.input_shapes if s))] += 1
    return calls, self_us, flops, shapes


def replay(shapes, repeats: int = 20) -> float:
    """Seconds the GEMMs of `shapes` take run alone (median of repeats): the same ops on the same shapes."""
    jobs = []
    for (name, ins), count in shapes.items():
        if name == "aten::addmm":
            b, x, w = (torch.randn(s) for s in ins[:3])
            jobs.append((lambda b=b, x=x, w=w: torch.addmm(b, x, w), count))
        elif name == "aten::mm":
            x, w = (torch.randn(s) for s in ins[:2])
            jobs.append((lambda x=x, w=w: torch.mm(x, w), count))
        else:
            x, w = (torch.randn(s) for s in ins[:2])
            jobs.append((lambda x=x, w=w: torch.bmm(x, w), count))
    per = []
    for fn, count in jobs:
        fn()
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(count):
                fn()
            ts.append(time.perf_counter() - t0)
        per.append(statistics.median(ts))
    return sum(per)


def row_fraction(L: int, T: int) -> float:
    """Rows an exact token-granular sweep must compute of each block op (norms, projections, MLP, attention),
    summed over the L x T resid_pre sites with the last row read, over the rows one full forward per site
    computes (L x T x L x T). Site (l, p), n = T - p: the norm and qkv of layer l run row p; its attention
    and everything after it n rows; layers l+1 .. L-2 n rows; layer L-1 (l < L-1) its norm and qkv n rows
    (keys and values) and the rest the read row alone. The qkv side and the rest come to the same fraction,
    so how the ops of a layer weigh against each other does not change it."""
    rows = 0
    for l in range(L):
        for p in range(T):
            n = T - p
            if l == L - 1:
                rows += 2 * 1  # qkv side (row p) and the rest (row T-1), in units of half a layer
                continue
            rows += 1 + n                # layer l: qkv side row p, the rest n rows
            rows += 2 * n * (L - 2 - l)  # layers l+1 .. L-2
            rows += n + 1                # layer L-1: keys/values n rows, the rest the read row
    return rows / (2 * L * T * L * T)


def eager_parts(model, clean, repeats: int = 40) -> tuple[float, float]:
    """(seconds of one eager forward, seconds of its blocks alone), medians: what the blocks cost in eager."""
    x0 = model.tok(clean) + model.pos[: clean.shape[1]]

    def blocks():
        x = x0
        for blk in model.blocks:
            x = blk(x)
        return x

    fns = (lambda: model(clean), blocks)
    ts = [[], []]
    with torch.no_grad():
        for fn in fns:
            fn()
        for _ in range(repeats):  # interleaved, so both see the same load
            for i, fn in enumerate(fns):
                t0 = time.perf_counter()
                fn()
                ts[i].append(time.perf_counter() - t0)
    return statistics.median(ts[0]), statistics.median(ts[1])


def case(V: int, B: int, repeats: int) -> None:
    model, clean, corrupt = positions_setup(V, B)
    T, L = clean.shape[1], len(model.blocks)
    cache = resid_pre_cache(model, corrupt)
    rg = torch_ext.ReactiveGraph(model, (clean,))
    resid = ["add"] + [rg.nodes(f"blocks.{i}")[-1] for i in range(L - 1)]
    sites, patch = resid_pos_sites(cache, resid, T)
    reads = {"logits": (slice(None), -1, [3, 5])}
    S = len(sites)
    res = {}
    arms = {
        "eager": lambda: res.__setitem__("eager", eager_hook_sweep(model, clean, cache, T, metric)),
        "token": lambda: res.__setitem__("token", torch_ext.sweep(rg, sites, patch, metric, progress=False,
                                                                  reads=reads)),
        "token_b8": lambda: res.__setitem__("token_b8", torch_ext.sweep(rg, sites, patch, metric, progress=False,
                                                                        reads=reads, batch_sites=GROUP)),
        "token_dp": lambda: res.__setitem__("token_dp", torch_ext.sweep(rg, sites, patch, metric, progress=False,
                                                                        reads=reads, batch_sites=True)),
        "node": lambda: res.__setitem__("node", torch_ext.sweep(rg, sites, patch, metric, progress=False,
                                                                positions=False)),
    }
    for fn in arms.values():
        fn()  # warm-up (builds the batched cones)
    full = full_forward_cost(rg)
    flops = {"eager": S * full, "token": res["token"].cost, "token_b8": res["token_b8"].cost,
             "token_dp": res["token_dp"].cost,
             "node": res["node"].cost}
    times = {k: [] for k in arms}
    with torch.no_grad():
        for _ in range(repeats):
            for k, fn in arms.items():
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
    wall = {k: statistics.median(v) for k, v in times.items()}
    prof = {k: profile(fn) for k, fn in arms.items()}
    print(f"\n[vocab={V} batch={B}] {S} sites; load {os.getloadavg()[0]:.2f}; wall medians of {repeats}")
    print(f"  {'arm':9s} {'wall ms':>8s} {'GFLOP':>7s} {'GFLOP/s':>8s} {'ATen/site':>9s} {'GEMM/site':>9s} "
          f"{'GEMM share':>10s} {'GEMM GFLOP/s':>12s} {'replayed GEMM ms':>16s}")
    gemm_time = {}
    for k in arms:
        calls, self_us, fl, shapes = prof[k]
        tot_us = sum(self_us.values())
        g_us = sum(self_us[n] for n in GEMMS)
        g_fl = sum(fl[n] for n in GEMMS)
        share = g_us / tot_us
        rep = replay(shapes)
        gemm_time[k] = rep
        print(f"  {k:9s} [{g_fl / 1e9:.3f} GEMM GFLOP by the profiler]")
        print(f"  {k:9s} {wall[k] * 1e3:8.1f} {flops[k] / 1e9:7.3f} {flops[k] / wall[k] / 1e9:8.2f} "
              f"{sum(calls.values()) / S:9.0f} {sum(calls[n] for n in GEMMS) / S:9.1f} {share:10.2f} "
              f"{g_fl / (g_us * 1e-6) / 1e9 if g_us else 0:12.2f} {rep * 1e3:16.1f}")
    for k in ("token", "token_b8", "token_dp"):
        rho = flops["eager"] / flops[k]
        r_ratio = (flops[k] / wall[k]) / (flops["eager"] / wall["eager"])
        print(f"  {k}: rho_flops {rho:.2f} x rate ratio {r_ratio:.2f} = wall ratio {wall['eager'] / wall[k]:.2f}x "
              f"(vs node-granular {wall['node'] / wall[k]:.2f}x); GEMM-only bound: eager wall / {k}'s replayed "
              f"GEMM time = {wall['eager'] / gemm_time[k]:.1f}x; needs rate ratio {10 / rho:.2f} for 10x")
    t_fwd, t_blocks = eager_parts(model, clean)
    f = row_fraction(L, T)
    bound = t_fwd / (f * t_blocks)
    print(f"  row bound: an exact sweep computes a fraction f = {f:.4f} of the block rows of one forward per site; "
          f"eager forward {t_fwd * 1e3:.3f} ms, its blocks {t_blocks * 1e3:.3f} ms ({t_blocks / t_fwd:.1%}); at no "
          f"less than eager's cost per block row: wall vs eager <= {bound:.2f}x, vs node-granular <= "
          f"{wall['node'] / (S * f * t_blocks):.2f}x")
    print(f"  eager GEMMs replayed alone: {gemm_time['eager'] * 1e3:.1f} ms of its {wall['eager'] * 1e3:.1f} ms wall")
    for k in ("token", "token_dp", "eager"):
        calls, self_us, _, _ = prof[k]
        top = sorted(self_us, key=lambda n: -self_us[n])[:14]
        print(f"  {k}: top ops by profiled self CPU time per site (us) and calls per site")
        for n in top:
            print(f"    {n:52s} {self_us[n] / S:8.1f} us {calls[n] / S:7.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, nargs="+", default=[500, 4096])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    for V in args.vocab:
        for B in args.batch:
            case(V, B, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
