"""What the benchmark and reproduction scripts share: exactness checks, speed targets, headers,
the closing summary and the eager forward-hook sweep (TransformerLens's mechanism). Scripts run as ``python scripts/<name>.py``, so this imports as a sibling."""
from __future__ import annotations

import contextlib
import gc
import statistics
import time

import torch

FAILURES: list[str] = []
MISSED: list[str] = []


def check(ok: bool, what: str) -> bool:
    """An exactness check: a failure is printed now and counted in the summary (exit status 1)."""
    if not ok:
        FAILURES.append(what)
        print(f"  !! FAILED: {what}")
    return ok


def target(ok: bool, what: str) -> str:
    """A speed target: missed ones are listed in the summary, without failing the run."""
    if not ok:
        MISSED.append(what)
    return "met" if ok else "MISSED"


def header(title: str) -> None:
    print()
    print("=" * 100)
    print(title)
    print("=" * 100)


def summary(t0: float, failed: str = "CHECK(S) FAILED") -> int:
    """Prints the run time, the missed targets and the failed checks; the exit status."""
    print()
    print(f"total {time.perf_counter() - t0:.1f} s")
    if MISSED:
        print("speed targets missed: " + "; ".join(MISSED))
    if FAILURES:
        print(f"{len(FAILURES)} {failed}:")
        for f in FAILURES:
            print("  -", f)
        return 1
    print("all exactness checks passed")
    return 0


def eager_hook_sweep(model, clean, cache, T: int, metric) -> dict:
    """TransformerLens's mechanism: one hooked forward per (layer, position), the position's residual
    stream entering block ``layer`` replaced by ``cache[layer]``'s; ``{(layer, pos): metric}``."""
    import torch

    out = {}
    with torch.no_grad():
        for layer, blk in enumerate(model.blocks):
            for pos in range(T):
                def hook(m, args, layer=layer, pos=pos):
                    x = args[0].clone()
                    x[:, pos] = cache[layer][:, pos]
                    return (x,)
                h = blk.register_forward_pre_hook(hook)
                try:
                    out[(layer, pos)] = float(metric(model(clean)))
                finally:
                    h.remove()
    return out


def resid_pre_cache(model, tokens) -> dict:
    """The residual stream entering every block (TransformerLens's blocks.{l}.hook_resid_pre), {layer: tensor}."""
    import torch

    cache, handles = {}, []
    for layer, blk in enumerate(model.blocks):
        handles.append(blk.register_forward_pre_hook(lambda m, args, layer=layer: cache.__setitem__(layer, args[0].clone())))
    try:
        with torch.no_grad():
            model(tokens)
    finally:
        for h in handles:
            h.remove()
    return cache


def best_thread_seconds(fn, n: int, rounds: int = 5) -> float:
    """Seconds of thread CPU time per call of ``fn``: the best of ``rounds`` rounds of ``n`` calls, after one warm-up
    call (thread time and the best round, so other load on the machine counts less)."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.thread_time()
        for _ in range(n):
            fn()
        best = min(best, (time.thread_time() - t0) / n)
    return best



def interleaved_medians(fns: dict, repeats: int, clock=time.perf_counter, min_seconds: float = 0.0,
                        no_grad: bool = False) -> dict:
    """Median seconds of each callable, the callables interleaved within every repeat (so the machine's drifting
    speed hits them alike), after one warm-up call each, with the cyclic garbage collector off while timing (as
    timeit does: a full collection of this process's heap, torch and the exported programs, takes tens of ms and
    lands in whichever arm happens to allocate then). ``clock``: ``time.perf_counter`` (wall) or
    ``time.thread_time`` (this thread's CPU time, for a loaded machine). With ``min_seconds``, at least that much
    time is spent in the repeats (more repeats for fast callables, at most 200): a median of a few repeats of a 3 ms
    cell moves with the machine's speed. ``no_grad``: warm-up and timing under ``torch.no_grad()``."""
    with torch.no_grad() if no_grad else contextlib.nullcontext():
        warm = 0.0
        for fn in fns.values():
            t0 = clock()
            fn()
            warm += clock() - t0
        if min_seconds > 0 and warm > 0:
            repeats = max(repeats, min(200, int(min_seconds / warm) + 1))
        times = {k: [] for k in fns}
        gc.collect()
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            for _ in range(repeats):
                for k, fn in fns.items():
                    t0 = clock()
                    fn()
                    times[k].append(clock() - t0)
        finally:
            if was_enabled:
                gc.enable()
    return {k: statistics.median(v) for k, v in times.items()}
