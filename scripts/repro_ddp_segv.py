"""Loops the 2-rank gloo data-parallel test worker (tests/python/test_distributed.py::_worker: pure DDP
and ZeRO-1 steps through the executor and the arena executor, 50 steps each, then compared with
eager DDP) and counts the runs in which a rank died of a signal, failed, or returned results that
differ from eager DDP.

    python scripts/repro_ddp_segv.py --runs 50 --kind cnn_bn [--out /tmp/segv]

Each run gets its own folder under --out; the ranks run there with core dumps enabled (a core lands
there as `core` when /proc/sys/kernel/core_pattern is a plain name) and write their faulthandler
output to rank<r>.err. Run two of these at once, or next to a busy loop, to load the machine: the
crash that motivated this script (rank 1 SIGSEGV inside the executor's run) came on a loaded machine.
For a C++ backtrace: gdb -batch -ex bt <python> <run folder>/core (done for you: backtrace.txt).

What the one crash showed (full suite, 2026-12-06): faulthandler listed the main thread inside
`program._executor.run` and the tqdm monitor, neither as "Current thread", so the fault was on a
thread Python does not know: a gloo worker or transport thread (the ranks run one intra-op thread),
not the executor's. Looped on a loaded 2-core machine (load 9-20), segv53: 63 runs of the test's
worker, 38 runs of --steps-only --steps 1000, no failure; see the helper's report.
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time

import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
import test_distributed as td  # noqa: E402


def _steps_only_worker(rank, world, out_dir, kind, steps):
    """The pure DDP step through the executor only, no eager reference: more collectives per second."""
    import torch
    import torch.distributed as dist
    import torch_ext
    from torch_ext.distributed import assert_states_in_sync
    torch.set_num_threads(1)
    model, loss_fn, batches = td._setup(kind, rank, 4)
    step = torch_ext.make_train_step(model, td._adamw(model.parameters()), loss_fn, batches[0],
                                     process_group=dist.group.WORLD)
    state = step.init_state()
    for i in range(steps):
        loss, state = step(state, *batches[i % len(batches)])
    assert_states_in_sync(state)
    return None


def _rank(rank: int, world: int, run_dir: str, kind: str, steps: int, steps_only: bool) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    os.chdir(run_dir)
    err = open(os.path.join(run_dir, f"rank{rank}.err"), "w")
    os.dup2(err.fileno(), 2)
    worker = _steps_only_worker if steps_only else td._worker
    td._on_rank(rank, world, os.path.join(run_dir, "init"), run_dir, worker, kind, steps)


def _backtrace(run_dir: str) -> str:
    """gdb's backtrace of every thread of a core left in `run_dir`, saved beside it ('' without a core)."""
    import glob
    import shutil
    import subprocess
    cores = glob.glob(os.path.join(run_dir, "core*"))
    if not cores or shutil.which("gdb") is None:
        return ""
    out = os.path.join(run_dir, "backtrace.txt")
    with open(out, "w") as f:
        subprocess.run(["gdb", "-batch", "-ex", "thread apply all bt 30", sys.executable, cores[0]],
                       stdout=f, stderr=subprocess.STDOUT, timeout=600)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--kind", choices=["cnn_bn", "transformer"], default="cnn_bn")
    ap.add_argument("--steps", type=int, default=td.STEPS)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--steps-only", action="store_true",
                    help="run only the pure DDP step through the executor (--steps calls), no eager DDP or comparison")
    ap.add_argument("--out", default=None, help="folder for the runs (default: a new temporary one)")
    args = ap.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="repro_ddp_segv_")
    os.makedirs(out, exist_ok=True)
    bad = 0
    for i in range(args.runs):
        run_dir = os.path.join(out, f"run{i:03d}")
        os.makedirs(run_dir, exist_ok=True)
        t0 = time.monotonic()
        ctx = mp.start_processes(_rank, args=(td.WORLD, run_dir, args.kind, args.steps, args.steps_only), nprocs=td.WORLD,
                                 join=False, start_method="spawn")
        deadline = t0 + args.timeout
        while not all(not p.is_alive() for p in ctx.processes) and time.monotonic() < deadline:
            time.sleep(0.2)
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join()
        codes = [p.exitcode for p in ctx.processes]
        verdict = "ok"
        if any(c != 0 for c in codes):
            verdict = "DIED " + " ".join(f"rank{r}={c}" for r, c in enumerate(codes))
        elif not args.steps_only:
            import pickle
            for r in range(td.WORLD):
                with open(os.path.join(run_dir, f"rank{r}.pkl"), "rb") as f:
                    res = pickle.load(f)
                diffs = {f"{name}:{what}": d for name in ("ddp", "ddp-arena", "zero1", "zero1-arena")
                         for what, d in res[name].items() if d != 0.0}
                if res["zero1:write_back"] != 0.0:
                    diffs["zero1:write_back"] = res["zero1:write_back"]
                if diffs:
                    verdict = f"WRONG rank{r} {diffs}"
        if verdict.startswith("DIED"):
            bt = _backtrace(run_dir)
            if bt:
                verdict += f", backtrace in {bt}"
        bad += verdict != "ok"
        print(f"run {i:3d} {time.monotonic() - t0:6.1f} s {verdict} ({run_dir})", flush=True)
    print(f"{bad} of {args.runs} runs failed ({args.kind}, {args.steps} steps)", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
