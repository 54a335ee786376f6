"""The text a TrainStep's fingerprint hashes: its program with the batch shapes left out.

A TrainState (parameters, buffers, optimizer slots, lr, RNG, scheduler epoch) does not depend on the
batch shape, so a state moves between steps whose programs differ only in batch shapes: a data-parallel
state saved on rank 0 (batch 2) loads on rank 1 (batch 3). The text keeps what makes a state belong to
a program: every state placeholder's name, role, dtype and shape; every node's name, op and dtype; float,
bool, string and dtype arguments (optimizer options, clip norms, loss scales). It leaves out what the
batch shape changes: the sizes and strides of computed values and of the batch inputs, and every
integer argument (view / expand sizes, a sum divided by the batch size). A ZeRO-1 step's rank and world
size, which its slicing offsets carried, are added by TrainStep.fingerprint.
"""

from __future__ import annotations

from . import _C


def _type(t: tuple) -> str:
    if t[0] == "tensor":  # ("tensor", dtype, sizes, strides, device): dtype and rank only
        return f"{t[1]}[{len(t[2])}d]"
    if t[0] == "tuple":
        return "(" + ", ".join(_type(e) for e in t[1]) + ")"
    return t[0]


def _arg(a) -> str:
    if isinstance(a, _C.NodeRef):
        return "%" + a.name
    if isinstance(a, _C.Special):
        return a.text
    if isinstance(a, list):
        return "[" + ", ".join(_arg(x) for x in a) + "]"
    if isinstance(a, int) and not isinstance(a, bool):
        return "#"
    return repr(a)


def shape_free_text(graph) -> str:
    """One line per node (and per node of each cond / while_loop region, indented)."""
    lines: list[str] = []

    def walk(g, indent: str) -> None:
        for n in g.nodes():
            if n.kind == "placeholder" and n.role != "input":  # state: its layout is what a state must match
                t = n.type
                typ = f"{t[1]}{list(t[2])}" if t[0] == "tensor" else _type(t)
                lines.append(f"{indent}{n.name} = {n.role}({n.state_name!r}) : {typ}")
                continue
            args = ", ".join([_arg(a) for a in n.args] + [f"{k}={_arg(v)}" for k, v in n.kwargs])
            lines.append(f"{indent}{n.name} = {n.kind} {n.target or n.role or ''}({args}) : {_type(n.type)}")
            for r in n.regions:
                walk(r, indent + "  ")

    walk(graph, "")
    return "\n".join(lines)
