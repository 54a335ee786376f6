"""Reproduction (no torch_ext involved): on gloo, a _c10d_functional all_gather_into_tensor that runs
while another collective is in flight corrupts the heap (torch 2.9.1: "malloc(): unaligned tcache
chunk detected", SIGABRT or SIGSEGV in some of the runs). This is why csrc/passes/serialize_collectives
keeps every all-gather alone in the pure step.

    python scripts/repro_gloo_all_gather.py --mode overlap   # gathers issued together, waited later: crashes
    python scripts/repro_gloo_all_gather.py --mode mixed     # one gather at a time, all-reduces in flight: crashes
    python scripts/repro_gloo_all_gather.py --mode alone     # each gather waited before the next collective: clean
    python scripts/repro_gloo_all_gather.py --mode reduce    # all-reduces and broadcasts in flight together: clean

Each run spawns 2 gloo ranks that do --iters rounds of 12 collectives (the sizes of the ZeRO-1 shards
of the test suite's transformer block) and check every gathered value; it prints how many runs failed.
"""
from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = [16, 16, 1536, 48, 512, 16, 16, 16, 2048, 64, 2048, 16]


def _rank(rank: int, world: int, init: str, mode: str, iters: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    c10d = torch.ops._c10d_functional
    name = dist.group.WORLD.group_name
    try:
        for it in range(iters):
            ins = [torch.full((s,), float(rank + it)) for s in SIZES]
            pending = []  # collectives in flight (waited at the end of the round)
            if mode == "overlap":
                outs = [c10d.all_gather_into_tensor(x, world, name) for x in ins]
                churn = [torch.randn(i % 50 + 1) for i in range(50)]  # malloc traffic while gloo runs
                outs = [c10d.wait_tensor(o) for o in outs]
            elif mode == "mixed":
                outs = []
                for x in ins:
                    pending.append(c10d.all_reduce(torch.randn(2 * x.numel()), "sum", name))
                    out = c10d.all_gather_into_tensor(x, world, name)
                    churn = [torch.randn(i % 50 + 1) for i in range(50)]
                    outs.append(c10d.wait_tensor(out))
            elif mode == "alone":
                outs = []
                for x in ins:
                    out = c10d.all_gather_into_tensor(x, world, name)
                    churn = [torch.randn(i % 50 + 1) for i in range(50)]
                    outs.append(c10d.wait_tensor(out))
            else:  # reduce: no gathers; all-reduces and broadcasts overlap
                for x in ins:
                    pending.append(c10d.all_reduce(torch.randn(2 * x.numel()), "sum", name))
                    pending.append(c10d.broadcast(torch.randn(2 * x.numel()), 0, name))
                churn = [torch.randn(i % 50 + 1) for i in range(50)]
                outs = [torch.cat([x * 0 + it, x * 0 + it + 1]) for x in ins]
            del churn
            for p in pending:
                c10d.wait_tensor(p)
            for o, s in zip(outs, SIZES):
                assert o[:s].eq(float(it)).all() and o[s:].eq(float(it + 1)).all(), f"round {it}: a wrong gathered value"
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["overlap", "mixed", "alone", "reduce"], default="overlap")
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--iters", type=int, default=300)
    args = ap.parse_args()
    failed = 0
    for i in range(args.runs):
        init = os.path.join(tempfile.mkdtemp(prefix="gloo_ag_"), "init")
        try:
            mp.start_processes(_rank, args=(2, init, args.mode, args.iters), nprocs=2, start_method="spawn")
            print(f"run {i}: ok", flush=True)
        except Exception as e:  # a rank that aborts surfaces here as ProcessExitedException
            failed += 1
            print(f"run {i}: FAILED ({type(e).__name__}: {str(e).splitlines()[0][:200]})", flush=True)
    print(f"torch {torch.__version__}, mode {args.mode}: {failed} of {args.runs} runs failed")


if __name__ == "__main__":
    main()
