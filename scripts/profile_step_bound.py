"""How much of an eager training step runs in GEMM and convolution kernels, and what that bounds.

A compiler of the whole step (AOTInductor, torch.compile) on the CPU fuses the elementwise,
normalisation and optimizer work but calls the same extern kernels for matmuls and convolutions
(MKL / oneDNN). If those kernels take a share s of the eager step, no such compiler can be faster
than 1 / s times eager, even when everything else costs nothing. This script measures s with the
profiler (self CPU time per ATen op, one thread) for bench_step.py's cases and prints the bound.

    python scripts/profile_step_bound.py [--cases gpt2,resnet18] [--steps 3] [--threads 1]
"""
from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, __import__("os").path.dirname(__file__))
from bench_step import CASES  # noqa: E402

# The extern kernels an Inductor-compiled CPU step still calls (forward and backward).
EXTERN = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_addmm_activation",
          "aten::mkldnn_convolution", "aten::convolution_backward", "aten::_convolution",
          "aten::_scaled_dot_product_flash_attention_for_cpu",
          "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


def profile(case_name: str, steps: int) -> dict:
    name, model, loss_fn, batch, _ = CASES[case_name]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        opt.zero_grad()
        loss_fn(model, *batch).backward()
        opt.step()

    for _ in range(2):
        step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    per_op = {e.key: e.self_cpu_time_total for e in events}
    extern = {k: v for k, v in per_op.items() if k in EXTERN}
    top_other = sorted(((v, k) for k, v in per_op.items() if k not in EXTERN), reverse=True)[:6]
    share = sum(extern.values()) / total
    return {"name": name, "ms_per_step": total / steps / 1e3, "share": share, "bound": 1 / share,
            "extern": extern, "top_other": top_other, "total": total}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="gpt2,resnet18")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for case in args.cases.split(","):
        r = profile(case, args.steps)
        print(f"{r['name']}: eager step {r['ms_per_step']:.1f} ms of profiled self time, "
              f"GEMM/conv kernels {100 * r['share']:.1f}% -> any compiler calling the same kernels is at most "
              f"{r['bound']:.2f}x eager")
        for k, v in sorted(r["extern"].items(), key=lambda kv: -kv[1]):
            print(f"    {k:58s} {100 * v / r['total']:5.1f}%")
        print("    largest other ops: " + ", ".join(f"{k} {100 * v / r['total']:.1f}%" for v, k in r["top_other"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
