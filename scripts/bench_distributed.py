"""torch.distributed benchmarks (gloo, CPU, 2 ranks on this machine), in one run:

1. The data-parallel pure step against eager DistributedDataParallel: steps/s of eager DDP, of the
   pure DDP step on the executor and on the planned arena (compile()), on a stack of MLP blocks with
   AdamW; and, from the profiler, the fraction of all-reduce time hidden under compute (the time a
   gloo all-reduce is in flight while the rank's own thread runs an op other than a wait or an
   optimizer update, i.e. backward compute), for the pure step and for eager DDP.
2. Sharded sweeps: wall-clock of a 2-rank sweep against 1 rank.

    python scripts/bench_distributed.py [--d-model 384 --layers 8 --seq 32 --batch 4]
                                        [--ddp-d 256 --ddp-layers 6 --ddp-steps 30] [--only-ddp | --only-sweep]

Every rank builds the same ReactiveGraph and calls sweep(..., distributed=True); the sites are split
by predicted cone cost. Prints the single-process sweep time, the sharded sweep time (the slowest
rank, graph building excluded, since every rank builds in parallel), the speedup against the ideal
2x (target >= 1.7x on a sweep of at least 5 s), the per-rank share, and checks that the tables are
equal. One thread per rank; on a 2-core machine the 2 ranks use both cores.
"""
from __future__ import annotations

import argparse
import os
import pickle
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import torch_ext


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        return x + self.mlp(self.ln(x))


class Model(nn.Module):
    def __init__(self, d, layers):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def patch(v, site):
    out = v.clone()
    out[:, site[1]] = 0
    return out


def metric(out):
    return out[:, -1].sum()


def run(rank, world, args, init_file, out_dir):
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(1)
    x = torch.randn(args.batch, args.seq, args.d_model)
    rg = torch_ext.ReactiveGraph(Model(args.d_model, args.layers).eval(), (x,))
    sites = [(n, p) for n in rg.nodes("add*") for p in range(args.seq)]
    if world > 1:
        dist.barrier()  # a common start: the sweep returns on rank 0 after the slowest rank's share is gathered
    t0 = time.perf_counter()
    result = torch_ext.sweep(rg, sites, patch, metric, progress=False, distributed=world > 1)
    wall = time.perf_counter() - t0
    if rank == 0:
        with open(os.path.join(out_dir, f"world{world}.pkl"), "wb") as f:
            pickle.dump((result.metrics, wall, result.extra, len(sites)), f)
    if world > 1:
        dist.destroy_process_group()


# ---------------------------------------------------------------- data-parallel pure step vs eager DDP
def _union(intervals):
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _intersect(xs, ys) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, hi - lo)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def hidden_fraction(events, main_thread) -> tuple[float, float]:
    """(all-reduce in-flight ms, fraction of it during which the main thread runs compute)."""
    comm = _union([(e.time_range.start, e.time_range.end) for e in events if e.name.startswith("gloo:all_reduce")])

    def is_compute(e):
        n = e.name
        return (e.thread == main_thread and "c10d" not in n and "wait" not in n and "gloo" not in n
                and not n.startswith("torch_ext::") and "ProfilerStep" not in n and not n.startswith("Optimizer.")
                and "DistributedDataParallel" not in n and n.startswith(("aten::", "autograd::")))

    compute = _union([(e.time_range.start, e.time_range.end) for e in events if is_compute(e)])
    total = _length(comm)
    return total / 1e3, (_intersect(comm, compute) / total if total else float("nan"))


