"""torch_ext.patching against transformer_lens.patching on a TransformerBridge (issue 12).

Prints, side by side and measured in one run: TransformerLens's time, ours end to end (building
the ReactiveGraph included: a fresh model object each time, so no graph is reused), ours warm (the
graph built for this model and shape is reused), the ratios, and max |difference| of the results
(an independent check: TransformerLens's own tensor is the reference).

    python scripts/bench_patching.py [--layers 4 --d-model 128 --seq 20 --batches 1 8]
"""
from __future__ import annotations

import argparse
import copy
import time

import torch

import transformer_lens as tl
import transformer_lens.patching as tl_patching
from torch_ext import patching


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--seq", type=int, default=20)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--functions", nargs="+",
                    default=["get_act_patch_resid_pre", "get_act_patch_attn_head_out_by_pos"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = tl.TransformerBridgeConfig(n_layers=args.layers, d_model=args.d_model, n_heads=4,
                                     d_head=args.d_model // 4, d_mlp=4 * args.d_model, n_ctx=64, d_vocab=500,
                                     act_fn="gelu", normalization_type="LN", seed=0)
    bridge = tl.TransformerBridge.boot_native(cfg).eval()
    metric = lambda logits: logits[:, -1, 3].mean() - logits[:, -1, 4].mean()  # noqa: E731
    print(f"TransformerBridge n_layers={args.layers} d_model={args.d_model} seq={args.seq}, one thread")
    print(f"{'function':38s} {'batch':>5s} {'TL s':>8s} {'ours e2e s':>10s} {'ours warm s':>11s} "
          f"{'e2e x':>7s} {'warm x':>7s} {'max|diff|':>9s}")
    for batch in args.batches:
        g = torch.Generator().manual_seed(batch)
        clean = torch.randint(0, 500, (batch, args.seq), generator=g)
        corrupted = clean.clone()
        corrupted[:, args.seq // 4] = (corrupted[:, args.seq // 4] + 7) % 500
        _, cache = bridge.run_with_cache(clean)
        for name in args.functions:
            t = time.perf_counter()
            ref = getattr(tl_patching, name)(bridge, corrupted, cache, metric)
            t_tl = time.perf_counter() - t
            fresh = copy.deepcopy(bridge)  # a new model object: nothing cached for it
            t = time.perf_counter()
            ours = getattr(patching, name)(fresh, corrupted, cache, metric)
            t_e2e = time.perf_counter() - t
            t = time.perf_counter()
            ours_warm = getattr(patching, name)(fresh, corrupted, cache, metric)
            t_warm = time.perf_counter() - t
            diff = max(float((ref - ours).abs().max()), float((ref - ours_warm).abs().max()))
            print(f"{name:38s} {batch:5d} {t_tl:8.2f} {t_e2e:10.2f} {t_warm:11.2f} {t_tl / t_e2e:7.2f} "
                  f"{t_tl / t_warm:7.2f} {diff:9.2g}")


if __name__ == "__main__":
    main()
