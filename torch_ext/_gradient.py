"""Gradients of a metric with respect to a ReactiveGraph's nodes (attribution patching).

The engine runs without autograd. ``gradients`` re-runs only the downstream cone of the requested nodes, in an
``fx.Interpreter`` over the graph the engine runs now (grafts and split heads included) under ``enable_grad``,
with every value outside that cone taken from the cache (standing patches included) and each requested node's
current value as a ``requires_grad`` leaf; then ``autograd.grad(metric(outputs), nodes)``. The cone runs the
same ATen ops as the model's eager forward, so the gradients are eager autograd's (``retain_grad()`` on the
activations), bit for bit where the ops' backward formulas are those eager runs.

A requested node downstream of another requested node is computed from it (not a leaf), so the gradient with
respect to the upstream node is the total derivative, through the downstream one, as eager's is. A patched
node is a constant of the patched graph (its pinned value, whatever its inputs are): gradients flow around it,
not through it; asked for itself, its gradient is the one with respect to its pinned value.

Nothing in the cache changes: values are read in an engine transaction that is rolled back, counters
included (a gradient call is a read, not a patch, and evaluates nothing the next demand would not).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.fx
import torch.utils._pytree as pytree

from .ir import _to_graph_module


class _Cone(torch.fx.Interpreter):
    """Runs only the nodes not given in ``initial_env``; keeps the results of ``keep`` (non-leaf requested
    nodes) before the interpreter frees them at their last use."""

    def __init__(self, gm: torch.fx.GraphModule, keep: set):
        super().__init__(gm, garbage_collect_values=True)
        self.keep, self.kept = keep, {}

    def run_node(self, n: torch.fx.Node):
        if n.op == "call_function" and n.target is torch.ops.aten.alias.default and n.name not in self.keep:
            # An alias the trace made for a hook's name (blocks.<l>.hook_resid_mid: the pre-MLP norm's input) is
            # the value itself in eager: run as an op, it summed the gradients of its readers before adding them
            # to the others' (an RMSNorm reads its input twice: (pow + mul) + residual, where eager's autograd adds
            # the three in its own order, 1e-7 relative off on Llama, not bit for bit). Asked for, it stays an op:
            # its gradient is its readers' only.
            return self.env[n.args[0]] if isinstance(n.args[0], torch.fx.Node) else super().run_node(n)
        if n.op == "call_function" and n.target is torch.ops.aten.copy.default:
            # The functional form of an in-place copy (a block's torch.empty_like(t).copy_(f(t))) has no autograd
            # formula ("derivative for aten::copy is not implemented"); eager ran copy_, whose derivative is the
            # identity into the source (cast back to its dtype and summed over a broadcast) and zero into the
            # overwritten destination. Run as eager ran it, on a copy of the destination: the same CopyBackwards.
            dst, src = (self.env[a] if isinstance(a, torch.fx.Node) else a for a in n.args[:2])
            non_blocking = n.args[2] if len(n.args) > 2 else n.kwargs.get("non_blocking", False)
            out = dst.clone().copy_(src, non_blocking=non_blocking)
        else:
            out = super().run_node(n)
        if n.name in self.keep:
            self.kept[n.name] = out
        return out


def _graph_module(rg) -> torch.fx.GraphModule:
    """The engine's current graph as a GraphModule, cached until the graph changes (a graft)."""
    key = (rg._engine, rg._engine.graph_revision())
    cached = rg.__dict__.get("_gradient_gm")
    if cached is None or cached[0] != key:
        gm = _to_graph_module(rg.graph)
        # FX snake-cases a placeholder's name (p_bert_embeddings_LayerNorm_weight becomes ..._layer_norm_weight);
        # everything here looks nodes up in the engine by name, so each placeholder gets its IR name back (its
        # target). Before, a cone reading a Hugging Face LayerNorm's weight asked the engine for an unknown node.
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                n.name = n.target
        _eager_order(rg, gm)
        cached = rg._gradient_gm = (key, gm)
    return cached[1]


