"""Synthetic text-IR graphs, and an independent graph structure (BFS cones), for the cost-model
reproductions, tests and benchmarks."""
from __future__ import annotations

from collections import defaultdict

from . import _C


def _chain(n: int, op: str, shape: str, inp: str, prefix: str) -> str:
    lines = ["graph:", f"  %{inp} : {shape} = input()"]
    prev = inp
    for i in range(1, n + 1):
        lines.append(f"  %{prefix}{i} : {shape} = {op}(%{prev})")
        prev = f"{prefix}{i}"
    lines.append(f"  return (%{prev})")
    return "\n".join(lines) + "\n"


def chain_text(n: int, op: str = "aten::relu.default", shape: str = "f32[4]") -> str:
    """x -> n1 -> ... -> nN: a single path of N countable nodes."""
    return _chain(n, op, shape, "x", "n")


def block_text(h: int, op: str = "aten::cos.default", shape: str = "f32[4]") -> str:
    """A graftable block: one input, h chained nodes, one output of the input's type."""
    return _chain(h, op, shape, "a", "b")


def layered_text(weights: list[int], op: str = "aten::relu.default") -> tuple[str, list[str], list[str]]:
    """E5's parallel-branch layers: w_j ``op`` branches read the previous aggregate, folded by w_j - 1 adds.
    Returns (text, the first branch of each layer, the aggregate of each layer)."""
    lines = ["graph:", "  %x : f32[4] = input()"]
    cur, firsts, aggs = "x", [], []
    for j, w in enumerate(weights, start=1):
        branches = [f"l{j}b{i}" for i in range(1, w + 1)]
        for b in branches:
            lines.append(f"  %{b} : f32[4] = {op}(%{cur})")
        acc = branches[0]
        for i, b in enumerate(branches[1:], start=1):
            lines.append(f"  %l{j}a{i} : f32[4] = aten::add.Tensor(%{acc}, %{b})")
            acc = f"l{j}a{i}"
        firsts.append(branches[0])
        aggs.append(acc)
        cur = acc
    lines.append(f"  return (%{cur})")
    return "\n".join(lines) + "\n", firsts, aggs


def e4_weights(L: int, q: float, profile: str, total: int = 4000, floor: int = 1) -> list[int]:
    """Layer weights of the paper's E4/E5 profiles: w_j = max(floor, round(raw_j * total / sum raw)),
    raw_j = j^q (output-heavy) or (L-j+1)^q (input-heavy). round() is half-even, like Julia's."""
    raw = [float(j) ** q if profile == "output" else float(L - j + 1) ** q for j in range(1, L + 1)]
    s = sum(raw)
    return [max(floor, round(r * total / s)) for r in raw]


def node_refs(arg):
    """The names of the nodes an IR argument refers to (lists walked), in order."""
    if isinstance(arg, _C.NodeRef):
        yield arg.name
    elif isinstance(arg, (list, tuple)):
        for a in arg:
            yield from node_refs(a)


class Structure:
    """Parents and children by name, read from a graph's node views (``Graph.nodes()``), never from
    the engine: an independent BFS to check the engine's cones and counts against."""

    def __init__(self, nodes):
        self.order: list[str] = []
        self.kind: dict[str, str] = {}
        self.parents: dict[str, list[str]] = {}
        self.outputs: list[str] = []
        for n in nodes:
            refs = list(dict.fromkeys(r for a in list(n.args) + [v for _, v in n.kwargs] for r in node_refs(a)))
            if n.kind == "output":
                self.outputs = refs
                continue
            self.order.append(n.name)
            self.kind[n.name] = n.kind
            self.parents[n.name] = refs
        self._rebuild_children()

    def _rebuild_children(self):
        self.children = defaultdict(list)
        for v, ps in self.parents.items():
            for p in ps:
                self.children[p].append(v)

    @property
    def countable(self) -> list[str]:
        return [v for v in self.order if self.kind[v] == "call"]

    @staticmethod
    def _bfs(s: str, edges) -> set[str]:
        seen, work = set(), [s]
        while work:
            for c in edges[work.pop()]:
                if c not in seen:
                    seen.add(c)
                    work.append(c)
        return seen

    def cone(self, s: str) -> set[str]:
        """V+(s): strict descendants (all are countable: only call nodes have parents)."""
        return self._bfs(s, self.children)

    def ancestors(self, s: str) -> set[str]:
        """V-(s): strict ancestors, placeholders included."""
        return self._bfs(s, self.parents)

    def D(self, w: str) -> set[str]:
        return {w} | self.cone(w)

    def edges(self) -> set[tuple[str, str]]:
        return {(p, v) for v, ps in self.parents.items() for p in ps}
