"""Sharded sweeps on torch.distributed (gloo, CPU): wall-clock of a 2-rank sweep against 1 rank.

    python scripts/bench_distributed.py [--d-model 384 --layers 8 --seq 32 --batch 4]

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
    t0 = time.perf_counter()
    result = torch_ext.sweep(rg, sites, patch, metric, progress=False, distributed=world > 1)
    wall = time.perf_counter() - t0
    if rank == 0:
        with open(os.path.join(out_dir, f"world{world}.pkl"), "wb") as f:
            pickle.dump((result.metrics, wall, result.extra, len(sites)), f)
    if world > 1:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d-model", type=int, default=384)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()
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
