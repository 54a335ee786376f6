"""Hugging Face GPT-2 residual sweeps by rows (token-granular cones) against the node-granular sweep and
eager forward hooks: every (layer, position) site of blocks.<l>.hook_resid_pre patched from a clean run,
metric the last position's logit difference. Prints row evaluations and FLOPs of each arm, the largest
difference to eager hooks, how many sites are bit-equal to the node-granular sweep, and thread time of each
arm, alternated (median of --rounds). Run under the bench lock:
    flock /tmp/torch_ext_bench.lock python scripts/bench_gpt2_rows.py
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

import torch_ext


def pre_hook(replace):
    def hook(mod, args, kwargs):
        if args:
            return (replace(args[0]),) + tuple(args[1:]), kwargs
        kwargs = dict(kwargs)
        kwargs["hidden_states"] = replace(kwargs["hidden_states"])
        return args, kwargs
    return hook


def run(n_layer: int, d: int, T: int, batch: int, rounds: int) -> None:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=n_layer, n_embd=d, n_head=4, vocab_size=512, n_positions=max(T, 16))
    model = transformers.GPT2LMHeadModel(cfg).eval()
    g = torch.Generator().manual_seed(batch)
    clean = torch.randint(0, 512, (batch, T), generator=g)
    corrupted = clean.clone()
    corrupted[:, T // 3] = (corrupted[:, T // 3] + 5) % 512
    layers = model.transformer.h
    seen = {}
    hs = [layers[i].register_forward_pre_hook(pre_hook(lambda h, i=i: seen.setdefault(i, h.detach().clone())),
                                              with_kwargs=True) for i in range(n_layer)]
    with torch.no_grad():
        model(clean, use_cache=False)
    for h in hs:
        h.remove()
    rg = torch_ext.ReactiveGraph(model, (corrupted,))
    names = [rg.resolve(f"blocks.{layer}.hook_resid_pre") for layer in range(n_layer)]
    sites = [(name, p) for name in names for p in range(T)]

    def patch(v, site):
        v = v.clone()
        v[:, site[1]] = seen[names.index(site[0])][:, site[1]]
        return v

    metric = lambda out: float((out.logits[:, -1, 3] - out.logits[:, -1, 4]).sum())  # noqa: E731

    def eager():
        out = {}
        with torch.no_grad():
            for layer in range(n_layer):
                for p in range(T):
                    def put(h, layer=layer, p=p):
                        h = h.clone()
                        h[:, p] = seen[layer][:, p]
                        return h
                    hook = layers[layer].register_forward_pre_hook(pre_hook(put), with_kwargs=True)
                    try:
                        out[(names[layer], p)] = metric(model(corrupted, use_cache=False))
                    finally:
                        hook.remove()
        return out

    arms = {
        "rows": lambda: torch_ext.sweep(rg, sites, patch, metric, progress=False, batch_sites=False),
        "rows+reads": lambda: torch_ext.sweep(rg, sites, patch, metric, progress=False, batch_sites=False,
                                              reads={"logits": (slice(None), -1, [3, 4])}),
        "nodes": lambda: torch_ext.sweep(rg, sites, patch, metric, progress=False, batch_sites=False,
                                         positions=False),
        "eager": eager,
    }
    results = {k: f() for k, f in arms.items()}  # warm-up, and the values compared
    ref = results["eager"]
    print(f"\nGPT-2 n_layer={n_layer} d={d} T={T} batch={batch}: {len(sites)} sites")
    for k in ("rows", "rows+reads", "nodes"):
        r = results[k]
        worst = max(abs(r.metrics[s] - ref[s]) / max(abs(ref[s]), 1e-6) for s in sites)
        same_bits = sum(r.metrics[s] == results["nodes"].metrics[s] for s in sites)
        print(f"  {k:11s} evaluations {r.measured_evaluations:6d}  row evaluations "
              f"{r.extra['row_evaluations']:9.1f}  FLOPs {r.cost:.3e}  max rel diff to eager {worst:.2e}  "
              f"bit-equal to nodes {same_bits}/{len(sites)}")
    times = {k: [] for k in arms}
    for _ in range(rounds):
        for k, f in arms.items():
            t0 = time.thread_time()
            f()
            times[k].append(time.thread_time() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    print("  thread s (median of %d): " % rounds + "  ".join(f"{k} {v:.3f}" for k, v in med.items()))
    print(f"  rows vs nodes {med['nodes'] / med['rows']:.2f}x, rows vs eager {med['eager'] / med['rows']:.2f}x, "
          f"rows+reads vs nodes {med['nodes'] / med['rows+reads']:.2f}x, "
          f"rows+reads vs eager {med['eager'] / med['rows+reads']:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--configs", default="2x32x6x1,2x32x6x8,4x128x16x1,4x128x16x8",
                    help="comma-separated n_layer x d_model x T x batch")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for cfg in args.configs.split(","):
        n_layer, d, T, batch = (int(v) for v in cfg.split("x"))
        run(n_layer, d, T, batch, args.rounds)


if __name__ == "__main__":
    main()
