"""Synthetic text-IR graphs for the cost-model reproductions, tests and benchmarks."""
from __future__ import annotations


def chain_text(n: int, op: str = "aten::relu.default", shape: str = "f32[4]") -> str:
    """x -> n1 -> ... -> nN: a single path of N countable nodes."""
    lines = ["graph:", f"  %x : {shape} = input()"]
    prev = "x"
    for i in range(1, n + 1):
        lines.append(f"  %n{i} : {shape} = {op}(%{prev})")
        prev = f"n{i}"
    lines.append(f"  return (%{prev})")
    return "\n".join(lines) + "\n"


def block_text(h: int, op: str = "aten::cos.default", shape: str = "f32[4]") -> str:
    """A graftable block: one input, h chained nodes, one output of the input's type."""
    lines = ["graph:", f"  %a : {shape} = input()"]
    prev = "a"
    for i in range(1, h + 1):
        lines.append(f"  %b{i} : {shape} = {op}(%{prev})")
        prev = f"b{i}"
    lines.append(f"  return (%{prev})")
    return "\n".join(lines) + "\n"


def e4_weights(L: int, q: float, profile: str, total: int = 4000, floor: int = 1) -> list[int]:
    """Layer weights of the paper's E4/E5 profiles: w_j = max(floor, round(raw_j * total / sum raw)),
    raw_j = j^q (output-heavy) or (L-j+1)^q (input-heavy). round() is half-even, like Julia's."""
    raw = [float(j) ** q if profile == "output" else float(L - j + 1) ** q for j in range(1, L + 1)]
    s = sum(raw)
    return [max(floor, round(r * total / s)) for r in raw]