def _eager_order(rg, gm: torch.fx.GraphModule) -> None:
    """Moves each edge-form graft's block nodes to where eager computes them: in the forward pre-hook of the
    reader's module (README: the eager form of ``graft(src, dst, block)``), i.e. right before the first op of that
    module's call, not right before ``dst`` where the engine splices them.

    The order matters for gradients, not values: autograd accumulates a multi-consumer tensor's gradient in the
    order its consumers' backward nodes run, the most recently created first where several are ready. Created
    before the module's other readers of ``src`` in eager and after them in the graph's order, the block's
    contribution was added last in eager and first here (``(a + b) + c`` against ``(c + a) + b``: 6e-8 off eager
    at blocks.0.hook_resid_post on a Llama, an edge graft on layer 1's residual add, silently). A node-form graft
    is spliced right after its node, where eager's forward hook runs it: already eager's order. Several edges into
    one module keep the graft order (their pre-hooks run in registration order)."""
    nodes = list(gm.graph.nodes)
    by_name = {n.name: n for n in nodes}
    grafts, paths = getattr(rg, "_grafts", ()), getattr(rg, "_module_paths", {})
    block_names = {name for _, _, _, names in grafts for name in names}

    def under(path: str, p: str) -> bool:
        return path == p or path.startswith(p + ".")
    for _, dst, _, names in grafts:
        p = paths.get(dst) or ""
        if not dst or not p or dst not in by_name:
            continue  # node form, or a reader no module call encloses (the graph's order is the only one)
        nodes = list(gm.graph.nodes)
        index = {n: i for i, n in enumerate(nodes)}
        i = index[by_name[dst]]
        anchor = nodes[i]
        for n in reversed(nodes[:i]):  # back over the module's call (other grafts' blocks inside it included)
            if n.name in block_names:
                continue
            if n.op == "call_function" and under(paths.get(n.name) or "", p):
                anchor = n
                continue
            break
        block = [n for n in nodes if n.name in names and n.op == "call_function"]
        moved = set(block)
        if not block or anchor in moved or any(a not in moved and index[a] >= index[anchor]
                                               for b in block for a in b.all_input_nodes):
            continue  # an input computed inside the module's call: no pre-hook expresses the edge
        for b in block:
            anchor.prepend(b)
    gm.graph.lint()
    gm.recompile()


def _refuse_node(rg, name: str, node: str) -> None:
    t = rg._type_of(node)
    if t[0] != "tensor":
        raise ValueError(f"gradient: node {node!r}{f' (hook {name!r})' if name != node else ''} holds a {t[0]}, "
                         "not a tensor: a gradient is taken with respect to a floating-point tensor")
    dtype = rg._engine.node(node)["type"][1]
    if dtype not in ("f32", "f64", "f16", "bf16"):
        raise ValueError(f"gradient: node {node!r}{f' (hook {name!r})' if name != node else ''} holds a {dtype} "
                         "tensor; a gradient is taken with respect to a floating-point tensor (f32, f64, f16, bf16)")


def _scalar(m, metric: Callable) -> torch.Tensor:
    what = getattr(metric, "__name__", type(metric).__name__)
    if not isinstance(m, torch.Tensor):
        raise TypeError(f"gradient: metric {what} returned {type(m).__name__}; it must return a one-element "
                        "floating-point tensor computed from the outputs it is given (a Python number, from "
                        ".item() or float(), carries no gradient)")
    if m.numel() != 1 or not m.is_floating_point():
        raise TypeError(f"gradient: metric {what} returned a {m.dtype} tensor of shape {list(m.shape)}; it must "
                        "return one floating-point value (reduce per-example metrics, e.g. .sum() or .mean())")
    if not m.requires_grad:
        raise RuntimeError(f"gradient: metric {what} returned a value that depends on none of the requested nodes "
                           "(it has no grad_fn): it reads only outputs none of them reach, or it detached its "
                           "inputs (.detach(), .item(), torch.no_grad()); eager's backward fails on it too")
    return m.reshape(())


