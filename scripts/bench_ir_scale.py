"""Linear-time front end (issue 16): parse, verify, print and engine construction on large graphs.

    python scripts/bench_ir_scale.py [--nodes 100000]

Graphs: a chain of N relu nodes with N dead neg branches (2N nodes; the engine drops the dead half
with one compaction), and a chain of N slices with N distinct signatures (every node's type differs,
so the verifier's per-signature cache never hits and every node runs its meta kernel). Prints
seconds and microseconds per node; a quadratic step shows up as per-node time growing with N
(the same script at --nodes 10000 and 100000 should print about the same per-node figures).
"""
from __future__ import annotations

import argparse
import time

from torch_ext import _C


def timed(label: str, n: int, fn):
    t = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t
    print(f"  {label:44s} {dt:8.3f} s  {dt / n * 1e6:7.2f} us/node")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=100000)
    n = ap.parse_args().nodes
    lines = ["graph:", "  %x : f32[4] = input()"]
    prev = "x"
    for i in range(n):
        lines.append(f"  %a{i} : f32[4] = aten::relu.default(%{prev})")
        lines.append(f"  %d{i} : f32[4] = aten::neg.default(%a{i})")
        prev = f"a{i}"
    lines.append(f"  return (%{prev})")
    text = "\n".join(lines)
    print(f"chain of {n} relus with {n} dead branches ({2 * n} nodes)")
    g = timed("parse", 2 * n, lambda: _C.Graph.parse(text))
    timed("verify", 2 * n, g.verify)
    timed("print", 2 * n, lambda: str(g))
    timed("Engine (drops the dead half, binds the rest)", 2 * n, lambda: _C.Engine(g))
    lines = ["graph:", f"  %x : f32[{n + 1}] = input()"]
    prev = "x"
    for i in range(n):
        lines.append(f"  %s{i} : f32[{n - i}] = aten::slice.Tensor(%{prev}, 0, 0, {n - i})")
        prev = f"s{i}"
    lines.append(f"  return (%{prev})")
    print(f"chain of {n} slices, {n} distinct signatures")
    g = timed("parse", n, lambda: _C.Graph.parse("\n".join(lines)))
    timed("verify (a meta kernel per node)", n, g.verify)


if __name__ == "__main__":
    main()