def ddp_run(rank, world, args, init_file, out_dir):
    import copy
    import threading

    import torch.nn.functional as F

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = Model(args.ddp_d, args.ddp_layers)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(8, 32, args.ddp_d, generator=g), torch.randn(8, 32, args.ddp_d, generator=g)
    loss_fn = lambda m, x, y: F.mse_loss(m(x), y)  # noqa: E731
    ref = copy.deepcopy(model)
    ddp = torch.nn.parallel.DistributedDataParallel(ref)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)

    def eager():
        opt.zero_grad()
        loss_fn(ddp, x, y).backward()
        opt.step()

    step = torch_ext.make_train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn, (x, y),
                                     process_group=dist.group.WORLD)
    planned = step.compile(donate=True)
    states = {"executor": step.init_state(), "arena": step.init_state()}

    def pure(kind):
        def call():
            runner = step if kind == "executor" else planned
            states[kind] = runner(states[kind], x, y)[1]
        return call

    runs = {"eager DDP": eager, "pure DDP step, executor": pure("executor"), "pure DDP step, arena": pure("arena")}
    results = {}
    for name, fn in runs.items():
        for _ in range(3):
            fn()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.ddp_steps):
            fn()
        dist.barrier()
        results[name] = args.ddp_steps / (time.perf_counter() - t0)
    overlap = {}
    main_thread = threading.get_native_id()
    for name in ("eager DDP", "pure DDP step, executor", "pure DDP step, arena"):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                runs[name]()
        events = prof.events()
        tid = next((e.thread for e in events if e.name.startswith("aten::") and e.thread == main_thread),
                   max({e.thread for e in events}, key=lambda t: sum(1 for e in events if e.thread == t)))
        overlap[name] = hidden_fraction(events, tid)
    if rank == 0:
        with open(os.path.join(out_dir, "ddp.pkl"), "wb") as f:
            pickle.dump((results, overlap, sum(p.numel() for p in model.parameters())), f)
    dist.destroy_process_group()


def bench_ddp(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(ddp_run, args=(2, args, os.path.join(tmp, "init_ddp"), tmp), nprocs=2, join=True,
                           start_method="spawn")
        with open(os.path.join(tmp, "ddp.pkl"), "rb") as f:
            results, overlap, n_params = pickle.load(f)
    print(f"data-parallel step, 2 gloo ranks, one thread each: {args.ddp_layers} MLP blocks d {args.ddp_d} "
          f"({n_params / 1e6:.2f} M params), batch 8x32 per rank, AdamW, {args.ddp_steps} timed steps")
    base = results["eager DDP"]
    for name, sps in results.items():
        ms, hidden = overlap[name]
        print(f"  {name:<24} {sps:7.2f} steps/s  ({sps / base:.2f}x eager DDP); all-reduce in flight "
              f"{ms / 5:.1f} ms/step, {100 * hidden:.0f}% of it hidden under compute")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d-model", type=int, default=384)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--ddp-d", type=int, default=256)
    ap.add_argument("--ddp-layers", type=int, default=6)
    ap.add_argument("--ddp-steps", type=int, default=30)
    ap.add_argument("--only-ddp", action="store_true")
    ap.add_argument("--only-sweep", action="store_true")
    args = ap.parse_args()
    if not args.only_sweep:
        bench_ddp(args)
    if args.only_ddp:
        return
    with tempfile.TemporaryDirectory() as tmp:
        for world in (1, 2):
            mp.start_processes(run, args=(world, args, os.path.join(tmp, f"init{world}"), tmp), nprocs=world,
                               join=True, start_method="spawn")
        with open(os.path.join(tmp, "world1.pkl"), "rb") as f:
            m1, t1, _, n = pickle.load(f)
        with open(os.path.join(tmp, "world2.pkl"), "rb") as f:
            m2, t2, extra, _ = pickle.load(f)
    print(f"residual stream x position sweep: {n} sites, d_model {args.d_model}, {args.layers} blocks, "
          f"seq {args.seq}, batch {args.batch}; one thread per rank")
    print(f"  1 rank : {t1:.2f} s")
    print(f"  2 ranks: {t2:.2f} s (slowest rank; per-rank sweep times "
          f"{', '.join(f'{w:.2f}' for w in extra['rank_wall_times'])} s, sites {extra['rank_sites']})")
    ok = t1 / t2 >= 1.7
    print(f"  speedup {t1 / t2:.2f}x of the ideal 2x [target >= 1.7x on a sweep >= 5 s: "
          f"{'met' if ok and t1 >= 5 else 'MISSED' if t1 >= 5 else 'sweep under 5 s'}]")
    print(f"  tables equal: {m1 == m2}")


if __name__ == "__main__":
    main()