def gradients(rg, metric: Callable, names: list[str]) -> dict[str, torch.Tensor]:
    """{name: d metric(outputs) / d value(name)} at the graph's current values; see the module docstring."""
    nodes = {}
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"gradient: expected node or hook names (str), got {type(name).__name__} {name!r}")
        node = rg._read_node(name)
        # After a graft through the other of two hook names in a row, eager's gradient at this one is the block
        # output's or the value's before it: one node has one (it answered the same for both names). So while the
        # other name is patched: eager's gradient at blocks.0.hook_resid_post with blocks.1.hook_resid_pre patched
        # is zero (the patch replaces it before anything reads it), where the one node answered the gradient with
        # respect to the patch (4.04 off on a Qwen2, silently). Refused as value() refuses it.
        rg._refuse_other_hook_name(name, node, f"gradient({name!r})")
        _refuse_node(rg, name, node)
        nodes[name] = node
    requested = set(nodes.values())
    eng = rg._engine
    pinned = set(eng.pinned())
    gm = _graph_module(rg)
    graph_nodes = list(gm.graph.nodes)
    # Run: what the requested nodes reach through nodes that are not patched (a patched node is a constant, and so
    # is what only it reaches: a requested node downstream of another one only through a patch is a leaf; computed
    # from constants it had no gradient, and the call was refused as if the metric read none of them). The
    # requested nodes reached so are computed from the upstream ones; the others are leaves. Everything a run node
    # or the output reads is given.
    run, stack = set(), [n for n in graph_nodes if n.name in requested]
    while stack:
        for u in stack.pop().users:
            if u.op != "output" and u.name not in run and u.name not in pinned:
                run.add(u.name)
                stack.append(u)
    leaves = {n for n in requested if n not in run}
    given = {}
    # Which values require grad in eager: a parameter (or input) that does, and what it reaches, a patch cutting
    # it off. Some kernels choose their path by it (matmul folds a [batch, pos, d] input into one GEMM only where
    # the weight needs no gradient, and the other path rounds the input's gradient otherwise: 4.8e-7 off eager on a
    # Linear after a transpose), so the given values are leaves with eager's flags.
    eager_rg = {}
    eng.begin_transaction(restore_counts=True)
    try:
        for n in graph_nodes:
            if n.op == "placeholder":
                try:
                    v = eng.value(n.name)
                except RuntimeError:  # a placeholder the engine holds no value for (a region's own input)
                    v = None
                eager_rg[n.name] = isinstance(v, torch.Tensor) and v.requires_grad
            elif n.op == "call_function":
                eager_rg[n.name] = n.name not in pinned and any(eager_rg.get(a.name, False) for a in n.all_input_nodes)
            if n.name in run:
                continue
            if n.op == "output" or n.op == "get_attr":
                continue
            if n.name in leaves or any(u.name in run or u.op == "output" for u in n.users):
                given[n.name] = eng.value(n.name)
            else:
                given[n.name] = None
    finally:
        eng.rollback()
    env = {}
    by_name = {n.name: n for n in graph_nodes}
    leaf_values = {}
    for name, v in given.items():
        if name in leaves:
            v = v.detach().clone().requires_grad_(True)
            leaf_values[name] = v
        elif isinstance(v, torch.Tensor):
            v = v.detach()
            if eager_rg.get(name) and (v.is_floating_point() or v.is_complex()):
                v = v.requires_grad_(True)
        env[by_name[name]] = v
    interp = _Cone(gm, requested & run)
    before = getattr(rg, "_in_metric", False)
    with torch.enable_grad():
        flat = interp.run(initial_env=env, enable_io_processing=False)
        outs = rg._user(list(flat))
        rg._in_metric = True
        try:
            m = _scalar(metric(outs), metric)
        finally:
            rg._in_metric = before
        wrt = [leaf_values[n] if n in leaf_values else interp.kept[n] for n in nodes.values()]
        grads = torch.autograd.grad(m, wrt, allow_unused=True)
    result = {}
    for (name, node), g, w in zip(nodes.items(), grads, wrt):
        g = torch.zeros_like(w) if g is None else g
        result[name] = rg._as_hook(name, g.detach())
    return result
