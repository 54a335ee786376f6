"""ReactiveGraph and sweep: the Python face of csrc/reactive/engine.h.

Counting conventions are those of shared/docs/cost-model.md: every call node (getitem and grafted
nodes included) counts one evaluation; placeholders and the output are never counted. A patch at
``s`` costs exactly |V+(s)| evaluations at the next demand; ``restore()`` costs zero.
"""
from __future__ import annotations

import collections
import contextlib
import fnmatch
import fractions
import itertools
import math
import re
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable, Sequence

import torch
import torch.utils._pytree as pytree

from . import _C, _build_cache, _compat, _disk_cache, _env_reads, _hook_proof, _module_state, _read_inference
from ._joint_edits import JointEditRule
from .ir import _SHORT_DTYPE, Graph


def _functional_program(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """Cached values must never be aliased by an in-place op: functionalize, keep composite ops.

    A program with no mutating op and no mutated input is functional already; it is used as it is,
    since run_decompositions re-traces the whole model (most of the build time of a graph).
    """
    mutated = any(spec.kind.name.endswith("MUTATION") for spec in ep.graph_signature.output_specs)
    mutating = any(n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
                   and n.target._schema.is_mutable for n in ep.graph.nodes)
    # A forward that enters torch.autocast is exported as a wrap_with_autocast region; run_decompositions
    # traces it into the casts autocast makes (aten._to_copy), so the graph runs the same kernels on the
    # same dtypes as eager, with no ambient context needed.
    autocast = any(n.op == "call_function" and n.target is getattr(torch.ops.higher_order, "wrap_with_autocast", None)
                   for n in ep.graph.nodes)
    if mutated or mutating or autocast:
        from . import _trace_patches

        # The retrace keeps batch norm's results in its CPU kernels' layout, as traced (INFERENCE_TRACE).
        with _trace_patches.patched("eager_batch_norm_layouts"):
            ep = ep.run_decompositions({})
    ep = _without_hidden_stat_writes(ep)
    _untangle_identity_casts(ep)
    return ep


_IDENTITY_CASTS = {torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout, torch.ops.aten.to.device,
                   torch.ops.aten.type_as.default}


def _untangle_identity_casts(ep: torch.export.ExportedProgram) -> None:
    """Gives back to the code outside a module the tensor it read, where the module's cast to the dtype the
    tensor has already (``hidden_states.to(torch.float32)`` in a float32 RMSNorm) was traced as a node.

    Eager returns the tensor itself for such a cast, so the tracer maps that one tensor to the cast's node from
    then on: a Llama decoder layer's residual add (``residual = hidden_states`` before ``input_layernorm``) read
    the norm's internal ``to`` node instead of ``hook_resid_pre``. Values were the same, edges were not: a graft
    on the edge resid_pre -> input_layernorm (path patching into the attention only) reached the residual stream
    too, silently. Consumers outside the cast's module (where the module uses the cast itself) read the cast's
    input again; the cast keeps its consumers inside the module. A cast the module does not use itself (maybe its
    return value) is left as traced."""
    changed = False
    for n in list(ep.graph.nodes):
        if n.op != "call_function" or n.target not in _IDENTITY_CASTS or not n.args:
            continue
        src = n.args[0]
        given = {**{a.name: v for a, v in zip(n.target._schema.arguments, n.args)}, **n.kwargs}
        if not isinstance(src, torch.fx.Node) or given.get("copy") or given.get("memory_format") not in (
                None, torch.preserve_format):
            continue
        a, b = n.meta.get("val"), src.meta.get("val")
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.device == b.device and a.shape == b.shape and a.stride() == b.stride()):
            continue
        path = _compat.module_path(n)
        if not path:
            continue

        def inside(user, path=path):
            p = _compat.module_path(user) if user.op == "call_function" else ""
            return p == path or p.startswith(path + ".")

        users = list(n.users)
        if not any(inside(u) for u in users):
            continue
        for u in users:
            if not inside(u):
                u.replace_input_with(n, src)
                changed = True
    if changed:
        ep.graph_module.recompile()


_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "xla", "ipu", "privateuseone")


def _ambient_autocast() -> list[str]:
    """The autocast contexts on here, as "torch.autocast('cpu', dtype=torch.bfloat16)" (empty: none)."""
    if not torch._C._is_any_autocast_enabled():
        return []
    on = []
    for device in _AUTOCAST_DEVICES:
        try:
            if torch.is_autocast_enabled(device):
                on.append(f"torch.autocast({device!r}, dtype={torch.get_autocast_dtype(device)})")
        except RuntimeError:  # a device type this build of torch does not know
            continue
    return on or ["torch.autocast"]


def _refuse_ambient_autocast(what: str) -> None:
    """A graph is built and run with no ambient autocast: under one, the engine's kernels would be cast
    where they are recomputed and not where values are cached, unlike eager under the same context."""
    on = _ambient_autocast()
    if not on:
        return
    raise ValueError(
        f"{what} under {' and '.join(on)}: a ReactiveGraph records the casts autocast makes only when the "
        "model's forward enters the context itself (they become ops of the graph, run exactly as eager); "
        "an ambient one around the build or a run would be applied only to the kernels recomputed (cached "
        "values stay as they are), a silent difference from eager. Put `with torch.autocast(...)` inside "
        "the forward and build again, or call outside the context")


def _without_hidden_stat_writes(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """``aten::instance_norm`` with ``use_input_stats`` (training, or ``track_running_stats=False``) and running
    statistics given writes them in place (ATen copies the batch's statistics into them) although its schema
    declares no mutation, so functionalization keeps it: every evaluation of the node wrote the module's
    buffers (the graph never writes them). Its output does not read them in that mode, so they are dropped
    from the call (the same kernels and bits for the output). A program that needs no change is returned as
    it is; one that does is copied first (a program the user passed stays untouched)."""
    def hidden_writes(n):
        return (n.op == "call_function" and n.target is torch.ops.aten.instance_norm.default
                and len(n.args) > 5 and n.args[5] is True and (n.args[3] is not None or n.args[4] is not None))

    if not any(hidden_writes(n) for n in ep.graph.nodes):
        return ep
    import copy

    ep = copy.deepcopy(ep)
    for n in ep.graph.nodes:
        if hidden_writes(n):
            n.args = n.args[:3] + (None, None) + n.args[5:]
    ep.graph_module.recompile()
    return ep


# Normalisations whose output does not read their running statistics when they use the batch's (training /
# use_input_stats, the argument at that index): op -> (flag index or None for always, the running statistics'
# argument indices, the outputs that do not read them, None for a single output).
_BATCH_STAT_OPS = {
    "aten::_native_batch_norm_legit_functional": (5, (3, 4), (0, 1, 2)),
    "aten::_batch_norm_with_update_functional": (None, (3, 4), (0, 1, 2, 3)),
    "aten::batch_norm": (5, (3, 4), None),
    "aten::instance_norm": (5, (3, 4), None),
}


def _stats_free(node: torch.fx.Node, index: int | None) -> tuple | None:
    """The argument indices of ``node`` (output ``index`` of it, None for a single output) that the value does
    not read: a batch-statistics normalisation's running statistics; None when it reads all."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    entry = _BATCH_STAT_OPS.get(node.target._schema.name)
    if entry is None:
        return None
    flag, stats, outputs = entry
    if flag is not None and not (len(node.args) > flag and node.args[flag] is True):
        return None
    if (outputs is None) != (index is None) or (outputs is not None and index not in outputs):
        return None
    return stats


def buffers_read_back(ep: torch.export.ExportedProgram) -> list[str]:
    """The buffers a functional program writes (BUFFER_MUTATION outputs) whose written value a later call's user
    output reads: the buffer's input reaches a user output, or reaches the written value of another buffer that
    does (a call counter in the computation, a running average returned, a cache). A buffer written and never
    read back into an output (a BatchNorm's running statistics in training mode, a counter nothing reads) is not
    listed."""
    sig = ep.graph_signature
    buffer_of = {s.arg.name: s.target for s in sig.input_specs if s.kind.name == "BUFFER"}
    reads: dict[torch.fx.Node, frozenset] = {}  # node -> the buffers whose input value it reads
    for n in ep.graph.nodes:
        if n.op == "placeholder":
            reads[n] = frozenset([buffer_of[n.name]]) if n.name in buffer_of else frozenset()
            continue
        if n.op == "output":
            continue
        source, index = n, None
        if n.target is _compat.GETITEM and isinstance(n.args[0], torch.fx.Node):
            source, index = n.args
        skip = _stats_free(source, index) or ()
        if source is not n and not skip:  # one output of a multi-output op: what the op reads
            reads[n] = reads.get(source, frozenset())
            continue
        found: set = set()
        for i, a in enumerate(source.args):
            if i not in skip:
                torch.fx.node.map_arg(a, lambda m: found.update(reads.get(m, ())))
        torch.fx.node.map_arg(source.kwargs, lambda m: found.update(reads.get(m, ())))
        reads[n] = frozenset(found)
    outs = list(ep.graph.output_node().args[0])
    live, written = set(), {}
    for node, spec in zip(outs, sig.output_specs):
        if not isinstance(node, torch.fx.Node):
            continue
        if spec.kind.name == "BUFFER_MUTATION":
            written[spec.target] = reads.get(node, frozenset())
        elif spec.kind.name in ("USER_OUTPUT", "LOSS_OUTPUT"):
            live |= reads.get(node, frozenset())
    grew = True
    while grew:  # a buffer whose input reaches a live buffer's written value is live too
        more = {b for target, feeds in written.items() if target in live for b in feeds} - live
        live |= more
        grew = bool(more)
    return [b for b in written if b in live]


def _refuse_writes_in_regions(ep: torch.export.ExportedProgram) -> None:
    """An in-place or out= op left inside a region export keeps as a higher-order op (a ``torch.no_grad()`` block:
    ``wrap_with_set_grad_enabled``), which functionalization does not reach. spectral_norm's training forward
    writes its power-iteration vectors into its ``_u`` and ``_v`` buffers there, and the next call reads them:
    the graph would drop the writes. Refused naming the op and the module (the engine refused it as "mutates its
    inputs; cached values need a functional graph", naming neither)."""
    for name, sub in ep.graph_module.named_modules():
        if not name or not isinstance(sub, torch.fx.GraphModule):
            continue
        for n in sub.graph.nodes:
            if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable:
                stack = list((n.meta.get("nn_module_stack") or {}).values())
                path, kind = stack[-1] if stack else ("", None)
                path = re.sub(r"^L__self__\.?", "", path) if isinstance(path, str) else ""
                kind = getattr(kind, "__name__", None) or (str(kind).rpartition(".")[2].strip("'>") if kind else "")
                where = f" of module '{path or '<root>'}'" + (f" ({kind})" if kind else "")
                raise ValueError(
                    f"ReactiveGraph: forward writes in place ({n.target._schema.name}) inside a torch.no_grad() block"
                    f"{where}, which the graph cannot carry: it never writes the module's state, while eager's next "
                    "call reads what such a block wrote (spectral_norm's power iteration updates its _u and _v buffers "
                    "in training mode). Put the module in a mode that does not write (model.eval()), or write out of "
                    "place")


def nn_params(module: torch.nn.Module) -> list:
    """Parameters and buffers by nn.Module's own walk (TransformerLens 4 overrides parameters())."""
    return list(torch.nn.Module.parameters(module)) + list(torch.nn.Module.buffers(module))


def _weights_fingerprint(module: torch.nn.Module) -> tuple:
    """Identity and version counter of every parameter and buffer: changes when any is replaced or
    written in place."""
    return tuple((t.data_ptr(), t._version) for t in nn_params(module))


_contents_digest = _module_state.contents_digest


_CALL = threading.local()


class _one_check_per_call:
    """One user-visible call (run, demand, value, sweep, a patching function): each graph compares the
    contents of what it reads at most once in it (a pass over every weight byte, ~20 ms on GPT-2 small),
    not again at each internal step (patching's graph lookup, sweep's, run's closing demand). A context
    manager (``with _one_check_per_call():``), written as a class: entered once per call, so it costs what
    a contextlib generator costs several times over in a sweep of small tensors."""

    __slots__ = ("depth",)

    def __enter__(self):
        depth = self.depth = getattr(_CALL, "depth", 0)
        if depth == 0:
            if torch._C._is_any_autocast_enabled():  # _ambient_autocast's own first test, without two calls
                _refuse_ambient_autocast("ReactiveGraph: called")
            _CALL.checked = set()  # ids of the graphs whose contents are known current in this call
        _CALL.depth = depth + 1

    def __exit__(self, *exc):
        depth = self.depth
        _CALL.depth = depth
        if depth == 0:
            _CALL.checked = set()
        return False


def _checked_in_this_call(rg) -> bool:
    return getattr(_CALL, "depth", 0) > 0 and id(rg) in _CALL.checked


def _mark_checked(rg) -> None:
    if getattr(_CALL, "depth", 0) > 0:
        _CALL.checked.add(id(rg))


def _input_versions(args, kwargs) -> tuple:
    """The version counters of the tensor inputs (None for an inference tensor, which has none)."""
    return tuple((None if t.is_inference() else t._version) for t in pytree.tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor))


def _shape_key(args, kwargs) -> tuple:
    """What a static export is specialised to: the shapes and dtypes of the tensor inputs, and every other
    input's value (``scale=2.0``, ``flag=True``: the trace computes with it as a constant). A plain ``None``
    for the latter let ``run(x, scale=3.0)`` compute with the graph traced at ``scale=2.0``, silently."""
    def leaves(tree) -> tuple:
        return tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else (type(x), repr(x))
                     for x in pytree.tree_leaves(tree))

    # Keywords by name: their order means nothing (run(x, shift=.., scale=..) is the same call).
    return leaves(args) + tuple(leaves(kwargs[k]) for k in sorted(kwargs))


def _rebind(ep: torch.export.ExportedProgram, module: torch.nn.Module, keep_state: bool = True):
    """A shallow copy of ``ep`` whose parameters and buffers are ``module``'s own (found by name), or
    None if some state of ``ep`` is not one of them. ``keep_state=False``: with no state at all (what
    the build cache keeps, so that it holds no model's weights)."""
    import copy

    own = {}
    for name, t in list(torch.nn.Module.named_parameters(module, remove_duplicate=False)) + \
            list(torch.nn.Module.named_buffers(module, remove_duplicate=False)):
        own.setdefault(_compat.respell_state_name(name), t)
    state, constants = {}, {}
    for spec in ep.graph_signature.input_specs:
        if spec.kind.name == "USER_INPUT":
            continue
        if keep_state and spec.kind.name == "CONSTANT_TENSOR" and spec.target not in own \
                and spec.target.rsplit(".", 1)[-1].startswith("lifted_tensor_") and spec.target in ep.constants:
            # A tensor made in forward (`mask[0, -1] = 1.0` lifts its scalar) is the trace's own, no model state:
            # it kept a program traced from a copy (a model with TransformerLens hook points) on the copy's
            # weights, so a later weight edit of the model was answered with the old weights by demand/value/sweep.
            constants[spec.target] = ep.constants[spec.target]
            continue
        if spec.target not in own or spec.kind.name not in ("PARAMETER", "BUFFER"):
            return None
        (state if spec.target in ep.state_dict else constants)[spec.target] = own[spec.target]
    out = copy.copy(ep)
    out._state_dict = state if keep_state else {}
    out._constants = constants if keep_state else {}
    return out


def _random_nodes(ep: torch.export.ExportedProgram) -> list[str]:
    """Nodes that draw from a random generator (dropout in training mode, rand, bernoulli, ...)."""
    out = []
    for n in ep.graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        if torch.Tag.nondeterministic_seeded in n.target.tags:
            # dropout(x, p, train=False), rrelu(x, training=False) (an RReLU in eval mode: the mean slope), p == 0
            # and attention with dropout_p == 0 draw nothing.
            bound = {a.name: (n.args[i] if i < len(n.args) else n.kwargs.get(a.name, a.default_value))
                     for i, a in enumerate(n.target._schema.arguments)}
            if bound.get("train") is False or bound.get("training") is False or bound.get("p") == 0 \
                    or bound.get("dropout_p", 1) == 0 and "dropout_p" in bound:
                continue
            out.append(f"%{n.name} ({n.target.name()})")
    return out


def _empty_like_type(t) -> torch.Tensor:
    """A zero tensor of an IR type ("tensor", dtype, sizes, strides, device): an example for export."""
    from .ir import _SHORT_DTYPE

    if t[0] != "tensor":
        raise TypeError(f"expected a tensor-valued node, got type {t[0]}")
    return torch.empty_strided(t[2], t[3], dtype=_SHORT_DTYPE[t[1]], device=t[4]).zero_()


def _cache_keys(module, example_inputs: tuple, example_kwargs: dict, options: tuple):
    """(in-process key, on-disk key, build_stats["cache"], build_stats["disk_cache"]) of a build. With the disk
    cache on, the portable key serves both caches (one walk); where it cannot be made, the in-process
    key alone."""
    disk_key, disk_state = None, "off"
    if _disk_cache.enabled():
        try:
            disk_key = _build_cache.fingerprint(module, example_inputs, example_kwargs, options, portable=True)
            return disk_key, disk_key, "miss", "miss"
        except _build_cache.Uncacheable as e:
            disk_state = f"uncacheable: {e}"
    try:
        return _build_cache.fingerprint(module, example_inputs, example_kwargs, options), None, "miss", disk_state
    except _build_cache.Uncacheable as e:
        return None, None, f"uncacheable: {e}", disk_state


_INPUT_KINDS = ("USER_INPUT", "PARAMETER", "BUFFER")


def _entry_of(program, built: Graph, hooks: dict, front_end: str, why) -> dict:
    """What a built graph needs besides its program: the input and output kinds with their state
    names, the pytree specs, hook names and the front end (the build caches' entry)."""
    sig = program.graph_signature
    return {"graph": built, "hooks": dict(hooks), "front_end": front_end, "fallback_reason": why, "env": {},
            "inputs": [(spec.kind.name, spec.target) for spec in sig.input_specs],
            "outputs": [(spec.kind.name, spec.target) for spec in sig.output_specs],
            "in_spec": program.call_spec.in_spec, "out_spec": program.call_spec.out_spec, "program": None}


def _bind_entry(entry: dict, module: torch.nn.Module) -> list | None:
    """The graph's input slots for ``module``: None for a user input, else the module's own parameter or
    buffer by name (read at every run, never stored). None if some input is not one of them."""
    own = {}
    for name, t in list(torch.nn.Module.named_parameters(module, remove_duplicate=False)) + \
            list(torch.nn.Module.named_buffers(module, remove_duplicate=False)):
        own.setdefault(_compat.respell_state_name(name), t)
    slots = []
    for kind, target in entry["inputs"]:
        if kind == "USER_INPUT":
            slots.append(None)
        elif kind in ("PARAMETER", "BUFFER") and target in own:
            slots.append(own[target])
        else:
            return None
    return slots


def _store_on_disk(key: str, entry: dict) -> str:
    """Writes ``entry`` to the disk cache; build_stats["disk_cache"]: "stored" or why not."""
    if any(kind not in _INPUT_KINDS for kind, _ in entry["inputs"]):
        return "not stored: the program has inputs that are not user inputs, parameters or buffers"
    text = str(entry["graph"])
    try:
        if str(Graph.parse(text)) != text:
            return "not stored: the graph's text form does not round-trip"
        specs = [pytree.treespec_dumps(entry[k]) if entry[k] is not None else None for k in ("in_spec", "out_spec")]
    except Exception as e:  # noqa: BLE001 (any failure only means: not stored)
        return f"not stored: {type(e).__name__}: {e}"
    body = {"graph": text, "hooks": entry["hooks"], "refused_hooks": entry["refused_hooks"],
            "unread_hooks": entry["unread_hooks"], "front_end": entry["front_end"],
            "fallback_reason": entry["fallback_reason"], "env": entry["env"],
            "inputs": [list(x) for x in entry["inputs"]],
            "outputs": [list(x) for x in entry["outputs"]], "in_spec": specs[0], "out_spec": specs[1]}
    return "stored" if _disk_cache.store(key, body) else "not stored: the cache folder could not be written"


def _cached_entry_from_disk(key: str) -> dict | None:
    """The disk entry of ``key`` as an in-process entry (graph parsed), or None (absent or corrupt)."""
    body = _disk_cache.load(key)
    if body is None:
        return None
    try:
        entry = {"graph": Graph.parse(body["graph"]), "hooks": dict(body["hooks"]),
                 "refused_hooks": {str(k): str(v) for k, v in body["refused_hooks"].items()},
                 "unread_hooks": {str(k): str(v) for k, v in body["unread_hooks"].items()}, "front_end": body["front_end"],
                 "fallback_reason": body["fallback_reason"],
                 "env": {str(k): None if v is None else str(v) for k, v in body["env"].items()},
                 "inputs": [(str(k), None if t is None else str(t)) for k, t in body["inputs"]],
                 "outputs": [(str(k), None if t is None else str(t)) for k, t in body["outputs"]],
                 "in_spec": None if body["in_spec"] is None else pytree.treespec_loads(body["in_spec"]),
                 "out_spec": None if body["out_spec"] is None else pytree.treespec_loads(body["out_spec"]),
                 "program": None}
        placeholders = [n for n in entry["graph"].nodes() if n.kind == "placeholder"]
        if len(placeholders) != len(entry["inputs"]) or any(k not in _INPUT_KINDS for k, _ in entry["inputs"]):
            raise ValueError("the inputs do not match the graph's placeholders")
    except Exception:  # noqa: BLE001 (a corrupt entry is rebuilt, never fatal)
        _disk_cache.corrupt(key)
        return None
    return entry


class Engine:
    """The reactive engine itself (csrc/reactive/engine.h) over an IR graph: what ReactiveGraph wraps for a
    module, for IR-level work and exact cost measurements (scripts/reproduce_paper.py, scripts/bench_sweep.py).

    ``Engine(graph)`` binds every node of an :class:`torch_ext.ir.Graph`. Nodes are named as in the graph:
    ``run(inputs)``, ``patch(node, value)``, ``restore()``, ``graft(src, dst, block, params)`` with an
    ``ir.Graph`` block, ``demand()``, ``value(node)``, ``begin_batch()``/``end_batch()``, ``stats()``,
    ``reset_stats()``, ``check_invariants()``; every other method of the C++ engine is reached as it is.
    """

    def __init__(self, graph: Graph):
        if not isinstance(graph, Graph):
            raise TypeError(f"Engine expects a torch_ext.ir.Graph, got {type(graph).__name__}")
        self._e = _C.Engine(graph._g)
        self._refuse: Callable | None = None

    @classmethod
    def _wrap(cls, engine: "_C.Engine", refuse: Callable | None = None) -> "Engine":
        """``refuse(node, what, graft=, dst=)`` raises for an edit its graph refuses (a ReactiveGraph's
        joint-edit rule): the edits made here are the ReactiveGraph's, under the same rule."""
        out = cls.__new__(cls)
        out._e, out._refuse = engine, refuse
        return out

    def _check_patch(self, node: str) -> None:
        if self._refuse is not None:
            self._refuse(node, "patch")

    def patch(self, node: str, value) -> None:
        self._check_patch(node)
        self._e.patch(node, value)

    def evaluate_patched(self, node: str, value) -> list:
        self._check_patch(node)
        return self._e.evaluate_patched(node, value)

    def evaluate_patched_rows(self, node: str, value, *args, **kwargs) -> list:
        self._check_patch(node)
        return self._e.evaluate_patched_rows(node, value, *args, **kwargs)

    def graft(self, src: str, dst: str, block: Graph, params: Sequence = ()) -> list[str]:
        """Splices ``block`` (one user input, one output) on the edge src -> dst; returns the new node names."""
        if self._refuse is not None:
            self._refuse(src, "graft after", graft=True, dst=dst)
        return self._e.graft(src, dst, block._g, list(params))

    @property
    def graph(self) -> Graph:
        """A copy of the engine's current graph (grafts included)."""
        return Graph(self._e.graph())

    def __getattr__(self, name: str):
        return getattr(self._e, name)

    def __str__(self) -> str:
        return str(self._e)


class ReactiveGraph:
    """A reactive cache over an exported graph.

    ``ReactiveGraph(model, example_inputs)`` exports ``model`` (an ``nn.Module``) with
    ``torch.export``; an ``ExportedProgram`` is used as it is. Every node keeps its value after
    :meth:`run`; :meth:`patch`, :meth:`restore` and :meth:`graft` invalidate exactly the affected
    cone, and :meth:`demand` recomputes only that.

    A model in training mode computes as its training forward does (a BatchNorm normalises with the batch's
    statistics), but the graph never writes the module's buffers: its running statistics stay as they were
    through the build, ``run()``, ``demand()`` and sweeps (an eager forward, and so a TransformerLens-style
    eager sweep, updates them at every call). A sweep is a measurement; it leaves the model as it found it.
    A forward that writes a buffer a later call's output reads (a call counter used in the computation, a
    running average returned, a KV cache) is refused at build (``ValueError`` naming the buffer and its module):
    eager's second call would differ from its first, the graph would not. Make such state an input, or put
    the module in a mode that does not write it.
    """

    #: How many batched cones (``sweep(..., batch_sites=True)``: one per site node and K, each holding
    #: K times its cone's values) are kept for reuse, and how many bytes of values they may hold in
    #: all (each counted by its graph's value types); the least recently used go first. A sweep whose
    #: (node, K) pairs do not all fit rebuilds its cones at every call (a C++ pass and a clean run
    #: each): with the count bound at 8, a batch_sites=True sweep and a batch_sites=4 sweep of the
    #: same 4-layer graph (14 pairs) evicted each other's cones, and each sweep cost 3-5x its warm time.
    max_batched_cones: int = 64
    max_batched_bytes: int = 1 << 30

    def __init__(self, ep_or_module, example_inputs: Sequence | None = None, *, cutoff: bool = False,
                 positions: bool = True, seq_dim: int = 1, split_heads: bool | int = False, front_end: str = "auto",
                 cache: bool = True, example_kwargs: dict | None = None):
        """``example_kwargs``: keyword inputs of the module's forward (a Hugging Face model's
        ``attention_mask``), traced with ``example_inputs``; later runs pass the same keywords
        (``rg.run(ids, attention_mask=mask)``).

        ``front_end`` picks the tracer of a module: "auto" (``make_fx``, falling back to
        ``torch.export`` wherever make_fx cannot vouch for its trace), "make_fx" (refuse instead of
        falling back) or "export". ``build_stats`` says which one built the graph, why make_fx was
        not used, and where the build time went.

        ``cache``: a module whose architecture, Python state and input shapes were built before in
        this process reuses that graph and binds its own weights (``torch_ext._build_cache``; off with
        ``cache=False`` or ``TORCH_EXT_BUILD_CACHE=0``). ``build_stats["cache"]`` is "hit", "miss",
        "off", or "uncacheable: <why>". A graph not in this process's cache is looked up in the on-disk
        cache (``torch_ext._disk_cache``: a fresh process then neither traces nor imports the tracers;
        off with ``TORCH_EXT_CACHE=0``, folder ``TORCH_EXT_CACHE_DIR``); ``build_stats["disk_cache"]`` is
        "hit", "stored", "miss", "unused" (found in this process), "off", "not stored: <why>" or
        "uncacheable: <why>". Parameters and buffers are never cached: each graph reads the module's own."""
        if front_end not in _compat.FRONT_ENDS:
            raise ValueError(f"ReactiveGraph: front_end must be one of {_compat.FRONT_ENDS}, got {front_end!r}")
        _refuse_ambient_autocast("ReactiveGraph: built")
        if example_kwargs is not None and not isinstance(example_kwargs, dict):
            raise TypeError(f"ReactiveGraph: example_kwargs must be a dict of keyword inputs, got "
                            f"{type(example_kwargs).__name__}")
        if example_kwargs and example_inputs is None:
            raise ValueError("ReactiveGraph: example_kwargs need example_inputs (give () for keyword inputs only)")
        example_kwargs = dict(example_kwargs or {})
        self._front_end = front_end
        self._cache = bool(cache)
        self._split_heads = split_heads
        t0 = time.perf_counter()
        key, entry, cache_state, disk_key, disk_state = None, None, "off", None, "off"
        self._program = None
        if isinstance(ep_or_module, torch.nn.Module):
            ep_or_module = _compat.uncompiled(ep_or_module)  # torch.compile(model): the graph is traced from it
            if example_inputs is None:
                raise ValueError("ReactiveGraph(module, example_inputs): example_inputs are required to export a module")
            self._module = ep_or_module
            self._attributes = _module_state.attributes(ep_or_module)  # what the trace reads (run() checks)
            self._no_kv_cache = _compat.kv_cache_left_out(ep_or_module, example_kwargs)
            if cache and _build_cache.enabled():
                key, disk_key, cache_state, disk_state = _cache_keys(ep_or_module, tuple(example_inputs),
                                                                     example_kwargs, (front_end, repr(split_heads)))
            if key is not None:
                entry = _build_cache.get(key)
                if entry is not None:
                    cache_state = "hit"
                    disk_state = "unused" if disk_key is not None else disk_state
                elif disk_key is not None:
                    entry = _cached_entry_from_disk(disk_key)
                    if entry is not None:
                        cache_state = disk_state = "hit"
                        _build_cache.put(key, entry)
            if entry is not None and _env_reads.changed(entry.get("env")):
                # Traced with other values of environment variables the forward reads: those are constants
                # of the graph, not in the key (read during the trace, known only after it): traced again.
                entry, cache_state = None, "miss"
                disk_state = "miss" if disk_key is not None else disk_state
            if entry is not None:
                binding = _bind_entry(entry, ep_or_module)
                if binding is None:  # cannot happen for an equal key; rebuild rather than guess
                    if disk_state == "hit":
                        _disk_cache.corrupt(disk_key)
                    entry, cache_state = None, "miss"
                    disk_state = "miss" if disk_key is not None else disk_state
                else:
                    used, why = entry["front_end"], entry["fallback_reason"]
            if entry is None:
                try:
                    with _env_reads.recording() as env_reads:
                        ep, used, why = _compat.trace_for_inference(ep_or_module, tuple(example_inputs),
                                                                    example_kwargs, front_end=front_end)
                except _compat.UnsoundTrace as e:
                    raise ValueError(f"ReactiveGraph(front_end='make_fx'): make_fx cannot trace this model soundly: "
                                     f"{e}; use front_end='auto' or 'export'") from None
        elif isinstance(ep_or_module, torch.export.ExportedProgram):
            if example_kwargs:
                raise ValueError("ReactiveGraph: example_kwargs are for a module; an ExportedProgram runs on "
                                 "rg.run(*args, **kwargs) as it was exported")
            self._module = None
            ep, used, why = ep_or_module, "program", None
            # Its non-tensor inputs are constants of the program: another value is refused at run(). (A
            # module's graph moves to a graph for the new value instead: _shape_key.)
            self._user_constants = _compat.user_input_constants(ep)
        else:
            raise TypeError(f"ReactiveGraph expects an nn.Module or an ExportedProgram, got {type(ep_or_module).__name__}")
        t1 = time.perf_counter()
        if entry is not None:
            self._hooks, built = dict(entry["hooks"]), entry["graph"]
            self._refused_hooks, self._unread_hooks = dict(entry["refused_hooks"]), dict(entry["unread_hooks"])
            self._slots = binding
            # A disk entry has no program: traced on first read of .program (never needed to run).
            self._program = _rebind(entry["program"], self._module) if entry.get("program") is not None else None
            self._conversions = {k: c for k, c in _compat.hook_conversions(self._module).items() if k in self._hooks}
        else:
            built = self._import(ep)
            if self._module is not None:
                # A program traced from a copy (TransformerLens models) computes with the module's own
                # tensors, as one traced from the module itself does: never with a stale copy.
                self.program = _rebind(self.program, self._module) or self.program
            entry = _entry_of(self.program, built, self._hooks, used, why)
            entry.update(refused_hooks=dict(self._refused_hooks), unread_hooks=dict(self._unread_hooks))
            entry["env"] = dict(env_reads) if self._module is not None else {}
            state = {**self.program.state_dict, **self.program.constants}
            self._slots = [None if kind == "USER_INPUT" else state[target] for kind, target in entry["inputs"]]
        self._env = dict(entry.get("env") or {})  # environment variables the forward read, as traced
        t2 = time.perf_counter()
        # A cached graph passed the verifier's meta-kernel inference when it was built (same torch and
        # torch_ext: both in the key); skipping it spares a fresh process loading Python meta kernels.
        self._engine = _C.Engine(built._g, infer_results=cache_state != "hit")
        if key is not None and cache_state == "miss":  # cached once the engine accepted it
            program = _rebind(self.program, self._module, keep_state=False)
            if program is not None:
                entry["program"] = program
                _build_cache.put(key, entry)
                if disk_key is not None:
                    disk_state = _store_on_disk(disk_key, entry)
            else:
                cache_state = disk_state = ("uncacheable: the program holds tensors that are not the module's "
                                            "parameters or buffers")
        t3 = time.perf_counter()
        self._engine.set_cutoff(bool(cutoff))
        if not isinstance(seq_dim, int) or isinstance(seq_dim, bool) or seq_dim < 0:
            raise ValueError(f"ReactiveGraph: seq_dim must be a non-negative int, got {seq_dim!r}")
        # Token-granular cones (csrc/passes/sequence_axis.h): a patch that changes rows [p, T) of a
        # node's sequence axis recomputes only those rows wherever the analysis allows.
        self._positions, self._seq_dim = bool(positions), seq_dim
        self._engine.set_positions(self._positions, seq_dim)
        self._num_user = sum(s is None for s in self._slots)  # not list.count: Tensor == None costs ~20 us each
        self._in_spec, self._out_spec = entry["in_spec"], entry["out_spec"]
        kinds = [kind for kind, _ in entry["outputs"]]
        self._user_outputs = [i for i, k in enumerate(kinds) if k == "USER_OUTPUT"]
        # A joint program's outputs are the loss and the parameter gradients (no user outputs).
        self._loss_output = kinds.index("LOSS_OUTPUT") if "LOSS_OUTPUT" in kinds else None
        self._grad_outputs = [(i, target) for i, (kind, target) in enumerate(entry["outputs"])
                              if kind == "GRADIENT_TO_PARAMETER"]
        single = (self._loss_output is None and len(self._user_outputs) == 1 and self._out_spec is not None
                  and self._out_spec.is_leaf())
        self._single_output = self._user_outputs[0] if single else None
        nodes = self.graph.nodes()
        self._module_paths = {n.name: n.module_path for n in nodes}
        self._countable = [n.name for n in nodes if n.kind == "call"]
        self._all_names = {n.name for n in nodes}  # _node_names(), from this walk (graph.nodes() costs ms)
        self._example_inputs = tuple(example_inputs) if example_inputs is not None else None
        self._example_kwargs = example_kwargs
        self._last_inputs = None
        # (node, k) -> the node's cone K times over, least recently used first; bounded (each holds K
        # times its cone's values) by max_batched_cones.
        self._batched: collections.OrderedDict[tuple, "_BatchedCone"] = collections.OrderedDict()
        self._grafts: list[tuple] = []  # (src, dst, block, new names): replayed on other shapes' graphs
        self._graft_tensors: list = []  # the grafted blocks' parameters and buffers (every shape's graph reads them)
        self._grafts_applied = 0
        self._cutoff = bool(cutoff)
        # One graph per input shape (static export): other shapes build, or reuse, their own.
        self._shape = _shape_key(tuple(example_inputs), example_kwargs) if example_inputs is not None else None
        self._variants: dict = {}
        self._shape_stats = {"graph_builds": 1, "graph_reuses": 0}
        # Programs exported from a copy (TransformerLens models) do not see later weight changes: run()
        # refuses to compute on stale weights instead of answering with them.
        self._weights_fp = None
        if self._module is not None and self._program is not None:
            own = {id(t) for t in list(nn_params(self._module))}
            if any(id(v) not in own for v in self._program.state_dict.values()):
                self._weights_fp = _weights_fingerprint(self._module)
        changed = []
        if self._module is not None:
            changed = _module_state.traced_changes(self._module, self._attributes)
            self._attributes = _module_state.attributes(self._module)  # what the graph was traced with
            self._global_reads = _module_state.global_reads(self._module)  # module-level values it read
            self._hook_snapshot = _module_state.Hooks(self._module)  # forward hooks the graph holds
        if changed:  # forward changed Python state while being traced: the graph holds one value of it
            raise TypeError("ReactiveGraph: forward changes module attributes the graph would hold fixed: "
                            + ", ".join(f"{_module_state.describe(p, k)} {a!r} -> {b!r}" for p, k, a, b in changed[:4])
                            + "; keep such state in a buffer (register_buffer) or outside the model")
        t4 = time.perf_counter()
        if example_inputs is not None:
            self.run(*example_inputs, **example_kwargs)
        # Seconds: trace (make_fx or export), import (functionalize, hook names, IR), bind (kernels),
        # first run; "other" is the rest of the constructor.
        self.build_stats = {"front_end": used, "fallback_reason": why, "cache": cache_state, "disk_cache": disk_state,
                            "trace_s": t1 - t0, "import_s": t2 - t1,
                            "bind_s": t3 - t2, "other_s": t4 - t3, "first_run_s": time.perf_counter() - t4}

    @property
    def program(self) -> torch.export.ExportedProgram:
        """The program the graph was imported from. A graph from the on-disk cache has none until this is
        first read: it is traced then (the graph itself is the stored one; running never needs this)."""
        if self._program is None and self._module is not None:
            ep, _, _ = _compat.trace_for_inference(self._module, tuple(self._example_inputs), self._example_kwargs,
                                                   front_end=self._front_end)
            ep = _functional_program(ep)
            _compat.strip_hook_points(ep)
            self._program = _rebind(ep, self._module) or ep
        return self._program

    @program.setter
    def program(self, ep) -> None:
        self._program = ep

    def _import(self, ep) -> Graph:
        """Functionalizes ``ep``, reads its hook names, refuses random ops, imports it to the IR (and
        splits attention heads on request); sets program, _hooks, _conversions."""
        self.program = _functional_program(ep)
        self._refuse_state_read_back(self.program)
        _refuse_writes_in_regions(self.program)
        # Hook names (TransformerLens hook points) -> node names; aliases such as hook_resid_pre included.
        self._hooks = _compat.strip_hook_points(self.program)
        self._conversions: dict = {}
        # A Hugging Face decoder's names were chosen by module names: kept only where the graph shows what
        # TransformerLens promises for them (_hook_proof); the others answer why when asked for.
        self._refused_hooks: dict = {}
        decoder = _compat._hf_decoder(self._module) if self._module is not None and self._hooks else None
        if decoder is not None:
            self._refused_hooks = _hook_proof.verify(self.program.graph, self._hooks, len(decoder[0]),
                                                     type(self._module).__name__, decoder[1])
        if self._module is not None and self._hooks:
            for alias, canonical in _compat.hook_aliases(self._module).items():
                if canonical in self._hooks:
                    self._hooks.setdefault(alias, self._hooks[canonical])
            self._conversions = {k: c for k, c in _compat.hook_conversions(self._module).items() if k in self._hooks}
        random = _random_nodes(self.program)
        if random:
            # A cached value of a random op is one draw; a recomputed cone draws again, so a sweep would
            # mix noise into every metric. TransformerLens refuses training mode for the same reason.
            raise ValueError(
                f"ReactiveGraph: the program draws random numbers at {', '.join(random[:4])}"
                f"{' and %d more' % (len(random) - 4) if len(random) > 4 else ''}; patching sweeps need a "
                "deterministic model (is it in training mode with dropout? call model.eval() first)")
        built = Graph.from_exported(self.program)
        if self._split_heads is not False:
            self._split_attention_heads(built, self._split_heads)
        # A hook point whose value nothing reads (a RoPE bridge's rotary_emb.hook_in): the engine drops its alias as
        # dead code. {its node: the source node it observes}.
        program_nodes = {n.name: n for n in self.program.graph.nodes}
        self._unread_hooks = {}
        for node in set(self._hooks.values()):
            n = program_nodes.get(node)
            if n is not None and n.op == "call_function" and n.target is torch.ops.aten.alias.default and not n.users:
                self._unread_hooks[node] = n.args[0].name
        return built

    def _refuse_state_read_back(self, program) -> None:
        """The graph never writes the module's buffers (a sweep is a measurement). A buffer forward writes and
        a later call's output reads (a call counter in the computation, a running average returned, a KV cache)
        makes eager's second call differ from its first, while the graph would answer the first call's value
        forever: refused, naming the buffer and its module."""
        read_back = buffers_read_back(program)
        if not read_back:
            return
        described = []
        for target in read_back:
            path, _, attr = target.rpartition(".")
            owner = None
            if self._module is not None:
                try:
                    owner = self._module.get_submodule(path)
                except AttributeError:
                    owner = None
            kind = f" ({type(owner).__name__})" if owner is not None else ""
            described.append(f"buffer '{attr}' of module '{path or '<root>'}'{kind}")
        more = f" (and {len(described) - 1} more: {', '.join(read_back[1:4])})" if len(described) > 1 else ""
        raise ValueError(
            f"ReactiveGraph: forward writes {described[0]}{more}, and a later call's output reads the written value: "
            "eager's next call computes with the new value, while the graph never writes the module's buffers and "
            "would keep answering with the value it was built with. Make the state an input of forward (pass it in, "
            "return the new value), or put the module in a mode whose forward does not write it (e.g. .eval() or a "
            "flag); a buffer written and never read back into an output (BatchNorm's running statistics in "
            "training mode) is accepted and left unwritten")

    _PER_SHAPE = ("_program", "build_stats", "_env", "_hooks", "_refused_hooks", "_unread_hooks", "_conversions", "_engine", "_slots", "_num_user",
                  "_in_spec",
                  "_single_output", "_cone_sizes", "_all_names", "_sweep_plans",
                  "_out_spec", "_user_outputs", "_loss_output", "_grad_outputs", "_module_paths", "_countable",
                  "_countable_cache", "_batched", "_last_inputs", "_example_inputs", "_example_kwargs",
                  "_grafts_applied")

    def _split_attention_heads(self, built: Graph, split_heads) -> None:
        """split_heads=True (heads from the model's config) or an int: each block's attention output
        projection becomes per-head results plus a sum (csrc/passes/split_heads.h), addressed as
        ``blocks.<l>.attn.hook_result`` ([batch, pos, head, d_model], TransformerLens's layout)."""
        if isinstance(split_heads, bool):
            heads = _compat.attention_heads(self._module) if split_heads else None
            if heads is None:
                raise ValueError("ReactiveGraph(split_heads=True): the number of heads is not known for this model "
                                 "(no TransformerLens cfg.n_heads or Hugging Face num_attention_heads); pass "
                                 "split_heads=<heads>")
        elif isinstance(split_heads, int) and split_heads > 0:
            heads = split_heads
        else:
            raise ValueError(f"ReactiveGraph: split_heads must be True, False or a positive int, got {split_heads!r}")
        z_hooks = sorted((h for h in self._hooks if h.startswith("blocks.") and h.endswith(".attn.hook_z")),
                         key=lambda h: int(h.split(".")[1]))
        if not z_hooks:
            raise ValueError("ReactiveGraph(split_heads=...): the model has no blocks.<l>.attn.hook_z sites to split "
                             "(TransformerLens bridges and Hugging Face GPT-2/Llama decoders have them)")
        sites = [(self._hooks[h], heads) for h in z_hooks]
        renamed = {}
        for h, (result, output, replaced) in zip(z_hooks, _C.split_heads(built._g, sites)):
            self._hooks[h[: -len("hook_z")] + "hook_result"] = result
            renamed[replaced] = output
        for h, node in list(self._hooks.items()):  # hooks on a replaced projection now name its new output
            if node in renamed:
                self._hooks[h] = renamed[node]

    def _refuse_during_sweep(self, what: str) -> None:
        if getattr(self, "_sweeping", False):
            raise RuntimeError(f"{what} is not allowed while a sweep runs on this graph (from a patch function or "
                               "metric); a sweep leaves the graph as it found it")

    def _refuse_other_hook_name(self, name: str, node: str, what: str, pinned: bool = True) -> None:
        """Two hook points in a row (``hook_pre(hook_post(x))``: a block's ``hook_resid_post`` and the next one's
        ``hook_resid_pre``) address one node of the graph. A patch made through one of them is, in eager, seen by
        the other only downstream of it: reading, patching or sweeping the other name while that patch stands has
        no single answer in one node (a sweep at hook_post with hook_pre pinned answered 1.207 where eager gives
        -0.287, silently). Refused, naming both, until the patch is restored. ``pinned=False``: the graft's
        refusal only (a read with no patch active, baseline())."""
        grafted_as = self.__dict__.get("_graft_hook_names", {}).get(node)
        if grafted_as is not None and grafted_as != name and name in self._hooks:
            # A node-form graft made through one of the two names: in eager, the hook that runs after it sees the
            # block's output, the one before it the value before the block, while both names address the node,
            # before the block (a sweep at blocks.1.hook_resid_pre after a graft at blocks.0.hook_resid_post
            # answered 1.745 where eager gives 1.322 on GPT-2, silently). A graft stands, so this does too.
            raise ValueError(f"{what}: hooks '{name}' and '{grafted_as}' are two hook points in a row and address one "
                             f"node ('{node}') of the graph, and a block was grafted through '{grafted_as}': in eager "
                             f"one of them sees the block's output, which one node cannot hold. Use '{grafted_as}' "
                             f"(the value before the block), or the block's output node")
        pinned_as = self.__dict__.get("_pin_names", {}).get(node) if pinned else None
        if pinned_as is None or pinned_as == name or name not in self._hooks or pinned_as not in self._hooks:
            return
        if node not in self._engine.pinned():
            return
        raise ValueError(f"{what}: hooks '{name}' and '{pinned_as}' are two hook points in a row and address one "
                         f"node ('{node}') of the graph, and '{pinned_as}' is patched: in eager each would see the "
                         f"other's patch only downstream of it, which one node cannot hold. Use '{pinned_as}', or "
                         f"restore('{pinned_as}') first")

    def _refuse_read_in_metric(self, what: str) -> None:
        """A sweep's metric sees the site's patched outputs, but the graph itself holds the clean values (the
        per-site transaction runs beside the cache, in C++ or on row buffers): a value() or demand() from the
        metric answered the unpatched graph, silently unlike eager's hooked run. Refused, naming the way."""
        if getattr(self, "_in_metric", False):
            raise RuntimeError(f"{what} from a sweep's metric would read the graph without the site's patch (the "
                               "metric is handed the patched outputs only): read inner nodes outside the sweep "
                               "(rg.patch(...); rg.value(node); rg.restore()), or make them outputs of the model")

    def _switch_shape(self, key, args, kwargs) -> None:
        """Moves to the graph for another input shape: reused if built before, else exported now;
        grafts made so far are replayed on it. Refused while patches are active."""
        if self._engine.pinned():
            raise ValueError(f"run: these inputs have other shapes (or non-tensor values) than the graph's ({key} vs "
                             f"{self._shape}) while "
                             f"patches are active at {self._engine.pinned()}; restore() first")
        self._variants[self._shape] = {a: getattr(self, a, None) for a in self._PER_SHAPE}
        saved = self._variants.get(key)
        if saved is not None:
            for a, v in saved.items():
                setattr(self, a, v)
            self._shape_stats["graph_reuses"] += 1
        else:
            fresh = ReactiveGraph(self._module, args, cutoff=self._cutoff, positions=self._positions,
                                  seq_dim=self._seq_dim, split_heads=self._split_heads, front_end=self._front_end,
                                  cache=self._cache, example_kwargs=kwargs)
            for a in self._PER_SHAPE:
                setattr(self, a, getattr(fresh, a, None))
            self._grafts_applied = 0
            self._shape_stats["graph_builds"] += 1
        self._shape = key
        # set_cutoff / set_positions hold for the graph, not one shape's engine: a reused engine kept the setting
        # it had when it was left, and a new one was built with the constructor's cutoff.
        self._engine.set_cutoff(self._cutoff)
        self.set_positions(self._positions)
        self._grafts_applied = _replay_grafts(self, self._grafts, self._grafts_applied, f"the graph for shape {key}",
                                              RuntimeError)

    # ---- evaluation
    def _flat_inputs(self, args, kwargs):
        flat = _compat.user_input_leaves(args, kwargs, self._in_spec, getattr(self, "_user_constants", None))
        it = iter(None if isinstance(v, str) else v for v in flat)  # a string input is a constant: ir.from_fx
        return [next(it) if s is None else s for s in self._slots]

    def _user(self, outs):
        if self._single_output is not None:
            return outs[self._single_output]  # the common case, without a pytree round trip per site
        if self._loss_output is not None and not self._user_outputs:
            # Training mode: (loss, {parameter name: gradient}).
            return outs[self._loss_output], {name: outs[i] for i, name in self._grad_outputs}
        out = pytree.tree_unflatten([outs[i] for i in self._user_outputs], self._out_spec)
        if getattr(self, "_no_kv_cache", None):
            _mark_no_kv_cache(out, self._no_kv_cache)
        return out

    def run(self, *args, **kwargs):
        """Full evaluation (N evaluations); becomes the baseline. Returns the outputs.

        Inputs of another shape (a longer prompt) move to that shape's graph, exported on first use
        and reused after (``stats["graph_builds"]``, ``stats["graph_reuses"]``); grafts are replayed.
        Refused while patches are active: a new baseline would drop them (the outputs would be the
        unpatched ones, where a forward hook would still act), so restore() first and patch again.
        """
        with _one_check_per_call():
            return self._run(args, kwargs)

    def _run(self, args, kwargs):
        self._refuse_during_sweep("run()")
        pinned = self._engine.pinned()
        if pinned:
            raise ValueError(f"run: patches are active at {pinned}; run() computes a new clean baseline, which would "
                             "drop them (the outputs would be unpatched, where a forward hook would still act): "
                             "restore() first, then patch again on the new inputs")
        if self._weights_fp is not None and _weights_fingerprint(self._module) != self._weights_fp:
            raise ValueError("run: the model's weights changed since this ReactiveGraph was built, and it computes "
                             "with a copy of them (TransformerLens models are exported from a copy); build a new "
                             "ReactiveGraph (torch_ext.patching does so by itself)")
        self._refuse_changed_hooks("run")
        self._refuse_changed_attributes("run")
        if self._module is not None and self._shape is not None:
            key = _shape_key(args, kwargs)
            if key != self._shape:
                self._switch_shape(key, args, kwargs)
        flat = self._flat_inputs(args, kwargs)
        self._engine.run(flat)
        self._note_contents(flat)
        self._last_inputs = (args, kwargs)
        self._last_input_versions = _input_versions(args, kwargs)
        # The inputs were digested with the weights just now: their digests are reused, not taken again.
        known = {id(t): d for t, d in zip(*self._contents)}
        leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        rest = iter(_contents_digest([t for t in leaves if id(t) not in known]))
        self._last_input_digest = [known[id(t)] if id(t) in known else next(rest) for t in leaves]
        return self.demand()

    def _note_contents(self, flat: list) -> None:
        """Digests of the inputs, parameters, buffers and constants the graph reads (``flat``: the inputs as
        the engine was run on them), as its values were computed. Tensors already digested in this call
        (patching checked the weights, then runs new tokens) keep their digest: only the rest is read."""
        held = [t for t in flat if isinstance(t, torch.Tensor)] + self._graft_tensors
        known = {}
        if _checked_in_this_call(self) and getattr(self, "_contents", None) is not None:
            known = {id(t): d for t, d in zip(*self._contents)}  # the old tensors are alive: ids are unique
        fresh = [t for t in held if id(t) not in known]
        it = iter(_contents_digest(fresh))
        self._contents = (held, [known[id(t)] if id(t) in known else next(it) for t in held])
        _mark_checked(self)

    def _take_untracked_writes(self) -> None:
        """An input, parameter or buffer written where its version counter does not move (``W.data.mul_(2)``,
        ``W.data[i] = 0``, ``W.numpy()[...] = ...``: ``.data`` is a tensor with a version counter of its
        own) is an edit the engine cannot see (I15 goes by version): the outputs cached from the old
        weights were handed out again, silently. Compared by content here (once per sweep: a pass over
        the weights, less than one forward reads), and a changed tensor's version is moved, so the engine
        takes it as the edit it is and recomputes its cone."""
        held, digest = getattr(self, "_contents", (None, None))
        if held is None or _checked_in_this_call(self):
            return
        now = _contents_digest(held)
        if now == digest:  # the common case: one list comparison, in C
            _mark_checked(self)
            return
        changed = [t for t, a, b in zip(held, digest, now) if a != b]
        for t in changed:
            if t.is_inference():
                raise ValueError("the model's weights were written in place without moving their version counter "
                                 "(through .data, or an inference tensor); run() again to recompute with them")
            torch.autograd.graph.increment_version(t)
        self._contents = (held, now)
        _mark_checked(self)

    def _ran_on(self, *args, **kwargs) -> bool:
        """Whether the cached values are those of these very inputs: the same objects, not written since the
        last run (an input edited in place keeps its identity; its version counter moves, or, written through
        ``.data`` or ``.numpy()``, its contents change)."""
        if self._last_inputs is None:
            return False
        last_args, last_kwargs = self._last_inputs
        same = (len(last_args) == len(args) and all(x is y for x, y in zip(last_args, args))
                and last_kwargs.keys() == kwargs.keys() and all(last_kwargs[k] is kwargs[k] for k in kwargs))
        versions = _input_versions(args, kwargs)
        if not (same and None not in versions and versions == getattr(self, "_last_input_versions", None)):
            return False
        # Written through .data or .numpy() (the version counter stays): the contents tell. Digests taken earlier
        # in this call (patching compares the graph's reads, these inputs among them, first) are reused.
        known = {}
        if _checked_in_this_call(self) and getattr(self, "_contents", None) is not None:
            known = {id(t): d for t, d in zip(*self._contents)}
        leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        rest = iter(_contents_digest([t for t in leaves if id(t) not in known]))
        return [known[id(t)] if id(t) in known else next(rest) for t in leaves] == getattr(self, "_last_input_digest", None)

    def _refuse_changed_attributes(self, where: str) -> None:
        """A module attribute the trace read (a LayerNorm eps, a config flag) changed since the build: eager
        calls use the new value, the graph holds the old one. Refused at run() and demand() alike (a sweep
        demands first), not only at run(): a graph demanded or swept without a new run was silently stale."""
        env = _env_reads.changed(getattr(self, "_env", None))
        if env:
            raise ValueError(f"{where}: {_env_reads.message(env, 'this ReactiveGraph was built')}: build a new "
                             "ReactiveGraph after changing it, or change it back")
        changed = _module_state.changed(getattr(self, "_attributes", ())) \
            or _module_state.changed(getattr(self, "_global_reads", ()))
        if changed:
            raise ValueError(f"{where}: {_module_state.change_message(changed, 'this ReactiveGraph was built')}; the "
                             "graph holds the value it was traced with, eager calls would use the new one: build a "
                             "new ReactiveGraph after changing it, or change it back")
        for src, kind, (attrs, reads, _) in getattr(self, "_graft_snapshots", ()):
            changed = _module_state.changed(attrs) or _module_state.changed(reads)
            if changed:
                text = _module_state.change_message(changed, "it was grafted")
                text = "block" + text[len("model"):] if text.startswith("model") else text
                raise ValueError(f"{where}: the block grafted after {src!r} ({kind}) changed: {text}; the graph holds "
                                 "the block as it was exported at the graft, and a graph for another input shape would "
                                 "export it again as it is now: graft a new block (on a new ReactiveGraph) after "
                                 "changing it, or change it back")

    def _refuse_changed_state(self, where: str) -> None:
        """What demand() refuses, refused by the other reads too: value(), values() and baseline() answered with
        the graph as traced after a forward hook or a traced attribute had changed, where eager (and demand)
        would not."""
        self._refuse_changed_hooks(where)
        self._refuse_changed_attributes(where)

    def _refuse_changed_hooks(self, where: str) -> None:
        """A forward hook registered on the module after the build would run in eager calls, never in the
        graph (and one removed would still act in it): refused, as a changed attribute is."""
        if where != "run" and self._weights_fp is not None and _weights_fingerprint(self._module) != self._weights_fp:
            # Not run() alone: demand, value and sweep on a copy's weights answered with the old ones silently.
            raise ValueError(f"{where}: the model's weights changed since this ReactiveGraph was built, and it "
                             "computes with a copy of them (a model with TransformerLens hook points is exported from "
                             "a copy); build a new ReactiveGraph (torch_ext.patching does so by itself)")
        snapshot = getattr(self, "_hook_snapshot", None)
        change = snapshot.message("this ReactiveGraph was built") if snapshot is not None else None
        if change:
            raise ValueError(f"{where}: {change}; build a new ReactiveGraph after changing hooks, or change them back")
        # A grafted block's hooks were exported with it: one registered or removed since acts in eager, not here
        # (and a graph for another input shape, which exports the block again, would disagree with this one).
        for src, kind, (_, _, hooks) in getattr(self, "_graft_snapshots", ()):
            change = hooks.message("it was grafted")
            if change:
                change = change.replace("the model (", "the block (")
                raise ValueError(f"{where}: the block grafted after {src!r} ({kind}) changed: {change}; graft a new "
                                 "block (on a new ReactiveGraph) after changing its hooks, or change them back")

    def demand(self, reads=None):
        """The outputs, recomputing only stale nodes.

        The returned tensors are the cached values themselves: do not write into them. A write is
        detected (by the tensor's version counter) at the next read, which raises naming the node
        and marks it for recomputation.

        ``reads`` (as in :func:`sweep`) declares what the caller reads. With token-granular cones on,
        one standing patch (of a node with a sequence axis) and nothing else stale, only the rows
        (and columns) that reach the reads are computed, into fresh tensors (the rest NaN), and
        nothing is cached: the patch's cone stays stale, so a later plain ``demand()`` recomputes
        it. Otherwise this is a plain demand.

        Weights and inputs written where no version counter moves (``W.data.mul_(2)``, ``x.numpy()[:] =
        ...``) are found by content (one pass over every byte they hold, ~20 ms on GPT-2 small's 124M
        parameters, once per call) and their cones recomputed, as for any in-place edit.
        """
        self._refuse_read_in_metric("demand()")
        with _one_check_per_call():
            self._take_untracked_writes()
            return self._demand(reads)

    def _demand(self, reads):
        self._refuse_changed_hooks("demand")
        self._refuse_changed_attributes("demand")
        eng = self._engine
        if reads is not None and self._positions and not getattr(self, "_sweeping", False) \
                and not eng.in_transaction() and len(eng.pinned()) == 1:
            node = eng.pinned()[0]
            spec = self._read_spec(reads)
            if eng.seq_axis(node) >= 0:
                value = eng.value(node)
                eng.restore()  # zero evaluations: back to the baseline, then the patch as rows
                try:
                    if eng.can_evaluate_patched_rows():
                        return self._user(eng.evaluate_patched_rows(node, value, *spec))
                finally:
                    eng.patch(node, value)
        return self._user(eng.demand())

    def value(self, node: str) -> torch.Tensor:
        """A node's current value, recomputing only its stale ancestors (a node or hook name). Writes that
        move no version counter are found by content first, as at :meth:`demand` (one pass over the
        weights per call: read many nodes through :meth:`run_with_cache`'s cache, checked once).

        A hook name gives the hook's layout, the one :meth:`run_with_cache` and TransformerLens give
        (``blocks.<l>.attn.hook_z`` as [batch, pos, head, d_head]); a node name gives the node's own layout
        (hook_z's node holds [batch, pos, head * d_head])."""
        self._refuse_read_in_metric(f"value({node!r})")
        with _one_check_per_call():
            self._refuse_changed_state("value")
            self._take_untracked_writes()
            read = self._read_node(node)
            self._refuse_other_hook_name(node, read, f"value({node!r})")
            return self._as_hook(node, self._engine.value(read))

    def values(self, nodes: Iterable[str]) -> dict[str, torch.Tensor]:
        """{name: current value} for many nodes or hook names, as :meth:`value` gives each, with the weights
        and inputs compared by content once for all of them instead of once per name (~20 ms on GPT-2
        small: reading every node of a model one :meth:`value` at a time paid that per node). Hook names
        give the hook's layout, node names the node's, as at :meth:`value`."""
        names = list(nodes)
        for name in names:
            if not isinstance(name, str):
                raise TypeError(f"values: expected node or hook names (str), got {type(name).__name__} {name!r}")
        self._refuse_read_in_metric("values()")
        with _one_check_per_call():
            self._refuse_changed_state("values")
            self._take_untracked_writes()
            reads = {name: self._read_node(name) for name in names}
            for name, read in reads.items():
                self._refuse_other_hook_name(name, read, f"values([{name!r}, ...])")
            return {name: self._as_hook(name, self._engine.value(reads[name])) for name in names}

    def gradient(self, metric: Callable, nodes: str | Iterable[str]):
        """d metric(outputs) / d value(node) at the graph's current values (standing patches included), as eager
        autograd gives it with ``retain_grad()`` on the activations: the tensor for one node or hook name, or
        {name: tensor} for several (attribution patching: ``((corrupt - clean) * grad).sum()`` estimates every
        patch of a node at once). ``metric`` gets the outputs as :meth:`demand` returns them and returns one
        floating-point value. A hook name gives the gradient in the hook's layout, as :meth:`value` gives the
        value; a node downstream of another one asked for is differentiated through (the upstream gradient is
        the total derivative); a patched node is a constant (gradients flow around it). Only the requested
        nodes' cone is re-run, with autograd, beside the cache (``torch_ext/_gradient.py``); the cache and
        ``stats`` are left as they were."""
        from . import _gradient
        self._refuse_read_in_metric("gradient()")
        self._refuse_during_sweep("gradient()")
        if self._loss_output is not None:
            raise ValueError("gradient: this graph is a joint forward+backward program (its outputs are the loss and "
                             "the parameter gradients); take activation gradients on the forward graph: "
                             "ReactiveGraph(model, inputs) without loss_fn")
        one = isinstance(nodes, str)
        names = [nodes] if one else list(nodes)
        if not names:
            raise ValueError("gradient: no nodes given")
        with _one_check_per_call():
            self._refuse_changed_state("gradient")
            self._take_untracked_writes()
            result = _gradient.gradients(self, metric, names)
        return result[nodes] if one else result

    def baseline(self, node: str) -> torch.Tensor:
        """A node's value with no patch active (from the overlay; evaluates only what an edit of the
        weights or inputs, found as at :meth:`value`, made stale). A hook name gives the hook's layout, a node
        name the node's, as at :meth:`value`."""
        with _one_check_per_call():
            self._refuse_changed_state("baseline")
            self._take_untracked_writes()
            node_name = self._read_node(node)
            # After a graft through the other of two hook names in a row this one is, in eager, the block's
            # output or the value before it: refused as value() refuses it (it answered the value before).
            self._refuse_other_hook_name(node, node_name, f"baseline({node!r})", pinned=False)
            value = _cached_baseline(self._engine, node_name)
            if value is None:  # displaced by a graft or weight edit under standing patches: see _patch_fn_value
                with self._patches_lifted():
                    value = self._engine.value(node_name)
            return self._as_hook(node, value)

    def resolve(self, name: str) -> str:
        """The node a name addresses: a node name, or a hook name (``blocks.0.hook_resid_pre``). A hook name
        that is not offered (its promise does not hold in the graph: _hook_proof), or whose value nothing
        reads, is refused, saying why."""
        node = self._hooks.get(name)
        if node is None:
            self._refuse_hook(name)
            return name
        if node in self._unread_hooks:
            raise ValueError(f"hook '{name}' addresses nothing in the graph: nothing reads its value (its marker "
                             f"'{node}' was dropped as dead code), so patching it would change no output; its "
                             f"value is its source's, node '{self._unread_hooks[node]}': patch or read that")
        return node

    def _read_node(self, name: str) -> str:
        """The node whose value a name reads: as :meth:`resolve`, and a hook nothing reads gives its source's."""
        node = self._hooks.get(name)
        if node is not None and node in self._unread_hooks:
            return self._unread_hooks[node]
        return self.resolve(name)

    def _refuse_hook(self, name) -> None:
        why = self.__dict__.get("_refused_hooks", {}).get(name)
        if why is not None:
            raise ValueError(f"ReactiveGraph: {why}")

    @property
    def hook_names(self) -> dict[str, str]:
        """{hook name: node name} for the model's hook points (TransformerLens models)."""
        return dict(self._hooks)

    def run_with_cache(self, *args, **kwargs):
        """Runs the graph on new inputs; returns (outputs, cache). The cache maps every hook name and
        node name to its value (the cached tensors: read them, do not write into them): a hook name in the
        hook's layout (TransformerLens's: ``blocks.<l>.attn.hook_z`` as [batch, pos, head, d_head]), a node name
        in the node's own."""
        out = self.run(*args, **kwargs)
        cache = _HookCache({name: self._engine.value(name) for name in self._countable})
        for hook, node in self._hooks.items():
            try:  # the other of two hook names in a row after a graft through one: no value in one node
                self._refuse_other_hook_name(hook, node, f"run_with_cache()[{hook!r}]", pinned=False)
            except ValueError as e:
                cache.refused[hook] = str(e)
                continue
            # A hook point whose value nothing reads (a RoPE bridge's rotary_emb.hook_in): its alias node was
            # dropped from the graph as dead code; its value is its source's.
            node = self._unread_hooks.get(node, node)
            value = cache[node] if node in cache else self._engine.value(node)
            cache[hook] = self._as_hook(hook, value)
        return out, cache

    def _as_hook(self, name: str, value):
        """``value`` (of the node ``name`` addresses) as the hook ``name`` shows it: TransformerLens's layout
        (hook_z split into heads); a node name, or a hook with no conversion, gives ``value`` itself."""
        conv = self._conversions.get(name)
        return conv.convert(value) if conv is not None and isinstance(value, torch.Tensor) else value

    def _hook_shape(self, name: str, node: str) -> tuple[list[int], list[int]] | None:
        """(the hook's shape, its node's shape) for a hook name whose value is converted, else None. From the
        node's declared type: nothing is evaluated."""
        conv = self._conversions.get(name)
        t = self._type_of(node) if conv is not None else None
        if t is None or t[0] != "tensor":
            return None
        return list(conv.convert(torch.empty(list(t[2]), device="meta")).shape), list(t[2])

    def _from_hook(self, name: str, node: str, value, what: str):
        """A tensor given by hook name, in the hook's layout, as its node holds it; a tensor of another shape
        (the node's merged layout included), dtype or device is refused, naming the hook and what it got and
        must have (the engine's own check named the internal node, which the user never wrote)."""
        if not isinstance(value, torch.Tensor) or name not in self._hooks:
            return value
        want = self._hook_type(name, node)
        diff = _type_differences(_type_of_tensor(value), want, self._layout_words(name)) if want is not None else None
        if diff is not None:
            got, need, which = diff
            shapes = self._hook_shape(name, node)
            merged = (f". Its node {node!r} holds {shapes[1]}: give a value in that layout by the node's name"
                      if shapes is not None and "shape" in which else "")
            raise ValueError(f"{what} {name!r}: got {got}; the hook's value is {need} (as run_with_cache and value() "
                             f"give it), and the value must have that {which}{merged}")
        conv = self._conversions.get(name)
        return conv.revert(value) if conv is not None else value

    def _hook_type(self, name: str, node: str) -> tuple | None:
        """(shape as hook ``name`` shows it, dtype, device) of its node ``node``, from the declared type (nothing
        is evaluated); None for a node that is not a tensor."""
        t = self._type_of(node)
        if t[0] != "tensor":
            return None
        shapes = self._hook_shape(name, node)
        return (shapes[0] if shapes is not None else list(t[2])), _SHORT_DTYPE[t[1]], torch.device(t[4])

    def _layout_words(self, name: str) -> str:
        conv = self._conversions.get(name)
        return ("[batch, pos, head, d_head] = " if isinstance(conv, _compat._SplitHeads)
                or getattr(conv, "splits_attention_heads", False) else "")

    def _hook_view(self, name: str, fn: Callable) -> Callable:
        """``fn`` as it sees a hook's value: TransformerLens converts it before a hook (e.g. [batch,
        pos, head, d_head] for hook_z) and reverts the result after. By hook name, a result of another shape,
        dtype or device than the hook's value is refused naming the hook (the engine named the node); by node
        name, ``fn`` itself (the engine's check names the node, as the user did)."""
        if name not in self._hooks:
            return fn
        conv = self._conversions.get(name)
        words = self._layout_words(name)

        def view(value, *rest):
            # hook_z (a Hugging Face decoder's, or a TransformerLens bridge's): the result is merged back to
            # [batch, pos, head * d_head] by a reshape, which took any tensor of as many elements per position
            # ([batch, pos, 2, 16] for 4 heads of 8) as the heads silently (a bridge's revert passed other shapes
            # through), and named a wrong shape only after the merge, in the node's layout.
            given = conv.convert(value) if conv is not None else value
            out = fn(given, *rest)
            if not isinstance(out, torch.Tensor):
                return out  # refused by the caller, naming what it got
            if out.shape != given.shape or out.dtype != given.dtype or out.device != given.device:
                got, need, which = _type_differences(_type_of_tensor(out), _type_of_tensor(given), words)
                raise ValueError(f"patch function for hook {name!r} returned {got}; the hook's value is {need}, and "
                                 f"the patch must have that {which}")
            return conv.revert(out) if conv is not None else out
        return view

    # ---- mutations
    def patch(self, node: str, value) -> None:
        """Pins ``node`` to ``value`` (a tensor of the node's shape and dtype, or ``f(clean) -> tensor``).

        ``f`` receives the node's baseline value (no patch active). It must not write into it; a
        function that does raises a ValueError and the cache is repaired (the node is recomputed).

        By hook name, ``value`` (and ``f``'s argument and result) is in the hook's layout, as :meth:`value`
        and :meth:`run_with_cache` give it (``blocks.<l>.attn.hook_z``: [batch, pos, head, d_head]); a value
        of another shape is refused naming the hook and both shapes. By node name, the node's own layout.
        """
        self._refuse_during_sweep("patch()")
        name, node = node, self.resolve(node)
        self._refuse_other_hook_name(name, node, "patch")
        self._refuse_non_tensor(node, "patch")
        self._refuse_joint_edit(node, "patch")
        if callable(value):
            with _one_check_per_call():  # f sees the baseline of the weights as they are now
                self._take_untracked_writes()
                value = self._patch_fn_value(name, node, value)
        else:
            value = self._from_hook(name, node, value, "patch")
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"patch {name!r}: expected a tensor or a callable returning one, got {type(value).__name__}")
        self._engine.patch(node, _own_copy(value.detach()))
        self.__dict__.setdefault("_pin_names", {})[node] = name

    def _patch_fn_value(self, name: str, node: str, fn: Callable) -> torch.Tensor:
        """``fn(baseline of node)``, checked as a patch value. A stale node's baseline is computed first (its
        stale ancestors evaluated): that runs in a transaction that is rolled back, counters included, when
        ``fn`` fails or its result is refused, so a refused patch changes no count and no cached value
        (cost-model.md); once the result is accepted, the evaluations stand, as for any read."""
        eng = self._engine
        eng.begin_transaction(restore_counts=True)
        try:
            clean = _cached_baseline(eng, node)
            if clean is not None:
                value = self._checked_patch_fn_value(name, node, fn, clean)
        except BaseException:
            eng.rollback()
            raise
        if clean is not None:
            eng.commit()
            return value
        eng.rollback()
        # The baseline is not cached: a graft or weight edit under standing patches displaced it. It is what the
        # graph gives with no patch active, so the patches are lifted, the node read, and the patches put back by
        # value (the same pins; their cones recompute at the next read). That refusal read like an internal error.
        # Only the baseline is read lifted: fn runs with the patches back, so a read of the graph inside it
        # (rg.value(other)) sees them, as it does where the baseline was cached (it read the graph unpatched here:
        # fuzz_sweep 54:190).
        with self._patches_lifted():
            clean = eng.value(node).clone()
        return self._checked_patch_fn_value(name, node, fn, clean)

    def _checked_patch_fn_value(self, name: str, node: str, fn: Callable, clean: torch.Tensor) -> torch.Tensor:
        value = self._call_patch_fn(node, self._hook_view(name, fn), clean, f"patch function for {name!r}")
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"patch {name!r}: expected a tensor or a callable returning one, got a callable "
                            f"returning {type(value).__name__}")
        self._engine.check_patch(node, value)
        return value

    @contextlib.contextmanager
    def _patches_lifted(self):
        """Inside it no patch is active (reads give the baseline of the weights, inputs and grafts as they are);
        at its end, also on an exception, the same nodes are pinned to the same values again."""
        eng = self._engine
        pins = {n: eng.value(n) for n in eng.pinned()}  # pinned nodes are valid: this evaluates nothing
        eng.restore()
        try:
            yield
        finally:
            self._put_back_pins(pins)

    def _refuse_joint_edit(self, node: str, what: str, graft: bool = False, dst: str = "") -> None:
        """On a joint forward+backward program (outputs: the loss and the parameter gradients), the one rule for
        patch, sweep and graft (torch_ext/_joint_edits.py): an edit whose gradients would not be eager autograd's
        for the edited model (a forward activation computed from parameters whose gradients are outputs: 0.08 to
        0.14 off eager's gradients on a 3-layer tanh MLP, silently) is refused, naming the parameters and the way
        out; gradient nodes, and forward values with no such parameter before them, stay editable. Off inside
        :meth:`dataflow_edits`. Refused before anything changes."""
        if self._loss_output is None or not self._grad_outputs or getattr(self, "_dataflow_edits", 0):
            return
        key = (self._engine, self._engine.graph_revision())
        cached = getattr(self, "_joint_rule", None)
        if cached is None or cached[0] != key:
            nodes = {n.name: n for n in self.graph.nodes()}
            rule = JointEditRule(nodes, _node_inputs, self._loss_output, {t for _, t in self._grad_outputs})
            cached = self._joint_rule = (key, rule)
        why = cached[1].refusal(node, what, graft=graft, dst=dst)
        if why is not None:
            raise ValueError(why)

    @contextlib.contextmanager
    def dataflow_edits(self):
        """Inside it, a joint forward+backward graph takes every patch, sweep and graft as a dataflow edit:
        the rule that refuses an edit of a forward activation whose gradients would not be eager's
        (:meth:`patch`) is off. For cost measurements that count the cones of forward edits
        (scripts/reproduce_paper.py E5): the counts are exact (cost-model.md), the gradient outputs are the
        joint graph's dataflow under the edit, not gradients of any model. Edits made inside stand after it."""
        self._dataflow_edits = getattr(self, "_dataflow_edits", 0) + 1
        try:
            yield self
        finally:
            self._dataflow_edits -= 1

    def _refuse_non_tensor(self, node: str, what: str) -> None:
        """A node holding a tuple or list (topk, split, max with indices) cannot be patched as one value: its
        elements are the getitem nodes that take them. Refused here, naming them, before anything runs (the
        engine failed later with "Expected Tensor but got Tuple", naming neither)."""
        t = self._type_of(node)
        if t[0] == "tensor":
            return
        parts = [n.name for n in self.graph.nodes() if str(n.target) == "getitem" and _node_inputs(n)[:1] == [node]]
        size = f" of {len(t[1])} values" if isinstance(t[1], (list, tuple)) else ""
        hint = (f"; patch the nodes that take its elements ({', '.join(repr(p) for p in parts)})" if parts else "")
        raise ValueError(f"{what}: node {node!r} holds a {t[0]}{size}, not a tensor{hint}")

    def _call_patch_fn(self, node: str, fn: Callable, clean: torch.Tensor, what: str):
        """``fn(copy of clean)``; ``what`` names the function as the user addressed it (by hook or node name,
        or its sweep site) for the refusal of an in-place write. ``clean`` is the cached tensor; the function
        gets a copy, because not every write into it can be seen: ``.data`` and ``.numpy()`` give tensors that share its
        memory but not its version counter, and a write through them went unnoticed into the cache
        (every later evaluation reading the node computed from it). An in-place edit of the copy (its
        version changes) is still refused, as documented: the function must return a new tensor. The
        copy is copy-on-write where it can stand for ``clone()`` (``_C.lazy_copy``, as the C++ sweep loop
        does): a function that only reads its argument costs no copy, and any write gets memory of its own."""
        given = _C.lazy_copy(clean)
        if given is None:
            given = _C.copy_in_layout(clean)  # the node's strides, gaps included, as an eager hook sees
        version = given._version
        out = fn(given)
        if given._version != version:
            raise ValueError(
                f"{what} wrote in place into the activation it was given (an op such as "
                "`act[...] = ...` or `act.mul_(...)`); it was handed a copy, so the cache is intact, but the patch "
                "was not applied. Return a new tensor instead, e.g. `act = act.clone()` first.")
        return out

    def _countable_set(self) -> set:
        if getattr(self, "_countable_cache", None) is None or len(self._countable_cache) != len(self._countable):
            self._countable_cache = set(self._countable)
        return self._countable_cache

    def restore(self, node: str | None = None) -> None:
        """Drops every patch (zero evaluations), or only the patch at ``node``."""
        self._refuse_during_sweep("restore()")
        if node is None:
            self._engine.restore()
            return
        target = self.resolve(node)
        pinned = list(self._engine.pinned())
        if target not in pinned:
            self._engine.node(target)  # a name that is no node: the engine's "unknown node" as before
            # The engine's own check named the node only ("restore %linear"), never the hook the user passed.
            hooks = {}
            for hook, n in self._hooks.items():
                hooks.setdefault(n, hook)
            what = f"hook '{node}' (node '{target}')" if target != node else f"node '{node}'"
            now = ", ".join(f"'{hooks[n]}'" if n in hooks else f"node '{n}'" for n in pinned) or "none"
            raise ValueError(f"restore({node!r}): {what} is not patched (patched now: {now}); "
                             "restore() with no argument drops every patch")
        self._engine.restore_node(target)

    def graft(self, src: str, dst_or_block, block=None) -> list[str]:
        """Splices ``block`` into the edge ``src -> dst``, or after ``src`` for every consumer.

        ``block`` is an ``nn.Module`` or a function of one tensor returning a tensor of the same
        shape and dtype. It is exported with ``torch.export`` and spliced in; the new node names
        are returned. With ``src`` a hook name, ``block`` sees the hook's layout and returns it, as
        :meth:`value` gives it (``blocks.<l>.attn.hook_z``: [batch, pos, head, d_head]); by node name, the
        node's own layout.
        """
        self._refuse_during_sweep("graft()")
        dst = ""
        if block is None:
            block = dst_or_block
        else:
            if not isinstance(dst_or_block, str):
                raise TypeError("graft(src, dst, block): dst must be a node name")
            dst = dst_or_block
        hook, (src, dst) = src, (self.resolve(src), self.resolve(dst) if dst else dst)
        if dst:
            self._refuse_grafted_edge(src, dst)
        self._refuse_joint_edit(src, "graft after", graft=True, dst=dst)
        if not dst and hook != src:
            # The other of two hook names in a row after a graft through one (or while one is patched): in eager the
            # later hook's block runs after the earlier one's (or after its patch), while both grafts are spliced
            # right after the one node, the newest first (fuzz_sweep 53:99: g(f(x)) computed as f(g(x)), silently).
            self._refuse_other_hook_name(hook, src, f"graft({hook!r})")
        if not isinstance(block, torch.nn.Module):
            if not callable(block):
                raise TypeError(f"graft: block must be an nn.Module or a callable, got {type(block).__name__}")
            block = _FunctionBlock(block)
        # What the block's export reads (its Python attributes, its parameters by identity, module-level values):
        # a graph for another input shape exports it again, so one changed after the graft would be the old value
        # in this graph and the new one in that graph, silently. Refused at run() and demand() instead.
        snapshot = (_module_state.attributes(block), _module_state.global_reads(block), _module_state.Hooks(block))
        _refuse_other_device(block, src, self._type_of(src)[4])
        shapes = self._hook_shape(hook, src)
        if shapes is not None:  # the block sees the hook's layout (as patch functions do) and returns it
            block = _HookLayoutBlock(block, self._conversions[hook], hook, self._layout_words(hook))
        names = self._apply_graft(src, dst, block, shown=hook)
        if not dst and hook != src and hook in self._hooks:
            self.__dict__.setdefault("_graft_hook_names", {}).setdefault(src, hook)
        self._graft_snapshots = getattr(self, "_graft_snapshots", []) + [(src, type(block).__name__, snapshot)]
        self._grafts.append((src, dst, block, names))
        self._grafts_applied += 1
        return names

    def _refuse_grafted_edge(self, src: str, dst: str) -> None:
        """An edge ``src -> dst`` grafted before is gone: ``dst`` reads that block's output now. The engine's
        refusal said only "no edge"; this one says why and names the edge to graft onto instead (after the
        earlier block, whose output ``dst`` reads), before anything is exported. Nothing changes."""
        node = next((n for n in self.graph.nodes() if n.name == dst), None)
        inputs = _node_inputs(node) if node is not None else []
        if node is None or src in inputs:
            return  # an unknown dst, or an edge that exists: the engine's checks
        for g_src, g_dst, _, names in reversed(self._grafts):
            if g_src != src or g_dst not in ("", dst):
                continue
            reads = [a for a in inputs if a in names]
            if reads:
                how = "the edge" if g_dst else "every consumer of it (node form)"
                raise ValueError(f"graft {src} -> {dst}: {how} was already grafted, so {dst!r} reads the block's "
                                 f"output {reads[0]!r} now, not {src!r}; to add a block after the first one, graft "
                                 f"onto the edge {reads[0]!r} -> {dst!r}")

    def _apply_graft(self, src: str, dst: str, block: torch.nn.Module, shown: str | None = None) -> list[str]:
        # The example comes from src's declared type, never its value: inside `batch()` nothing may be
        # evaluated before the demand (a value would compute stale ancestors now, and again later).
        example = _empty_like_type(self._type_of(src))
        writes = _module_state.TracedWrites(block, root="block")  # what the block's forward writes on itself
        try:
            exported = torch.export.export(block, (example,))
        finally:
            stored = writes.settle()
        if stored:
            raise ValueError("graft: " + _module_state.stored_trace_message(
                stored, "the graph", "take activations from the graph instead (rg.value), or graft a block that "
                "does not keep them"))
        read_back = [w for w in writes.state_writes if w.read]
        if read_back:
            raise TypeError("graft: the block's " + _module_state.read_back_message(read_back, "the graph"))
        ep = _functional_program(exported)
        if shown not in (None, src) and shown in self._hooks:
            self._refuse_hook_block_type(shown, src, ep)
        _refuse_other_layout(ep, f"'{src}'" if shown in (None, src) else f"'{shown}' (node '{src}')", self._type_of(src))
        random = _random_nodes(ep)
        if random:
            raise ValueError(f"graft: the block draws random numbers at {', '.join(random[:4])}; a cached random draw "
                             "is redrawn by every recomputation (is it a Dropout in training mode? call .eval())")
        bgraph = Graph.from_exported(ep)
        state = {**ep.state_dict, **ep.constants}
        params = [state[spec.target] for spec in ep.graph_signature.input_specs if spec.kind.name != "USER_INPUT"]
        names = self._engine.graft(src, dst, bgraph._g, params)
        # The block's parameters are placeholders of the graph now (after the others, in order): run() hands them
        # in with the model's state (it was refused: "run: expected 7 inputs, got 5").
        self._slots = list(self._slots) + list(params)
        # The block's parameters are read by reference: one written through .data or .numpy() (its version counter
        # stays) is found by content as the model's weights are (_take_untracked_writes).
        tensors = [t for t in params if isinstance(t, torch.Tensor) and all(t is not u for u in self._graft_tensors)]
        self._graft_tensors = self._graft_tensors + tensors
        if getattr(self, "_contents", None) is not None and tensors:
            held, digest = self._contents
            self._contents = (held + tensors, digest + _contents_digest(tensors))
        self._cone_sizes, self._all_names, self._sweep_plans = {}, None, None
        self._countable.extend(names)
        for n in names:
            self._module_paths[n] = ""
        return names

    def _refuse_hook_block_type(self, hook: str, src: str, ep) -> None:
        """A block grafted by hook name whose result has another shape, dtype or device than the hook's value is
        refused naming the hook, before the splice (the engine's refusal named the internal node: "block output
        type f64[2,6,32] differs from %add_8")."""
        outs = [a for a in ep.graph.output_node().args[0] if isinstance(a, torch.fx.Node)]
        val = outs[0].meta.get("val") if len(outs) == 1 else None
        t = self._type_of(src)
        if not isinstance(val, torch.Tensor) or t[0] != "tensor":
            return  # several results, or none: the engine's check
        if _type_differences(_type_of_tensor(val), (t[2], _SHORT_DTYPE[t[1]], torch.device(t[4]))) is None:
            return
        shape, conv = list(val.shape), self._conversions.get(hook)
        if conv is not None:  # in the hook's layout, as the block saw it
            shape = list(conv.convert(torch.empty(shape, device="meta")).shape)
        got, need, which = _type_differences((shape, val.dtype, val.device), self._hook_type(hook, src),
                                             self._layout_words(hook))
        raise ValueError(f"graft block after hook {hook!r} returned {got}; the hook's value is {need}, and the block "
                         f"must return that {which}")

    @contextlib.contextmanager
    def batch(self):
        """Records the mutations made inside it and invalidates once, when the block ends (or at the
        first read inside it): nothing is evaluated before the next demand, which costs
        |U D0(w_k)| + sum h_k for a batch of grafts (cost-model.md), in any order. With patches by value too
        (nodes S, standing at the demand), from a graph with nothing stale and no standing patch, early cutoff
        off, it costs |(U_k D(B_k) U U_{s in S} V+(s)) minus S|, with B_k the k-th block's nodes and the cones
        taken in the graph after the batch (which reduces to the formula above when S is empty). A patch
        function reads its node's baseline inside the batch: that read settles the batch and evaluates then.

        An exception leaving the block (the user's own, or a refused patch) puts the patches back as they
        were when it began, the same values (a caught half-applied batch answered the next demand silently);
        a graft made inside it cannot be taken back and stands, which the exception's note says."""
        eng = self._engine
        # The pins' values, read before the batch opens: a pinned node is valid, so this evaluates nothing
        # (inside an outer batch it settles that batch's pending mutations, as any read does).
        pins = {n: eng.value(n) for n in eng.pinned()}
        grafts = len(self._grafts)
        eng.begin_batch()
        try:
            yield self
        except BaseException as e:
            self._put_back_pins(pins)
            if len(self._grafts) > grafts:
                made = ", ".join(f"after {src!r}" + (f" into {dst!r}" if dst else "")
                                 for src, dst, _, _ in self._grafts[grafts:])
                e.add_note(f"rg.batch(): the patches are as they were before this batch; its grafts ({made}) "
                           "stand, as a graft cannot be taken back")
            raise
        finally:
            eng.end_batch()

    def _put_back_pins(self, pins: dict) -> None:
        """Makes the pinned nodes exactly ``pins`` (node -> pinned value), as :meth:`batch` found them."""
        eng = self._engine
        for node in eng.pinned():
            if node not in pins:
                eng.restore_node(node)
        for node, value in pins.items():
            now = eng.value(node) if node in eng.pinned() else None
            if now is not value:
                eng.patch(node, value)

    # ---- inspection
    @property
    def engine(self) -> Engine:
        """The :class:`Engine` under this graph (the same one, not a copy), for exact cost measurements
        that drive it by node name; a patch made there is a patch of this ReactiveGraph, under the same rule
        for joint forward+backward graphs (:meth:`patch`, :meth:`dataflow_edits`)."""
        return Engine._wrap(self._engine, self._refuse_joint_edit)

    @property
    def graph(self) -> Graph:
        """The graph the engine runs now: dead code dropped, every graft spliced in. A copy is taken
        at the first read after a structural change (so a batch of grafts copies it once)."""
        key = (self._engine, self._engine.graph_revision())
        cached = getattr(self, "_graph_cache", None)
        if cached is None or cached[0] != key:
            cached = self._graph_cache = (key, Graph(self._engine.graph()))
        return cached[1]

    @property
    def stats(self) -> dict:
        """``evaluations``, ``cost`` (FLOPs of what ran), ``row_evaluations`` (a node run on k of its T
        rows counts k/T; exact, rounded once: ``row_evaluations_exact`` is the same sum as {T: rows}),
        ``cutoffs``, ``invalidated``, ``restored`` of the current shape's graph; ``graph_builds`` and ``graph_reuses`` count per-shape graphs; ``front_end``
        names the tracer that built the current shape's graph ("make_fx", "export", or "program" for an
        ExportedProgram given as it is; ``build_stats`` has the details)."""
        return {**self._engine.stats(), **self._shape_stats, "front_end": self.build_stats["front_end"]}

    def reset_stats(self) -> None:
        self._engine.reset_stats()

    def cone(self, node: str) -> set[str]:
        """V+(node): the strict downstream cone, as node names."""
        return set(self._engine.cone(self.resolve(node)))

    def patched(self) -> list[str]:
        """The nodes holding a patch now (what ``restore()`` undoes); ``[]`` when none does."""
        return list(self._engine.pinned())

    def node_cost(self, node: str) -> float:
        """Estimated FLOPs of evaluating ``node`` once (the unit of ``stats["cost"]``)."""
        return self._engine.node_cost(self.resolve(node))

    def cone_cost(self, node: str) -> float:
        """C(V+(node)): estimated FLOPs of recomputing the strict cone once (docs/cost-model-positions.md)."""
        return self._engine.cone_cost(self.resolve(node))

    def _cone_size(self, node: str) -> int:
        """|V+(node)|, cached until the graph changes (a graft, another input shape)."""
        cache = self.__dict__.get("_cone_sizes")
        if cache is None:
            cache = self._cone_sizes = {}
        if node not in cache:
            cache[node] = len(self._engine.cone(node))
        return cache[node]

    def _node_names(self) -> set:
        """Every node name (placeholders included), cached until the graph changes."""
        names = self.__dict__.get("_all_names")
        if names is None:
            names = self._all_names = {n.name for n in self.graph.nodes()} | set(self._countable)
        return names

    def nodes(self, pattern: str | None = None) -> list[str]:
        """Countable node names, filtered by a glob on the name, the module path or a hook name
        (``rg.nodes("blocks.*.hook_resid_pre")``; hooks come in the model's order)."""
        if pattern is None:
            return list(self._countable)
        by_hook = [node for hook, node in self._hooks.items() if fnmatch.fnmatchcase(hook, pattern)]
        if by_hook:
            order = {n: i for i, n in enumerate(self._countable)}
            return sorted(dict.fromkeys(by_hook), key=lambda n: order.get(n, -1))
        return [n for n in self._countable
                if fnmatch.fnmatchcase(n, pattern) or fnmatch.fnmatchcase(self._module_paths.get(n, ""), pattern)]

    @property
    def num_nodes(self) -> int:
        """N: the number of countable nodes (one full recomputation)."""
        return self._engine.num_countable()

    def set_cutoff(self, enabled: bool) -> None:
        """Turns early cutoff on or off (for this graph, every input shape's graph included)."""
        self._cutoff = bool(enabled)
        self._engine.set_cutoff(self._cutoff)

    @property
    def positions(self) -> bool:
        """Whether token-granular cones are on (see ``ReactiveGraph(positions=...)``)."""
        return self._positions

    def set_positions(self, enabled: bool) -> None:
        """Turns token-granular cones on or off (for this graph and its batched copies)."""
        self._positions = bool(enabled)
        self._engine.set_positions(self._positions, self._seq_dim)
        for bc in self._batched.values():
            if bc.engine is not None:
                bc.engine.set_positions(self._positions, self._seq_dim)

    def seq_axis(self, node: str) -> int:
        """The node's sequence axis by the analysis, or -1 (no axis, or positions off)."""
        return self._engine.seq_axis(self.resolve(node))

    def _type_of(self, node: str) -> tuple:
        """The IR type of one of the engine's nodes (its "unknown node" error names any other name)."""
        return self._engine.node(node)["type"]

    def _output_nodes(self) -> list:
        """The node name of every flat output (None for a constant)."""
        cache = self.__dict__.get("_out_nodes")
        if cache is None or cache[0] is not self.graph:
            outs = [a.name if isinstance(a, _C.NodeRef) else None for a in self.graph.nodes()[-1].args[0]]
            cache = self._out_nodes = (self.graph, outs)
        return cache[1]

    def _output_index(self, key, outs: list) -> int:
        """The flat output ``reads`` names by ``key``: its flat index, its node or hook name, its key in
        the model's output structure (``"logits"`` of a Hugging Face ``ModelOutput`` or a dict, or the
        key path ``"['logits']"``), or, with one user output, any name."""
        if isinstance(key, int) and not isinstance(key, bool):
            # The index of a leaf of what the model returns: a train-mode BatchNorm's graph also outputs its
            # running statistics (buffer updates, first), and reads={0: ...} indexed running_mean (IndexError).
            user = self._user_outputs if self._loss_output is None and self._user_outputs else range(len(outs))
            if not 0 <= key < len(user):
                raise ValueError(f"reads: output index {key} out of range (the model returns {len(user)} "
                                 f"output{'s' if len(user) != 1 else ''})")
            return user[key]
        if isinstance(key, str):
            shapes = self._hook_shape(key, self._hooks[key]) if key in self._conversions else None
            if shapes is not None and shapes[0] != shapes[1]:
                # reads indexes outputs in their nodes' layout; a hook shown in another (hook_z split into heads)
                # was taken for the one user output, or indexed in the merged layout, silently.
                raise ValueError(f"reads: hook {key!r} is shown as {self._layout_words(key)}{shapes[0]} where its "
                                 f"node {self._hooks[key]!r} holds {shapes[1]}; reads names the outputs the metric "
                                 "reads (by output key, index or node name), not a hook inside the model")
            if self.resolve(key) in outs:
                return outs.index(self.resolve(key))
            by_key = self._output_keys()
            if key in by_key:
                return by_key[key]
            if self._single_output is not None:
                return self._single_output
        names = [o for o in outs if o] + sorted(k for k in self._output_keys() if not k.startswith(("[", ".")))
        raise ValueError(f"reads: {key!r} names no output (outputs: {names})")

    def _output_keys(self) -> dict:
        """{key: flat output index} for the user outputs' places in the output structure: the last key
        of each leaf's path (when no other leaf shares it) and the whole path (``pytree.keystr``)."""
        cache = self.__dict__.get("_out_keys")
        if cache is not None and cache[0] is self._out_spec:
            return cache[1]
        keys: dict = {}
        if self._out_spec is not None and not self._out_spec.is_leaf():
            try:
                tree = pytree.tree_unflatten(list(range(self._out_spec.num_leaves)), self._out_spec)
                paths = pytree.tree_flatten_with_path(tree)[0]
            except Exception:  # noqa: BLE001 - an output container that cannot hold ints: no keys
                paths = []
            last_names: dict = {}
            for path, leaf in paths:
                flat = self._user_outputs[leaf]
                keys[pytree.keystr(path)] = flat
                last = path[-1] if path else None
                name = getattr(last, "key", getattr(last, "name", None))
                if isinstance(name, str):
                    last_names.setdefault(name, []).append(flat)
            keys.update({name: flats[0] for name, flats in last_names.items() if len(flats) == 1})
        self._out_keys = (self._out_spec, keys)
        return keys

    def _read_spec(self, reads) -> tuple[list[int], list[list[int]]]:
        """(first row read, columns read) per flat output, as evaluate_patched_rows takes them."""
        return self._read_rows(reads), self._read_cols(reads)

    def _read_cols(self, reads) -> list[list[int]]:
        """The columns (last dim) a dict ``reads`` names per flat output: its index's last entry when the
        index has one entry per dim and that entry is an int or a list of ints; [] (all) otherwise."""
        if not isinstance(reads, dict):
            return []
        outs = self._output_nodes()
        cols: list[list[int]] = [[] for _ in outs]
        rows = self._read_rows(reads)  # validates the keys
        del rows
        for key, index in reads.items():
            k = self._output_index(key, outs)
            node = outs[k]
            if node is None or not isinstance(index, tuple):
                continue
            t = self._type_of(node)
            if t[0] != "tensor":
                continue
            index = _index_per_dim(key, index, len(t[2]))
            if len(index) != len(t[2]) or len(t[2]) < 2:
                continue
            last = index[-1]
            if isinstance(last, int) and not isinstance(last, bool):
                last = [last]
            if isinstance(last, torch.Tensor) and last.dtype in (torch.int64, torch.int32) and last.dim() <= 1:
                last = last.reshape(-1).tolist()
            if isinstance(last, (list, tuple)) and last and all(isinstance(i, int) and not isinstance(i, bool)
                                                                for i in last):
                width = t[2][-1]
                bad = [i for i in last if not -width <= i < width]
                if bad:
                    raise ValueError(f"reads[{key!r}]: columns {bad} are outside the last dim of length {width}")
                cols[k] = sorted({i % width for i in last})
        return cols

    def _read_rows_of_callable(self, reads: Callable) -> list[int]:
        """``reads(outputs)`` returns what the metric reads (``lambda logits: logits[:, -1, [a, b]]``). It
        is run once on stand-ins of the outputs whose every element holds its own row along the
        sequence axis; the smallest row it returns per output is the first row read."""
        outs = self._output_nodes()
        flat = []
        tagged = {}
        whole: set = set()
        for k, node in enumerate(outs):
            axis = self._engine.seq_axis(node) if node is not None else -1
            t = self._type_of(node) if node is not None else None
            if t is None or t[0] != "tensor":
                flat.append(self._engine.value(node) if node is not None else None)
                continue
            if axis < 0:  # no sequence axis (a train-mode batch norm mixes rows): read whole, still an output
                flat.append(torch.full(list(t[2]), 1e6 * (k + 1), dtype=torch.float64))
                whole.add(k)
                continue
            sizes = list(t[2])
            shape = [1] * len(sizes)
            shape[axis] = sizes[axis]
            rows = torch.arange(sizes[axis], dtype=torch.float64).reshape(shape) + 1e6 * (k + 1)
            flat.append(rows.expand(sizes).clone())
            tagged[k] = sizes[axis]
        try:
            picked = reads(self._user(flat))
        except Exception as e:  # noqa: BLE001 - the user's callable: say where it failed
            raise ValueError(f"reads callable failed on the outputs' row stand-ins: {type(e).__name__}: {e}") from e
        first = [-1] * len(outs)
        seen = {k: None for k in tagged}
        for leaf in pytree.tree_leaves(picked):
            if not isinstance(leaf, torch.Tensor) or leaf.dtype != torch.float64 or leaf.numel() == 0:
                raise TypeError("reads callable must return the indexed outputs (tensors taken from its argument), got "
                                f"{type(leaf).__name__}")
            tags = (leaf / 1e6).round().long() - 1
            for k in tags.unique().tolist():
                if k in whole:
                    continue
                if k not in seen:
                    raise ValueError("reads callable returned values that are not elements of an output with a "
                                     "sequence axis; index the outputs, do not compute on them")
                r = int((leaf[tags == k] - 1e6 * (k + 1)).min().round())
                seen[k] = r if seen[k] is None else min(seen[k], r)
        for k, r in seen.items():
            if r is not None:
                first[k] = r
        return first

    def _read_rows(self, reads) -> list[int]:
        """``reads`` ({output: index}, or a callable: see _read_rows_of_callable) as the first row read
        along each flat output's sequence axis
        (-1: read whole). An output is named as ``_output_index`` says: a node or hook name, a flat
        index, its key in the output structure (a ModelOutput's ``"logits"``), or any name when alone. The index is what the metric reads
        (``(slice(None), -1, [tok_a, tok_b])``); only its entry at the sequence axis is used: an int
        reads that row, a slice from its start, a list from its smallest row."""
        if reads is None:
            return []
        if callable(reads) and not isinstance(reads, dict):
            return self._read_rows_of_callable(reads)
        if not isinstance(reads, dict):
            raise TypeError(f"reads must be a dict {{output: index}} or a callable, got {type(reads).__name__}")
        outs = self._output_nodes()
        rows = [-1] * len(outs)
        for key, index in reads.items():
            k = self._output_index(key, outs)
            node = outs[k]
            if node is None:
                continue
            axis = self._engine.seq_axis(node)
            if axis < 0:
                continue
            given = index
            index = _index_per_dim(key, index, len(self._type_of(node)[2]))
            if axis >= len(index):
                continue
            t = self._type_of(node)[2][axis]
            sel = index[axis]
            if isinstance(sel, int):
                first = sel + t if sel < 0 else sel
            elif isinstance(sel, slice):
                if sel.step not in (None, 1):
                    raise ValueError(f"reads[{key!r}]: slice {sel} along the sequence axis must have step 1")
                start = sel.start or 0
                first = max(start + t if start < 0 else start, 0)
            elif isinstance(sel, (list, tuple, range)) and sel and all(isinstance(i, int) for i in sel):
                first = min(i + t if i < 0 else i for i in sel)
            elif isinstance(sel, torch.Tensor) and sel.dtype in (torch.int64, torch.int32) and sel.numel():
                first = int(torch.where(sel < 0, sel + t, sel).min())
            else:
                raise ValueError(f"reads[{key!r}]: {given!r} cannot read {sel!r} along the sequence axis (dim {axis}); "
                                 "give an int, a slice, or a list of ints")
            if not 0 <= first < t:
                raise ValueError(f"reads[{key!r}]: row {first} is outside the sequence axis of length {t}")
            rows[k] = first
        return rows

    def check_invariants(self) -> None:
        self._engine.check_invariants()

    def __str__(self) -> str:
        return str(self._engine)

    # ---- batched sites
    def _batched_cone(self, node: str, k: int) -> "_BatchedCone":
        """The cone of ``node`` K times over along dim 0 (csrc/passes/batch_cone.h), its values outside
        the cone the current clean ones (grafts and standing patches included); built again when the
        graph, its inputs or its standing patches change."""
        return self._batched_entries(((node, k),))

    def _batched_state(self) -> tuple:
        """What a batched cone is built from (its cache key besides the entries). The objects themselves,
        held by the cone and compared by identity: an id() alone comes back once its object is freed (a
        restored patch's value, the inputs of an earlier run), and a new object at the same address would
        pass for the one the cone was built from. input_edits: a weight written in place since (taken by the
        engine as an edit) makes the cone's copies of clean values stale."""
        eng = self._engine
        pinned = tuple(eng.pinned())
        return (eng, eng.graph_revision(), _Held(self._last_inputs), pinned, tuple(eng.value(p) for p in pinned),
                eng.input_edits())

    def _batched_entries(self, entries: tuple, state: tuple | None = None) -> "_BatchedCone":
        """Copies entering at several nodes along one chain, ``((node, k), ...)`` upstream first, as one
        batched cone (batch_cone's entries form); one entry is ``_batched_cone(node, k)``. Cached under
        ``(node, k)`` for one entry, ``entries`` otherwise. ``state``: _batched_state() as it is now (a sweep,
        which refuses every mutation while it runs, takes it once for all its units)."""
        if self._last_inputs is None:
            raise ValueError("batched sites need a ReactiveGraph that has run (give example_inputs or call run())")
        eng = self._engine
        if state is None:
            state = self._batched_state()
        key = entries[0] if len(entries) == 1 else entries
        bc = self._batched.get(key)
        if bc is not None and _same_state(bc.state, state):
            self._batched.move_to_end(key)
            return bc
        # Entries built for another state would be rebuilt before any use: drop them now, with the
        # least recently used beyond the bound, before building (their memory is freed first).
        for stale in [k for k, old in self._batched.items() if not _same_state(old.state, state)]:
            del self._batched[stale]
        while len(self._batched) >= max(1, int(self.max_batched_cones)):
            self._batched.popitem(last=False)
        graph = _BatchedCone.build_graph(eng, entries)
        need = _graph_bytes(graph[0])
        while self._batched and sum(b.nbytes for b in self._batched.values()) + need > int(self.max_batched_bytes):
            self._batched.popitem(last=False)  # freed before the new cone's values are allocated
        bc = self._batched[key] = _BatchedCone(self, entries, state, graph)
        return bc

    def _check_batchable(self, node: str) -> None:
        """Refuses (ValueError) a node whose cone the batch_cone pass cannot stack, whatever the patches:
        batched sites answer or refuse the same way for any patch values."""
        eng = self._engine
        state = (eng, eng.graph_revision(), tuple(eng.pinned()))
        checked = self.__dict__.setdefault("_batch_checked", {})
        if not _same_state(checked.get(node), state):
            _BatchedCone.build_graph(eng, ((node, 2),))
            checked[node] = state


def _own_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with its sizes and strides that no later write into ``t`` reaches: what a standing patch
    keeps. The tensor given to ``patch`` (or returned by its function) may be the caller's own: a write into it
    through ``.data``, ``.numpy()`` or its storage moves no version counter, so the patched node read the new
    contents while its cone kept the outputs computed from the old ones. Copy on write where the memory allows
    it (``_C.lazy_copy``: free unless either side writes); else the elements the view spans, with its strides
    (an expanded or strided view reads the same memory pattern as the tensor given)."""
    copy = _C.lazy_copy(t)
    if copy is not None:
        return copy
    if t.is_conj() or t.is_neg():  # lazy bits the view would not carry: resolved, a new tensor already
        return t.resolve_conj().resolve_neg()
    if t.numel() == 0:
        return t.clone()
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    flat = t.as_strided((span,), (1,), t.storage_offset()).clone()
    return flat.as_strided(t.shape, t.stride(), 0)


def _index_per_dim(key, index, ndim: int) -> tuple:
    """A ``reads`` index as one entry per dim of the output it indexes, in dim order, so that entry ``d``
    is what the index selects along dim ``d`` (a superset where it cannot be exact). Python indexing
    lets entries consume no dim (``None``, ``True``/``False``: a new dim) or several (``...``, an n-d
    bool mask): taken entry by entry, ``(None, -1, 2)`` (row 2 of the last example) read as "row -1,
    column 2", so only row -1 was computed and the metric got NaN for the row it declared. ``None`` and
    bools are dropped, ``...`` becomes full slices, and an n-d bool mask becomes, per dim it covers, the
    coordinates it selects there (int64)."""
    if not isinstance(index, tuple):
        index = (index,)
    out: list = []
    ellipsis_at = None
    for e in index:
        if e is None or isinstance(e, bool):
            continue
        if e is Ellipsis:
            if ellipsis_at is not None:
                raise ValueError(f"reads[{key!r}]: {index!r}: an index can only have a single ellipsis ('...')")
            ellipsis_at = len(out)
            continue
        if isinstance(e, torch.Tensor) and e.dtype == torch.bool:
            if e.dim() == 0:
                continue
            coords = e.nonzero()
            out.extend(coords[:, d].contiguous() for d in range(e.dim()))
            continue
        out.append(e)
    if ellipsis_at is not None:
        out[ellipsis_at:ellipsis_at] = [slice(None)] * max(ndim - len(out), 0)
    return tuple(out)


class _Held:
    """A cache-key entry compared by the identity of the object it holds (and keeping it alive, so that
    its address cannot be taken by another object): the inputs of a run, which are a new tuple per
    run even when they hold the same (possibly since edited) tensors."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj


def _same_state(a, b) -> bool:
    """Equal cache keys: objects (engines, tensors, _Held) compared by identity, tuples element by
    element, strings and numbers by value."""
    if a is b:
        return True
    if isinstance(a, _Held) and isinstance(b, _Held):
        return a.obj is b.obj
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    if isinstance(a, (str, int, float, bool, type(None))) and type(a) is type(b):
        return a == b
    return False


class _BatchedCone:
    """K sites of one node evaluated together: the node's strict cone, stacked K times along dim 0.

    Built by the C++ pass ``batch_cone`` over the engine's graph (no second trace): only the cone
    carries the K-times batch; values it reads from outside are the small graph's cached ones
    (repeated K times where a cone op lines them up with its dim 0), so grafts and standing patches
    (pinned nodes stop the cone) are honoured as they are. Every cone op must be one the pass proves
    keeps the K variants apart along dim 0, with its type exactly the original one with dim 0 times
    K; anything else is refused (ValueError), never answered wrongly. The batched engine is set up
    once with the clean value stacked K times (``setup`` evaluations), so that token-granular cones
    find their cached rows.

    With several entries ``((node, k), ...)`` along a chain, entry j's copies enter at its node (the
    batch grows there): the site placeholder, named after the first node, holds every entry's copies in
    entry order, and copy i of the outputs is the i-th site in that order.
    """

    def __init__(self, rg: "ReactiveGraph", entries: tuple, state: tuple, built=None):
        eng = rg._engine
        graph, externals, stacked, calls = built if built is not None else self.build_graph(eng, entries)
        self.nbytes = _graph_bytes(graph)
        self.state = state
        self.entries = entries
        self.k = k = sum(n for _, n in entries)
        self.stacked = list(stacked)
        self.calls = calls
        self.engine = None
        self.last_stats = None
        self.setup = 0
        if calls == 0:  # nothing to batch: the node is an output, or standing patches cut its cone off
            return
        self.engine = _C.Engine(graph)
        self.engine.set_positions(rg._positions, rg._seq_dim)
        self.engine.share_row_buffers(eng)  # one sweep's units reuse the same hot memory (row_buffers.h)
        self.engine.set_scratch(eng.scratch())

        def tiled(v, times):
            return v.repeat(times, *([1] * (v.dim() - 1)))

        inputs = [tiled(eng.value(src), times) if times else eng.value(src) for _, src, times in externals]
        inputs.append(torch.cat([tiled(eng.value(node), n) for node, n in entries]))
        self.engine.run(inputs)
        # The engine's counters as its last evaluation left them (None: read them again), so that a sweep
        # reads them once per unit, after it; only the sweep loop and this set-up evaluate the engine.
        self.last_stats = self.engine.stats()
        self.setup = self.last_stats["evaluations"]

    @staticmethod
    def build_graph(eng, entries: tuple):
        """The batch_cone pass on the engine's graph (its pinned nodes stop the cone); a refusal is a ValueError."""
        try:
            if len(entries) == 1:
                return _C.batch_cone(eng.graph(), entries[0][0], entries[0][1], list(eng.pinned()))
            return _C.batch_cone(eng.graph(), list(entries), 1, list(eng.pinned()))
        except RuntimeError as e:
            msg = str(e).split("\n")[0].removeprefix("batch_cone: ")
            raise ValueError(f"batched sites cannot be used with this model: {msg}. Sites are stacked along one "
                             "dim of the site (dim 0 first, then the others), which every op of its cone must keep "
                             "apart (move with a transpose or view, never mix); use batch_sites=False") from None

    def split(self, flat: list) -> list[list]:
        """Per site, the outputs: chunk i of each stacked output, the clean value of the others."""
        chunks = [torch.chunk(o, self.k) if st else None for o, st in zip(flat, self.stacked)]
        return [[ch[i] if ch is not None else o for o, ch in zip(flat, chunks)] for i in range(self.k)]


def _type_bytes(t) -> int:
    """Bytes of a value of IR type ``t`` (``("tensor", "f32", shape, strides, device)``, or a tuple or
    list type holding such): what an engine caches for it."""
    if isinstance(t, list):
        return sum(_type_bytes(x) for x in t)
    if not isinstance(t, tuple) or not t:
        return 0
    if t[0] == "tensor":
        return _SHORT_DTYPE[t[1]].itemsize * math.prod(t[2])
    return sum(_type_bytes(e) for e in t[1:])


def _graph_bytes(graph) -> int:
    """Bytes of every value of ``graph`` (a _C.Graph): a batched cone's footprint, for its cache's budget."""
    return sum(_type_bytes(n["type"]) for n in graph.nodes())


def _replay_grafts(target: ReactiveGraph, grafts: list, start: int, where: str, error) -> int:
    """Applies ``grafts[start:]`` to ``target`` (same node names required); returns how many are applied."""
    for src, dst, block, names in grafts[start:]:
        got = target._apply_graft(src, dst, block)
        if got != names:
            raise error(f"replaying graft {src!r} -> {dst or '*'} on {where} produced nodes {got}, not {names}")
        start += 1
    return start


def _cached_baseline(eng, node: str):
    """The engine's baseline of ``node``, or None where it is not cached while patches are active (a graft or an
    in-place write displaced it); the caller then computes it with the patches lifted."""
    try:
        return eng.baseline(node)
    except RuntimeError as e:
        if "is not cached while patches are active" in str(e):
            return None
        raise


def _type_of_tensor(t) -> tuple:
    return list(t.shape), t.dtype, t.device


def _type_differences(got_type: tuple, want_type: tuple, words: str = "") -> tuple[str, str, str] | None:
    """Where a value of ``got_type`` (shape, dtype, device) differs from ``want_type``: (what it has, what it
    must have: its shape and dtype, its device where that differs; which of them differ), e.g. ("dtype
    torch.float64", "[2, 6, 32] of dtype torch.float32", "dtype"); None where it does not. ``words`` names the
    shape's layout ("[batch, pos, head, d_head] = "). A device without an index ("cuda", as a declared type may
    spell it) matches any of its type: the engine's own check stays the judge there, never a false refusal here."""
    (shape, dtype, device), (w_shape, w_dtype, w_device) = got_type, want_type
    got, need, which = [], [f"{words}{list(w_shape)}", f"of dtype {w_dtype}"], []  # what it must be, in full
    if list(shape) != list(w_shape):
        got.append(f"shape {list(shape)}")
        which.append("shape")
    if dtype != w_dtype:
        got.append(f"dtype {dtype}")
        which.append("dtype")
    if device != w_device and not (device.type == w_device.type and None in (device.index, w_device.index)):
        got.append(f"device {device}")
        need.append(f"on {w_device}")
        which.append("device")
    return (", ".join(got), " ".join(need), " and ".join(which)) if got else None


def _refuse_other_layout(ep, src: str, src_type: tuple) -> None:
    """A block whose result has the source's shape and dtype but another memory layout (nn.Linear or a matmul
    after a transposed node returns a fresh contiguous tensor) is refused by the engine ("block output type ...
    differs"), which read like an internal error. This says what happened and what to do: the graph's readers of
    the node were traced for its layout, and copying the result into that layout is exact on both sides (an eager
    hook returning the copy hands its readers the same strides)."""
    outs = [a for a in ep.graph.output_node().args[0] if isinstance(a, torch.fx.Node)]
    val = outs[0].meta.get("val") if len(outs) == 1 else None
    if not isinstance(val, torch.Tensor) or src_type[0] != "tensor":
        return
    shape, strides = list(src_type[2]), list(src_type[3])
    if list(val.shape) != shape or _SHORT_DTYPE.get(src_type[1]) != val.dtype:
        return  # another shape or dtype: the engine's message names both types
    if all(n <= 1 or a == b for n, a, b in zip(shape, val.stride(), strides)):
        return
    raise ValueError(f"graft after {src}: the block returns its result with strides {tuple(val.stride())}, while "
                     f"the node's value has strides {tuple(strides)} (a transposed or permuted layout); the graph's "
                     "readers of the node were traced for that layout, so the block must return it. Copy the result "
                     "into the input's layout at the end of the block, e.g. `return torch.empty_like(x).copy_(y)` "
                     "(the same values; eager readers then see the same strides as the graph's)")


def _refuse_other_device(block: torch.nn.Module, src: str, device: str) -> None:
    """A block holding a parameter or buffer on another device than the value it
    is grafted after is refused by name before its export (which failed with "Unhandled FakeTensor Device
    Propagation ... found two different devices", naming neither the graft nor the tensor)."""
    want = torch.device(device)
    for path, mod in block.named_modules():
        # Parameters and buffers: export makes every one an input. A plain tensor attribute is a constant only
        # where the forward reads it, so one left unread on another device is no reason to refuse.
        for name, t in itertools.chain(mod.named_parameters(recurse=False), mod.named_buffers(recurse=False)):
            d = t.device
            if d.type == "cpu" and t.dim() == 0:
                continue  # a CPU scalar mixes with tensors of any device, in eager too
            if d.type != want.type or (d.index is not None and want.index is not None and d.index != want.index):
                raise ValueError(f"graft after {src!r}: the block's tensor {'.'.join(filter(None, (path, name)))!r} "
                                 f"is on {d}, the value it is grafted after on {device}: move the block there "
                                 f"first (block.to({device!r}))")


def _node_inputs(n) -> list[str]:
    out = []

    def walk(a):
        if isinstance(a, _C.NodeRef):
            out.append(a.name)
        elif isinstance(a, (list, tuple)):
            for e in a:
                walk(e)

    walk(n.args)
    walk([v for _, v in n.kwargs])
    return out


class _FunctionBlock(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


class _HookLayoutBlock(torch.nn.Module):
    """A block grafted by hook name: it sees the hook's layout (TransformerLens's, hook_z split into heads) and
    its result, which must keep that shape, is merged back into the node's layout."""

    def __init__(self, block: torch.nn.Module, conv, hook: str, words: str):
        super().__init__()
        self.block, self.conv, self.hook, self.words = block, conv, hook, words

    def forward(self, x):
        given = self.conv.convert(x)
        out = self.block(given)
        if not isinstance(out, torch.Tensor) or out.shape != given.shape:
            got = f"shape {list(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"graft block after hook {self.hook!r} returned {got}; the hook's value is "
                             f"{self.words}{list(given.shape)}, and the block must return that shape")
        return self.conv.revert(out)


Site = Hashable


@dataclass
class SweepResult:
    """What a sweep measured. ``rho = full_evaluations / predicted_evaluations``."""

    metrics: dict
    measured_evaluations: int
    predicted_evaluations: int
    full_evaluations: int
    num_nodes: int
    wall_time: float
    batched: bool = False
    groups: int = 0
    cost: float = 0.0
    extra: dict = field(default_factory=dict)
    clean_metric: Any = None  # the metric with no site patched (standing patches included)
    node_labels: dict = field(default_factory=dict)  # node -> module path (or hook name), for plots

    @property
    def rho(self) -> float:
        return self.full_evaluations / max(self.predicted_evaluations, 1)

    @property
    def rho_measured(self) -> float:
        return self.full_evaluations / max(self.measured_evaluations, 1)

    def to_pandas(self):
        """One row per site; a dict metric gives one ``metric.<key>`` column per key."""
        import pandas as pd

        rows = []
        for site, value in self.metrics.items():
            node, key = (site if isinstance(site, tuple) else (site, None))
            row = {"site": site, "node": node, "key": key}
            if isinstance(value, dict):
                row.update({f"metric.{k}": v for k, v in value.items()})
            else:
                row["metric"] = value
            rows.append(row)
        return pd.DataFrame(rows)

    def summary(self) -> str:
        return (f"sweep over {len(self.metrics)} sites{' (batched, %d groups)' % self.groups if self.batched else ''}: "
                f"{self.measured_evaluations} evaluations measured, {self.predicted_evaluations} predicted from cones, "
                f"{self.full_evaluations} for full recomputation; rho = {self.rho:.4f} "
                f"(measured {self.rho_measured:.4f}); {self.wall_time * 1e3:.1f} ms")

    def plot(self, path: str, title: str = "patching sweep") -> str:
        """A heatmap PNG: rows are nodes (e.g. layers), columns are keys (positions or heads)."""
        import matplotlib.pyplot as plt

        fig = self.figure(title)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path

    def figure(self, title: str = "patching sweep", row_labels: dict | None = None,
               key_name: str = "site key (position / head index)", baseline: float | None = None):
        """The matplotlib figure behind :meth:`plot` (and ``torch-ext sweep --plot``): a node x key
        heatmap whose diverging colormap is centred on the unpatched metric (``baseline``, by default
        the sweep's ``clean_metric``), or one bar per node when sites carry no key. ``row_labels``
        maps node names to row labels (default: "node (module path)")."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np

        if not all(isinstance(v, float) for v in self.metrics.values()):
            raise TypeError("plot needs one float metric per site (this sweep's metric returned tensors or dicts); "
                            "use to_pandas() instead")
        baseline = self.clean_metric if baseline is None else baseline
        nodes, keys = [], []
        for site in self.metrics:
            node, key = site if isinstance(site, tuple) else (site, None)
            if node not in nodes:
                nodes.append(node)
            if key is not None and key not in keys:
                keys.append(key)
        if row_labels is not None:
            labels = [row_labels.get(n, n) for n in nodes]
        else:
            labels = [f"{n} ({self.node_labels[n]})" if self.node_labels.get(n) else str(n) for n in nodes]
        row_axis = "patched node (layer)" if row_labels is not None else "patched node (module path)"
        if not keys:
            # Sites without a key: one bar per node against the unpatched metric.
            fig, ax = plt.subplots(figsize=(8, max(2.5, 0.35 * len(nodes) + 1.5)))
            ax.barh(range(len(nodes)), [self.metrics[n] for n in nodes], color="tab:blue", label="patched")
            ax.set_yticks(range(len(nodes)), labels, fontsize=8)
            ax.invert_yaxis()  # first node on top, in graph order
            if baseline is not None:
                ax.axvline(baseline, color="tab:red", linestyle="--", label=f"unpatched run: {baseline:.4g}")
            ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0, fontsize=8)
            ax.set_xlabel("metric after patching the node")
            ax.set_ylabel(row_axis)
        else:
            grid = np.full((len(nodes), len(keys)), np.nan)
            for site, value in self.metrics.items():
                grid[nodes.index(site[0]), keys.index(site[1])] = value
            fig, ax = plt.subplots(figsize=(max(6, 0.4 * len(keys) + 3.5), max(3, 0.4 * len(nodes) + 1.8)))
            # Centre the diverging colormap on the unpatched metric, so red and blue mean up and down.
            centre = 0.0 if baseline is None else baseline
            finite = grid[np.isfinite(grid)]
            bound = float(np.max(np.abs(finite - centre))) if finite.size else 0.0
            bound = bound or 1.0
            im = ax.imshow(grid, aspect="auto", cmap="RdBu_r", vmin=centre - bound, vmax=centre + bound,
                           interpolation="nearest")
            ax.set_xticks(range(len(keys)), [str(k) for k in keys], fontsize=8)
            ax.set_yticks(range(len(nodes)), labels, fontsize=8)
            ax.set_xlabel(f"patched {key_name}")
            ax.set_ylabel(row_axis)
            fig.colorbar(im, ax=ax, label="metric after patching the site" +
                         ("" if baseline is None else f"\n(white = unpatched run, {baseline:.4g})"))
        if self.batched:
            cost_line = (f"{self.measured_evaluations} node evaluations on K-times batched graphs "
                         f"({self.groups} groups) vs {self.full_evaluations} for one full pass per site")
        else:
            cost_line = (f"{len(self.metrics)} sites: {self.measured_evaluations} node evaluations vs "
                         f"{self.full_evaluations} for one full pass per site (rho = {self.rho:.2f})")
        ax.set_title(f"{title}\n{cost_line}", fontsize=10)
        fig.tight_layout()
        return fig


def _expand_sites(rg: ReactiveGraph, sites) -> list:
    if isinstance(sites, str):
        found = rg.nodes(sites)
        if not found:
            raise ValueError(f"no node matches {sites!r}")
        # A glob takes the tensors: a node holding a tuple (topk, split) is patched through its getitem nodes.
        tensors = [n for n in found if rg._type_of(n)[0] == "tensor"]
        if not tensors:
            rg._refuse_non_tensor(found[0], "sweep")
        return tensors
    out = list(sites)
    try:
        hash(tuple(out))  # every site at once (one C loop); the one that is not hashable is named below
    except TypeError:
        for site in out:
            try:
                hash(site)
            except TypeError:
                # A site keys the result table (result.metrics[site]); a slice or a list cannot.
                raise TypeError(f"site {site!r}: a site must be hashable, as it keys result.metrics; write a slice "
                                "or a list of positions as a tuple, e.g. (node, (2, 5)), and read it in the patch "
                                "function") from None
        raise
    return out


def _shows_progress(enabled) -> bool:
    """Whether _progress draws a bar (progress asked for, and stderr a terminal)."""
    return bool(enabled) and sys.stderr.isatty()


def _progress(iterable, total, enabled, desc):
    if not _shows_progress(enabled):
        return iterable
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, leave=False)


def _metric_value(m, site):
    """A metric result as stored: a float, a per-example tensor, or a dict of those."""
    if isinstance(m, dict):
        return {k: _metric_value(v, site) for k, v in m.items()}
    if isinstance(m, torch.Tensor):
        return float(m.item()) if m.numel() == 1 else m.detach().clone()
    if isinstance(m, (int, float)) and not isinstance(m, bool):
        return float(m)
    raise TypeError(f"metric at site {site!r} returned {type(m).__name__}; expected a float, a tensor "
                    "(one value or one per example) or a dict of those")


def _measure(rg: ReactiveGraph, metric, outs, site):
    """metric(outs) on copies of the outputs, refusing a metric that writes into them in place.

    The outputs are the cached values, row buffers reused across sites or slices of a batched output: a
    write through ``.data`` or ``.numpy()`` shares their memory but not their version counter, so the
    metric is handed copies (``_C.metric_copy``: copy on write, the same geometry, where the memory allows
    it, so a metric that only reads costs no copy; else a clone), as the C++ loop (sweep_sites) does."""
    if isinstance(outs, torch.Tensor):  # one output (the common case): no lists, one version read
        outs = _C.metric_copy(outs)
        if outs.is_inference():
            return _metric_value(metric(outs), site), False
        version = outs._version
        value = _metric_value(metric(outs), site)
        return value, outs._version != version
    else:
        leaves, spec = pytree.tree_flatten(outs)
        leaves = [_C.metric_copy(t) if isinstance(t, torch.Tensor) else t for t in leaves]
        outs = pytree.tree_unflatten(leaves, spec)
        flat = [t for t in leaves if isinstance(t, torch.Tensor) and not t.is_inference()]
    versions = [t._version for t in flat]
    value = _metric_value(metric(outs), site)
    if any(t._version != v for t, v in zip(flat, versions)):
        return value, True
    return value, False


class _NoKVCache:
    """``past_key_values`` of a Hugging Face output whose graph was traced with ``use_cache=False`` (the cache
    is for generation; see ``_compat.kv_cache_left_out``): eager's output holds the cache there, the graph's
    held None, and a metric reading it failed with "'NoneType' object is not iterable". Any use of it raises,
    saying why; printing it does not."""
    __slots__ = ("_why",)

    def __init__(self, why: str):
        object.__setattr__(self, "_why", why)

    def _refuse(self, *args, **kwargs):
        raise ValueError(object.__getattribute__(self, "_why"))

    __iter__ = __len__ = __getitem__ = __bool__ = __call__ = __contains__ = _refuse

    def __getattr__(self, name):
        if name.startswith("__"):  # copy, pickle and friends look up dunders with getattr(..., None)
            raise AttributeError(name)
        self._refuse()

    def __repr__(self):
        return "<past_key_values: not computed by the graph (traced with use_cache=False)>"


def _mark_no_kv_cache(out, why: str) -> None:
    """Sets a Hugging Face ``ModelOutput``'s empty ``past_key_values`` (``cache``) to a ``_NoKVCache`` (an attribute only:
    not one of its keys, so flattening, ``to_tuple()`` and ``out["past_key_values"]`` are as before)."""
    fields = getattr(type(out), "__dataclass_fields__", None)
    if fields is None:
        return
    for name in ("past_key_values", "cache"):  # transformers 5 names the field cache (past_key_values reads it)
        if name in fields and vars(out).get(name, 0) is None:
            object.__setattr__(out, name, _NoKVCache(why))


class _MarksNoKVCache:
    """A sweep's metric, handed outputs whose missing key/value cache says why when read (``_NoKVCache``)."""

    def __init__(self, metric: Callable, why: str):
        self.metric, self.why = metric, why

    def __call__(self, outs, *args, **kwargs):
        _mark_no_kv_cache(outs, self.why)
        return self.metric(outs, *args, **kwargs)


class _InMetric:
    """A sweep's metric, called with ``rg._in_metric`` set, so that a read of the graph from inside it
    (value(), values(), demand()), which would answer without the site's patch, is refused by name."""

    def __init__(self, rg: "ReactiveGraph", metric: Callable):
        self.rg, self.metric = rg, metric

    def __call__(self, *args, **kwargs):
        before = getattr(self.rg, "_in_metric", False)
        self.rg._in_metric = True
        try:
            return self.metric(*args, **kwargs)
        except RuntimeError as e:
            # Attribution patching: .backward() or torch.autograd.grad on the outputs. torch's words name
            # neither the sweep nor where gradients with respect to activations can come from.
            if "does not require grad" not in str(e):
                raise
            raise RuntimeError(
                f"sweep: the metric asked for a gradient ({e}); the graph runs without autograd, so the outputs "
                "a metric gets carry no grad_fn, and gradients with respect to activations (attribution patching) "
                "cannot be taken inside a sweep. Take them outside it with rg.gradient(metric, nodes) (it re-runs "
                "the nodes' cone with autograd: eager's gradients), or measure each site exactly with sweep(), "
                "which attribution patching approximates") from e
        finally:
            self.rg._in_metric = before


class _HookCache(dict):
    """run_with_cache's cache: a hook name it cannot answer (the other of two hook names in a row after a graft
    through one, see _refuse_other_hook_name) is left out, and asking for it raises the ValueError saying why
    (it held the value before the block, where eager's hook sees the block's output)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.refused: dict[str, str] = {}

    def __missing__(self, key):
        if key in self.refused:
            raise ValueError(self.refused[key])
        raise KeyError(key)


class _ReadsOutside(ValueError):
    """The metric read elements outside ``reads=`` (_ReadCheck); sweep(reads="auto") starts again without."""


class _ReadCheck:
    """The metric of a sweep given ``reads=``, made loud about reading outside the declaration.

    With ``reads=``, elements outside what it declares are not computed (NaN) on some paths (token-granular
    rows, batched or not, the final linear's columns) and computed on others (the whole cone): a metric
    reading them got NaN batched and the true value one at a time, and NaN can vanish in the metric
    (``nan_to_num``, a comparison, ``argmax``). So the metric never sees the engine's outputs: it gets
    copies holding the declared elements, everything else poisoned, the same on every path. It is called
    with the undeclared elements NaN, +inf, -inf and a finite value; a result that differs between the four
    (bit for bit) depends on undeclared elements and is refused, naming the output and the declaration.
    Which elements a metric reads cannot be seen from outside it; its result's dependence on them can, and
    four poisons catch the usual ways of absorbing one (NaN -> 0, inf -> finite, max / argmax /
    comparisons pick a poison or avoid it). The finite one is needed because the three non-finite ones
    can all give the same result: ``nan_to_num(x, nan=0, posinf=0, neginf=0)`` turns each into 0 and
    ``0 * x`` each into NaN, which passed the check and returned 0 or NaN where eager reads true values.
    The metric runs four times per site: it must be a function of the outputs (as it must be for batched
    sites anyway)."""

    # NaN first: the result handed back comes from the NaN copy. 0.75 is exact in every float dtype.
    _POISONS = (float("nan"), float("inf"), float("-inf"), 0.75)

    def __init__(self, rg: "ReactiveGraph", metric: Callable, reads):
        self.metric, self.reads = metric, reads
        outs = rg._output_nodes()
        if rg._single_output is not None:
            self.leaf_outputs = [rg._single_output]
        elif rg._loss_output is None:
            self.leaf_outputs = list(rg._user_outputs)
        else:
            self.leaf_outputs = []  # a training-mode graph: its (loss, gradients) are not checked
        self.names = outs
        # Element ids (float64: exact below 2**53), disjoint across outputs, put through the declaration.
        ids, offsets, offset = [], {}, 0
        for k, node in enumerate(outs):
            t = rg._type_of(node) if node is not None else None
            if t is None or t[0] != "tensor" or not _SHORT_DTYPE[t[1]].is_floating_point:
                ids.append(rg._engine.value(node) if node is not None else None)
                continue
            n = math.prod(t[2])
            ids.append(torch.arange(offset, offset + n, dtype=torch.float64).reshape(t[2]))
            offsets[k] = (offset, n)
            offset += n
        picked = []
        if isinstance(reads, dict):
            for key, index in reads.items():
                k = _read_key(rg, key)
                if k in offsets:
                    picked.append(ids[k][index])
        else:
            # Only ids (float64) declare elements: an integer output is handed over with its own values (not
            # poisoned), and those values, taken as ids, declared float elements the callable never indexed.
            picked = [leaf for leaf in pytree.tree_leaves(reads(rg._user(ids)))
                      if isinstance(leaf, torch.Tensor) and leaf.dtype == torch.float64]
        # Per flat output indexed by the declaration: the flat positions of its declared elements.
        self.declared: dict[int, torch.Tensor] = {}
        for leaf in picked:
            flat = leaf.reshape(-1).to(torch.int64)
            for k, (lo, n) in offsets.items():
                mine = flat[(flat >= lo) & (flat < lo + n)] - lo
                if mine.numel():
                    self.declared[k] = torch.cat([self.declared[k], mine]) if k in self.declared else mine
        self.declared = {k: v.unique() for k, v in self.declared.items()}
        # (flat output, poison index) -> (the poisoned copy, its version after our last write), reused
        # across sites: only the declared elements are copied per site. One the metric wrote is made again.
        self.canvases: dict = {None: (torch.empty(0), 0)}
        self._sole = self._owners(None)  # what _owners reads for a tensor no one else holds
        # The common case (one output, handed to the metric as a tensor, declared elements on it): the four
        # poisoned copies are rows of one buffer, so a site writes its declared elements into all four with
        # one put_ (see _three).
        self._single = (self.leaf_outputs[0] if len(self.leaf_outputs) == 1 and list(self.declared) ==
                        [self.leaf_outputs[0]] else None)
        self._stack = None  # (buffer [4, stride], the four canvases, buffer version, owners) of _three

    def _owners(self, key) -> tuple[int, int]:
        """(Python references, storage users) of a kept canvas: a metric may have kept it, or a view of it."""
        c = self.canvases[key][0]
        return sys.getrefcount(c), torch._C._storage_Use_Count(c.untyped_storage()._cdata)

    def _canvas(self, k: int, i: int, out: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Output ``k`` for the metric: its declared elements (``values``), the rest ``_POISONS[i]``. The
        copy made for the last site is reused while no one else holds it (nor a view of it), unwritten."""
        key = (k, i)
        reuse = key in self.canvases and self._owners(key) == self._sole
        c, version = self.canvases.get(key, (None, None))
        if not reuse or c.shape != out.shape or c.dtype != out.dtype or c.device != out.device or c._version != version:
            c = torch.full(out.shape, self._POISONS[i], dtype=out.dtype, device=out.device)
        c.view(-1).index_copy_(0, self._index(k, out), values)
        self.canvases[key] = (c, c._version)
        return c

    def _index(self, k: int, out: torch.Tensor) -> torch.Tensor:
        idx = self.declared[k]
        return idx if idx.device == out.device else idx.to(out.device)

    def _call(self, outs, i: int, only: int | None = None):
        single = len(self.leaf_outputs) == 1 and isinstance(outs, torch.Tensor)
        leaves, spec = ([outs], None) if single else pytree.tree_flatten(outs)
        if len(leaves) != len(self.leaf_outputs):
            return self.metric(outs)
        given = [self._canvas(k, i, leaf, leaf.reshape(-1).index_select(0, self._index(k, leaf)))
                 if k in self.declared and isinstance(leaf, torch.Tensor) and (only is None or k == only) else leaf
                 for k, leaf in zip(self.leaf_outputs, leaves)]
        return self.metric(given[0] if single else pytree.tree_unflatten(given, spec))

    def _three(self, out: torch.Tensor) -> tuple:
        """The single output's four canvases (its declared elements, the rest NaN, +inf, -inf, 0.75): rows
        of one buffer whose row stride is rounded up to 64 bytes, so each canvas is 64-byte aligned like a
        fresh CPU allocation (vectorised kernels take the same paths as on a separate tensor). Kept for
        the next site while nothing but this holds the buffer, a canvas or a view of one, unwritten; the
        declared elements of all four are then written by one put_."""
        st = self._stack
        if (st is None or st[1][0].dtype != out.dtype or st[1][0].device != out.device or st[0]._version != st[2]
                or any(c.shape != out.shape or not c.is_contiguous() for c in st[1]) or self._stack_owners(st) != st[3]):
            n = out.numel()
            per = max(1, 64 // out.element_size())
            stride = (n + per - 1) // per * per
            buf = torch.empty((len(self._POISONS), stride), dtype=out.dtype, device=out.device)
            for i, poison in enumerate(self._POISONS):
                buf[i].fill_(poison)
            canvases = tuple(buf[i, :n].view(out.shape) for i in range(len(self._POISONS)))
            st = (buf, canvases, None, None)
            st = self._stack = (buf, canvases, None, self._stack_owners(st))
        buf, canvases = st[0], st[1]
        # take/put_: two calls, reading the output in place and writing all four canvases' declared elements.
        src, dst = self._take_put(out, buf.shape[1])
        buf.view(-1).put_(dst, torch.take(out, src))
        self._stack = (buf, canvases, buf._version, st[3])
        return canvases

    def _take_put(self, out: torch.Tensor, stride: int) -> tuple:
        """(indices into the output, repeated per canvas; the same elements' flat indices in the buffer)."""
        key = (stride, tuple(out.shape), out.device)  # the declared indices follow the output's shape
        if getattr(self, "_tp_key", None) != key:
            idx = self._index(self._single, out)
            rows = torch.arange(len(self._POISONS), device=out.device).unsqueeze(1)
            self._tp = (idx.unsqueeze(0).expand(len(self._POISONS), -1).contiguous(), (rows * stride + idx).reshape(-1))
            self._tp_key = key
        return self._tp

    @staticmethod
    def _stack_owners(st) -> tuple:
        """(Python references to each canvas, storage users): a metric that kept a canvas or a view of one."""
        return (tuple(sys.getrefcount(c) for c in st[1]),
                torch._C._storage_Use_Count(st[0].untyped_storage()._cdata))

    def __call__(self, outs):
        if not self.declared:
            return self.metric(outs)
        kept = self._single is not None and isinstance(outs, torch.Tensor)
        if kept:  # the four canvases are rows of one kept buffer (_three)
            canvases = self._three(outs)
            run = lambda i: self.metric(canvases[i])  # noqa: E731
        else:
            run = lambda i: self._call(outs, i)  # noqa: E731
        first = run(0)
        result = _metric_value(first, "checked")
        for i in range(1, len(self._POISONS)):
            if not _same_result(result, _metric_value(run(i), "checked")):
                self._stack = None
                self._refuse(outs)
        # A float holds no view of the kept buffer, which can then be reused at the next site.
        return result if kept and isinstance(result, float) else first

    def _refuse(self, outs):
        culprit = None
        for k in self.declared:  # which output: poisoned alone, does the result still move?
            alone = [_metric_value(self._call(outs, i, only=k), "checked") for i in range(len(self._POISONS))]
            if not all(_same_result(alone[0], r) for r in alone[1:]):
                culprit = k
                break
        what = (f"output {culprit} ({self.names[culprit]!r})" if culprit is not None else "the outputs")
        declared = (f"reads={self.reads!r}" if isinstance(self.reads, dict)
                    else "what the reads callable indexes")
        raise _ReadsOutside(f"sweep: the metric reads elements of {what} outside {declared}: its result changes when "
                         "those elements change (it was run with them NaN, +inf, -inf and 0.75). With reads=, undeclared "
                         "elements are not computed on every path (they would be NaN batched and the true values "
                         "one at a time); declare everything the metric reads in reads=, or leave reads= out")


def _same_result(a, b) -> bool:
    """Bit-identical metric results (NaN equals NaN): floats, tensors or dicts of those."""
    if isinstance(a, dict) or isinstance(b, dict):
        return (isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys()
                and all(_same_result(a[k], b[k]) for k in a))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _same_bits(a, b)
    return a == b or (a != a and b != b)


def _read_key(rg: "ReactiveGraph", key) -> int:
    """The flat output a ``reads`` key names (already validated by _read_rows): as _read_rows resolves it, by
    one rule (a leaf index of the returned structure, a node or hook name, a key such as "logits")."""
    return rg._output_index(key, rg._output_nodes())


def _raise_metric_wrote(rg: ReactiveGraph, site):
    raise ValueError(f"the metric wrote into the model outputs in place at site {site!r}; it was handed copies, "
                     "so the cache is intact, but a metric must not write into its outputs. Compute on a copy "
                     "instead (e.g. out = out.clone()).")


def _site_path(rg: ReactiveGraph, node: str, pinned, read_rows) -> str:
    """How a site on ``node`` is evaluated: "rows" (token-granular cone), "fast" (the prepared cone) or
    "transaction" (patch -> demand -> rollback). It depends only on the engine's state, which every site
    of a sweep leaves as it found it, so a sweep asks once per node."""
    eng = rg._engine
    if read_rows is not None and not pinned and eng.can_evaluate_patched_rows() and eng.seq_axis(node) >= 0:
        return "rows"
    if node not in pinned and eng.can_evaluate_patched():
        return "fast"
    return "transaction"


def _one_site(rg: ReactiveGraph, site, node: str, patch: Callable, metric: Callable, pinned=(), read_rows=None,
              path: str | None = None, identical: list | None = None, given: torch.Tensor | None = None):
    """One sweep transaction: patch -> demand -> metric -> rollback (standing patches and grafts kept).

    With ``read_rows`` ((rows, columns) read per output, possibly empty) and token-granular cones
    available, only the rows the patch changed (and the metric reads) are recomputed. ``path`` is
    ``_site_path``'s answer for ``node``, when the caller already has it. With ``identical`` (a list),
    a patched value bit-identical to the node's current one is not evaluated: the site takes the
    current outputs (zero evaluations) and is appended to the list (``sweep(skip_identical=True)``). With
    ``given`` (the patch function's value for this site, computed by the batched driver) the patch function
    is not called again: it runs once per site on every path (a noise patch draws once, as in eager)."""
    if given is None:
        patch = rg._hook_view(site[0] if isinstance(site, tuple) else site, patch)
    else:
        patch = lambda v, s, given=given: given  # noqa: E731  (hook conversions already applied)
    eng = rg._engine
    if path is None:
        path = _site_path(rg, node, pinned, read_rows)
    if identical is not None:
        current = eng.value(node)  # valid already: zero evaluations
        value = rg._call_patch_fn(node, lambda v: patch(v, site), current, f"sweep patch function at site {site!r}")
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"patch function at site {site!r} returned {type(value).__name__}, expected a tensor")
        if _same_layout(value, current) and _same_bits(value, current):
            identical.append(site)
            result, wrote = _measure(rg, metric, rg._user(eng.demand()), site)
            if wrote:
                _raise_metric_wrote(rg, site)
            return result
        patch = lambda v, s, value=value: value  # noqa: E731  (computed above: the patch function runs once)
    if path == "rows":
        value = rg._call_patch_fn(node, lambda v: patch(v, site), eng.value(node),
                                  f"sweep patch function at site {site!r}")
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"patch function at site {site!r} returned {type(value).__name__}, expected a tensor")
        result, wrote = _measure(rg, metric, rg._user(eng.evaluate_patched_rows(node, value.detach(), *read_rows)),
                                 site)
        if wrote:
            _raise_metric_wrote(rg, site)
        return result
    if path == "fast":
        # The fast path: the cone's prepared order, values freed at last use, everything put back.
        value = rg._call_patch_fn(node, lambda v: patch(v, site), eng.value(node),
                                  f"sweep patch function at site {site!r}")
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"patch function at site {site!r} returned {type(value).__name__}, expected a tensor")
        result, wrote = _measure(rg, metric, rg._user(eng.evaluate_patched(node, value.detach())), site)
        if wrote:
            _raise_metric_wrote(rg, site)
        return result
    eng.begin_transaction()
    wrote = False
    try:
        current = eng.value(node)  # valid already: zero evaluations
        value = rg._call_patch_fn(node, lambda v: patch(v, site), current, f"sweep patch function at site {site!r}")
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"patch function at site {site!r} returned {type(value).__name__}, expected a tensor")
        eng.patch(node, value.detach())
        result, wrote = _measure(rg, metric, rg._user(eng.demand()), site)
    finally:
        eng.rollback()
    if wrote:
        _raise_metric_wrote(rg, site)
    return result


def _sweep_in_cpp(rg: ReactiveGraph, site_list: list, nodes: list, names: list, patch, metric, pinned, rows,
                  metrics: dict, identical: list | None = None, clean: list | None = None) -> None:
    """The one-at-a-time sweep loop with the per-site work in C++ (``_C.Engine.sweep_sites``): each run of
    consecutive sites that take the prepared cone ("fast" or "rows", see ``_site_path``) is one call, in
    which Python runs only ``patch`` and ``metric``; a site on a node pinned by a standing patch takes
    the transaction path (``_one_site``). Same values, counts and checks as ``_one_site``. ``nodes`` and
    ``names`` are each site's node and the name it was given (a node or hook name). With ``identical`` (a
    list), sites whose patched value is bit-identical to the node's current one take the current outputs
    unevaluated and are appended to it (``sweep(skip_identical=True)``). With ``clean`` (an empty list, given
    only where every site takes the prepared cone: one call), the metric of the current outputs is appended
    to it before the first site (the sweep's unpatched metric)."""
    eng = rg._engine
    read_rows = rows[0] if rows is not None else None
    # The engine's state is the same at every site (each leaves it as it found it): asked once.
    can_rows = read_rows is not None and not pinned and eng.can_evaluate_patched_rows()
    can_fast = eng.can_evaluate_patched()
    every = not pinned and can_fast  # every site takes the prepared cone: nothing to ask per node
    in_cpp: dict = {}
    if not every:
        for node in nodes:
            if node not in in_cpp:
                # sweep_sites takes the row path for a node with a sequence axis when can_rows, else the whole cone.
                in_cpp[node] = node not in pinned and (can_fast or (can_rows and eng.seq_axis(node) >= 0))
    # By hook name the function is seen through the hook (its layout, and its result checked naming the hook);
    # None: every site was named by node, so every site gets the function itself.
    views: dict | None = None
    if rg._hooks:
        views = {}
        for name in names:
            if name not in views:
                views[name] = rg._hook_view(name, patch)
        if all(v is patch for v in views.values()):
            views = None
    user = rg._single_output if rg._single_output is not None else rg._user
    spec = read_rows if read_rows is not None else ([], [])
    i = 0
    while i < len(site_list):
        if not every and not in_cpp[nodes[i]]:
            metrics[site_list[i]] = _one_site(rg, site_list[i], nodes[i], patch, metric, pinned, read_rows,
                                              "transaction", identical)
            i += 1
            continue
        j = len(site_list) if every else i
        while j < len(site_list) and in_cpp[nodes[j]]:
            j += 1
        part, part_nodes = site_list[i:j], nodes[i:j]

        def fail(kind, k, value=None, part=part):
            if k < 0:  # the unpatched metric (clean)
                _raise_metric_wrote(rg, "unpatched")
            site = part[k]
            if kind == "patch_wrote":
                raise ValueError(
                    f"sweep patch function at site {site!r} wrote in place into the activation it was given (an op "
                    "such as `act[...] = ...` or `act.mul_(...)`); it was handed a copy, so the cache is intact, but "
                    "the patch was not applied. Return a new tensor instead, e.g. `act = act.clone()` first.")
            if kind == "not_tensor":
                raise TypeError(f"patch function at site {site!r} returned {type(value).__name__}, expected a tensor")
            _raise_metric_wrote(rg, site)

        fns = [patch] * (j - i) if views is None else [views[n] for n in names[i:j]]
        same: list = []
        values = eng.sweep_sites(part_nodes, part, fns, can_rows, spec[0], spec[1],
                                 metric, user, _metric_value, fail, identical is not None, same,
                                 clean if i == 0 else None)
        metrics.update(zip(part, values))
        if identical is not None:
            identical.extend(part[k] for k in same)
        i = j


def _patched_values(rg: ReactiveGraph, nodes: list, members: list, patch: Callable) -> list:
    """The patch function's value for each site (``members``, on ``nodes``; its node's current value given to
    each), called once per site in the order given: the order an eager-hook sweep calls it in, so a patch
    drawing from a seeded generator draws the same values. Each value is kept as the function returned it
    then: a later write into the tensor returned (a reused buffer) does not reach it."""
    values = []
    value = rg._engine.value
    node_was = name_was = None  # a node's value and a name's hook view, looked up once per run of its sites
    for node, s in zip(nodes, members):
        if node != node_was:
            clean, node_was = value(node), node
            shape, dtype, device = clean.shape, clean.dtype, clean.device
        name = s[0] if isinstance(s, tuple) else s
        if name != name_was:
            fn, name_was = rg._hook_view(name, patch), name
        v = rg._call_patch_fn(node, lambda t, s=s, fn=fn: fn(t, s), clean, f"sweep patch function at site {s!r}")
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"patch function at site {s!r} returned {type(v).__name__}, expected a tensor")
        # Checked here, one by one, as the engine checks a single patch: the batched path concatenates the
        # values along dim 0, and a [2B, ...] value beside a [0, ...] one has the stacked shape of two [B, ...]
        # ones, so the engine's check on the stack passed and each site got rows of the other's value.
        if v.shape != shape or v.dtype != dtype or v.device != device:
            raise RuntimeError(
                f"patch %{node} at site {s!r}: expected shape {list(clean.shape)}, dtype {clean.dtype}, device "
                f"{clean.device}; got shape {list(v.shape)}, dtype {v.dtype}, device {v.device}")
        # Kept as a copy (copy on write: free unless a side writes): the values are stacked only after every
        # site of the unit has run, and a function that writes each site's value into one buffer it returns
        # (or a view of it) left every site but the last reading the last one's bits, silently.
        values.append(_own_copy(v.detach()))
    return values


def _balanced_shares(units: list, costs: list[float], world: int) -> list[list]:
    """Longest-processing-time-first: units sorted by cost, each to the least-loaded rank. The same
    on every rank (ties broken by position), so no communication is needed to agree on it."""
    loads = [0.0] * world
    shares: list[list] = [[] for _ in range(world)]
    for i in sorted(range(len(units)), key=lambda i: (-costs[i], i)):
        r = min(range(world), key=lambda r: (loads[r], r))
        loads[r] += costs[i]
        shares[r].append(units[i])
    return shares


_DISTRIBUTED_SWEEPS = 0  # sweeps started on this rank; every rank counts the same (sweeps are collective)


def _claimed_chunks(units: list, costs: list[float], rank: int, world: int, flatten: bool = True):
    """Chunks of units (sites, or a node's sites when batching) for this rank, largest predicted
    cost first. Rank r starts with chunk r; later chunks go to whichever rank asks first, through an
    atomic counter in the process group's store. Predicted costs alone balance badly once cones are
    token-granular (a patch at a late position recomputes few rows): a rank that finishes early
    takes more. Every site is swept exactly once, so the table is the same as with a fixed split."""
    import torch.distributed as dist

    global _DISTRIBUTED_SWEEPS
    _DISTRIBUTED_SWEEPS += 1
    order = [units[i] for i in sorted(range(len(units)), key=lambda i: (-costs[i], i))]
    size = max(1, -(-len(order) // (8 * world)))
    chunks = [[s for unit in order[i:i + size] for s in unit] if flatten else order[i:i + size]
              for i in range(0, len(order), size)]
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # no store: the fixed longest-processing-time-first split
        share = _balanced_shares(units, costs, world)[rank]
        yield [s for unit in share for s in unit] if flatten else share
        return
    if rank < len(chunks):
        yield chunks[rank]
    key = f"torch_ext/sweep/{_DISTRIBUTED_SWEEPS}"
    while True:
        i = world + store.add(key, 1) - 1
        if i >= len(chunks):
            return
        yield chunks[i]


def _distributed_sweep(rg: ReactiveGraph, site_list: list, patch, metric, progress: bool,
                       batch_sites: bool, rows=None, skip_identical: bool = False) -> SweepResult:
    """Splits the sites across the ranks of the default process group by predicted cone cost (when
    batching, the batched units every rank plans alike, so a unit's sites stay one batch), sweeps the
    local share and gathers one result on every rank. Every rank must hold the same graph, inputs and
    standing mutations."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("sweep(distributed=True) needs torch.distributed initialised on every rank "
                           "(under torchrun: torch.distributed.init_process_group('gloo'))")
    rank, world = dist.get_rank(), dist.get_world_size()
    # Ranks that differ (a model initialised without a common seed, other inputs, a patch applied on
    # one rank only) would each answer for their own model, and the merged table would mix them.
    mine = _sweep_fingerprint(rg, site_list, batch_sites)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    for part, what in enumerate(_FINGERPRINT_PARTS):
        differ = [r for r, fp in enumerate(everyone) if fp[part] != everyone[0][part]]
        if differ:
            raise RuntimeError(f"sweep(distributed=True): rank(s) {differ} hold other {what} than rank 0; every "
                               "rank must build the same model (seed it), run the same inputs, apply the same "
                               "patches and grafts, and sweep the same sites")

    def node_of(site):
        return rg.resolve(site[0] if isinstance(site, tuple) else site)

    t0 = time.perf_counter()
    if batch_sites:
        # Every rank plans the same batched units (chains of nodes, row batches: they depend on every site's
        # patch), then runs those it claims, so the table is the single-process one bit for bit.
        claim = (lambda units, costs: _claimed_chunks(units, costs, rank, world, flatten=False), rank == 0)
        parts = [_sweep(rg, site_list, patch, metric, progress, batch_sites, False, rows, skip_identical, claim)]
    else:
        units = [[s] for s in site_list]
        cost_of: dict = {}
        costs = [cost_of.setdefault(node_of(s), rg._engine.cone_cost(node_of(s))) for s in site_list]
        parts = [_sweep(rg, chunk, patch, metric, progress, batch_sites, False, rows, skip_identical)
                 for chunk in _claimed_chunks(units, costs, rank, world)]
    wall = time.perf_counter() - t0
    payload = ({k: v for part in parts for k, v in part.metrics.items()},
               sum(part.measured_evaluations for part in parts), sum(part.predicted_evaluations for part in parts),
               sum(part.cost for part in parts), wall, parts[0].clean_metric if parts else None,
               sum(part.groups for part in parts), sum(part.extra.get("identical_sites", 0) for part in parts))
    gathered: list = [None] * world
    dist.all_gather_object(gathered, payload)
    merged = {}
    for part in gathered:
        merged.update(part[0])
    metrics = {s: merged[s] for s in site_list}  # the caller's order, whatever rank measured it
    clean = next((p[5] for p in gathered if p[5] is not None), None)
    full = len(site_list) * rg.num_nodes
    return SweepResult(metrics, sum(p[1] for p in gathered), sum(p[2] for p in gathered), full, rg.num_nodes,
                       max(p[4] for p in gathered), batched=batch_sites, groups=sum(p[6] for p in gathered),
                       cost=sum(p[3] for p in gathered), clean_metric=clean,
                       node_labels={k: v for part in parts for k, v in part.node_labels.items()},
                       extra={"ranks": world, "rank_wall_times": [p[4] for p in gathered],
                              "rank_sites": [len(p[0]) for p in gathered],
                              "identical_sites": sum(p[7] for p in gathered)})


_FINGERPRINT_PARTS = ("sites (or batch_sites)", "graphs (grafts included)", "standing patches",
                      "clean outputs (weights, inputs or patch values differ)")


def _sweep_fingerprint(rg: ReactiveGraph, site_list: list, batch_sites: bool) -> tuple:
    """What every rank of a distributed sweep must share, as digests: the sites, the graph, the
    pinned nodes and the bytes of the current outputs (which the weights, inputs, grafts and
    standing patch values all reach)."""
    import hashlib

    from .distributed import _digest

    def digest(text: str) -> str:
        return hashlib.sha256(text.encode()).hexdigest()

    outputs = [_digest(leaf) if isinstance(leaf, torch.Tensor) else repr(leaf)
               for leaf in pytree.tree_leaves(rg.demand())]
    return (digest(repr((list(site_list), bool(batch_sites)))), digest(str(rg._engine)), tuple(rg._engine.pinned()),
            digest(repr(outputs)))


# One engine evaluation's fixed cost (dispatch, bookkeeping) in FLOPs of arithmetic: about 10 us at
# ~30 GFLOP/s on one CPU core. Only the split of batched sites into row batches (_row_batches) reads it.
_NODE_OVERHEAD_FLOPS = 3e5


def _row_batches(first: list[int], length: int, overhead: float) -> list[tuple[int, int]]:
    """Splits sites sorted by first changed row into contiguous batches [lo, hi) minimising
    sum(overhead + (hi - lo) * (length - first[lo])): each batch computes rows [first[lo], length) of
    every member, and costs ``overhead`` (in rows of one site) once. Exact dynamic programme, O(n^2)."""
    n = len(first)
    best = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)
    for hi in range(1, n + 1):
        for lo in range(hi):
            c = best[lo] + overhead + (hi - lo) * (length - first[lo])
            if c < best[hi]:
                best[hi], cut[hi] = c, lo
    bounds = []
    hi = n
    while hi > 0:
        bounds.append((cut[hi], hi))
        hi = cut[hi]
    return bounds[::-1]


# A chained unit's cost per engine evaluation in FLOPs, and the largest value a chained unit may hold. The
# cost is what a unit's evaluation costs besides its arithmetic: refitted (tlbatch47) by least squares of
# thread time on (evaluations, FLOPs) over the plans this constant gives between 5e4 and 1.2e6, on the
# TinyTransformer units of scripts/bench_sweep.py (d_model 64, batch 8: 6.7 us per evaluation at 50 GFLOP/s,
# 3.4e5 FLOPs; with reads= 6.6 us at 74 GFLOP/s, 4.9e5; the earlier fit, 1.3e5, was ~1.9 us at ~65 GFLOP/s;
# noisy: a loaded machine). 3.5e5 against 1.3e5, medians of 6 interleaved repeats: d_model 64 19.9 vs 19.9 ms,
# with reads 20.3 vs 21.2; d_model 128 41.9 vs 41.6, with reads 38.1 vs 40.7 (5 vs 7 groups at 64, 7 vs 13
# at 128). It is the order of _NODE_OVERHEAD_FLOPS (3e5), one node's. The bound was 0.5 MiB while every
# unit's values came from the allocator, which
# handed fresh pages back per unit past it; the row path now writes its large values into the engines'
# shared RowBufferPool (row_buffers.h), and with 4 MiB no minor fault is counted per sweep at d_model 64
# or 128 (getrusage, batch 8), where 0.5 MiB split those sweeps into more, smaller units (8 -> 7 groups
# at d_model 64, 16 -> 13 at 128; 1-6% of their thread time in interleaved A/B runs, a shared machine).
_CHAIN_OVERHEAD_FLOPS = 3.5e5
_UNIT_BYTES = float(1 << 22)


def _value_bytes(eng, node: str) -> int:
    """Bytes of a node's cached value (tensors of a tuple summed); 0 for other values."""
    v = eng.value(node)
    ts = v if isinstance(v, (tuple, list)) else (v,)
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))


def _chain_memo(rg: ReactiveGraph) -> dict:
    """Per graph (engine and revision) answers of the chain planning that depend on structure only: each
    batched sweep asks them again (cones as name sets, value sizes), ~0.5 ms of a 15 ms sweep."""
    eng = rg._engine
    memo = rg.__dict__.get("_chain_memo_entry")
    if memo is None or memo[0] is not eng or memo[1] != eng.graph_revision():
        memo = rg._chain_memo_entry = (eng, eng.graph_revision(), {})
    return memo[2]


def _node_chains(rg: ReactiveGraph, nodes: list) -> list[list]:
    """Groups row-path site nodes into chains along which copies can enter one batched cone (batch_cone's
    entries form): graph order, each node in the strict cone of the one before, all of one type (one
    placeholder holds every entry's copies). Greedy, upstream first; by node structure only (every
    row-path site node, its sites identical or not)."""
    memo = _chain_memo(rg)
    key = ("chains", tuple(nodes))
    if key in memo:
        return memo[key]
    order = memo.get("order")
    if order is None:
        order = memo["order"] = {n: i for i, n in enumerate(rg._countable)}
    eng = rg._engine
    chains: list[list] = []
    cone_of = None
    for node in sorted(nodes, key=lambda n: order.get(n, -1)):
        if chains and cone_of is not None and node in cone_of and _same_type(eng.value(node), eng.value(chains[-1][0])):
            chains[-1].append(node)
        else:
            chains.append([node])
        cone_of = set(eng.cone(node))
    memo[key] = chains
    return chains


def _row_path_node(rg: ReactiveGraph, node: str, read_rows) -> bool:
    """Whether a batched sweep runs this node's sites on the row path (token-granular cones)."""
    eng = rg._engine
    return (read_rows is not None and not eng.pinned() and eng.can_evaluate_patched_rows()
            and eng.seq_axis(node) >= 0)


def _chain_units(rg: ReactiveGraph, chain: list) -> list:
    """Batches over a chain's sites (batch_sites=True on the row path): every site sorted by its first
    changed row, then split into contiguous batches [lo, hi) minimising the predicted cost, each batch one
    unit whose copies enter at their own nodes. A batch costs one engine evaluation per node of its most
    upstream node's cone (_CHAIN_OVERHEAD_FLOPS each) plus, per member, its node's cone on rows
    [first[lo], length); no batch holds a value over _UNIT_BYTES. One node is _row_batches' split, as
    before: chains give fewer units where several layers share a position, each copy still running only
    its own node's cone."""
    memo = _chain_memo(rg)
    plans = memo.setdefault("plans", {})
    key = (tuple(node for node, *_ in chain), tuple(tuple(first) for *_, first, _ in chain), chain[0][4])
    plan = plans.get(key)
    if plan is None:
        if len(plans) >= _MAX_CHAIN_PLANS:
            plans.clear()
        plan = plans[key] = _chain_plan(rg, key[0], key[1], key[2])
    return [(entries, [chain[c][1][i] for c, i in picks], [chain[c][2][i] for c, i in picks])
            for entries, picks in plan]


# Plans kept per graph (_chain_memo) by their nodes and first changed rows: a sweep run again with the same
# patches (a new metric, the benchmark's repeats) plans its units once.
_MAX_CHAIN_PLANS = 64


def _chain_plan(rg: ReactiveGraph, nodes: tuple, firsts: tuple, length: int) -> list:
    """_chain_units' split as indices: ``[(entries, [(chain index, member index), ...]), ...]``. A function
    of the nodes (their costs and value sizes: structure) and the members' first changed rows only."""
    eng = rg._engine
    if len(nodes) == 1:  # one node: _row_batches' split, as before chains
        node, first = nodes[0], firsts[0]
        if len(first) == 1:
            return [(((node, 1),), [(0, 0)])]
        order = sorted(range(len(first)), key=lambda i: (first[i], i))
        per_row = max(eng.cone_cost(node), 1.0) / max(length, 1)
        bounds = _row_batches([first[i] for i in order], length,
                              _NODE_OVERHEAD_FLOPS * max(rg._cone_size(node), 1) / per_row)
        return [(((node, hi - lo),), [(0, i) for i in order[lo:hi]]) for lo, hi in bounds]
    sites = []  # (first row, chain index, member index)
    for c, first in enumerate(firsts):
        sites.extend((f, c, i) for i, f in enumerate(first))
    sites.sort(key=lambda t: (t[0], t[1]))
    per_row = [max(eng.cone_cost(node), 1.0) / max(length, 1) for node in nodes]
    overhead = [_CHAIN_OVERHEAD_FLOPS * max(rg._cone_size(node), 1) for node in nodes]
    # The largest value one copy carries, per row: a unit whose largest value would pass _UNIT_BYTES is
    # not formed (beyond it the allocator hands back fresh pages, faulted in at every unit).
    memo = _chain_memo(rg)
    widest = memo.get(("widest", nodes[0]))
    if widest is None:
        widest = memo[("widest", nodes[0])] = max(_value_bytes(eng, m) for m in eng.cone(nodes[0])) / max(length, 1)
    n = len(sites)
    best = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)
    for hi in range(1, n + 1):
        top = len(nodes)
        rows = 0.0  # sum over members [lo, hi) of their cone cost per row
        for lo in range(hi - 1, -1, -1):
            if lo < hi - 1 and (hi - lo) * widest * (length - sites[lo][0]) > _UNIT_BYTES:
                break
            top = min(top, sites[lo][1])
            rows += per_row[sites[lo][1]]
            c = best[lo] + overhead[top] + rows * (length - sites[lo][0])
            if c < best[hi]:
                best[hi], cut[hi] = c, lo
    plan = []
    hi = n
    while hi > 0:
        lo = cut[hi]
        part = sorted(sites[lo:hi], key=lambda t: t[1])  # entry order, upstream first (stable: rows kept)
        entries = []
        for _, c, _ in part:
            if entries and entries[-1][0] == nodes[c]:
                entries[-1][1] += 1
            else:
                entries.append([nodes[c], 1])
        plan.append((tuple((node, k) for node, k in entries), [(c, i) for _, c, i in part]))
        hi = lo
    return plan[::-1]


def _same_type(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape, device and layout: what _same_bits checks before comparing bits."""
    return a.dtype == b.dtype and a.shape == b.shape and a.device == b.device and a.layout == b.layout


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same strides in every dim of size > 1 (a and b of one shape): a patch value with the cached value's bits in
    another layout is another input to the cone (a reduction or GEMM reads it in another order), as in eager."""
    return a.dim() == b.dim() and all(n <= 1 or sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride()))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical tensors (so -0.0 and 0.0 differ, and equal NaNs agree)."""
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    if a.dtype.is_complex or a.dtype.is_floating_point:
        width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(a.element_size())
        if width is None:
            return False
        return torch.equal(a.contiguous().view(width), b.contiguous().view(width))
    return torch.equal(a, b)


def sweep(rg: ReactiveGraph, sites, patch: Callable[[torch.Tensor, Any], torch.Tensor],
          metric: Callable[[Any], Any], *, progress: bool = True, batch_sites: bool = False,
          distributed: bool = False, positions: bool | None = None, reads=None,
          skip_identical: bool = True) -> SweepResult:
    """Patches each site, demands, measures and rolls back.

    ``sites`` is a glob over node names / module paths, or a list of node names or ``(node, key)``
    tuples (e.g. ``("add_3", position)``). ``patch(value, site)`` returns the patched value, where
    ``value`` is the node's current value (standing patches and grafts included); it must return a
    new tensor, not write into ``value``. ``metric(outputs)`` returns a float, a tensor (one value
    per example is kept as a tensor) or a dict of those; it is handed copies of the outputs (copy on
    write: free unless written, so a write through ``.data`` or ``.numpy()`` cannot reach the cache),
    and an in-place write into them is refused as for ``patch``. Each site runs as a transaction: the
    sweep leaves standing patches and grafts exactly as it found them, also when a callback raises.

    With ``batch_sites=True`` the sites that share a node (so their cones coincide) are evaluated
    together: K variants stacked along dim 0 of the node's cone, built by the C++ pass batch_cone over
    this graph (grafts included; standing patches stop the cone; values outside it are the cached ones),
    the shared cone evaluated once. A site whose patched value is bit-identical to the node's value, in its
    layout (strides), takes the unpatched metric; a value in another layout (the same bits or not) is another
    input to the cone, as in eager, and runs alone on its whole cone. The patch function runs once per site,
    in site order, on every path. With token-granular cones the sites are sorted by the first row their
    patch changes and split into row batches (``batch_sites=K``: at most K each; ``True``: the split
    with the least predicted cost). With ``True``, site nodes along one chain (each in the cone of the one
    before, of one type: the residual stream's layers) share batches: a batch holds sites of several
    nodes, each copy entering at its own node (batch_cone's entries form), so one position's sites across
    layers run as one unit. Every cone op must be proven to keep dim 0 apart, and its shape
    must be the original with dim 0 times K; a model where that fails is refused with a ValueError,
    never answered wrongly.

    With ``distributed=True`` (every rank of an initialised ``torch.distributed`` default group calls
    it with the same graph and sites, e.g. under ``torchrun``) the sites are split across the ranks,
    balanced by predicted cone cost, and every rank returns the whole table, equal to a
    single-process sweep's.

    Token-granular cones are on by default (``positions=None`` follows the graph's setting,
    ``positions=False`` turns them off for this sweep): a patched value that differs from the clean
    one only from row p on along the node's sequence axis recomputes only rows [p, T) of the nodes
    the sequence-axis analysis bounds, the whole node elsewhere. ``reads={output: index}`` declares
    what the metric reads (``{"logits": (slice(None), -1, [tok_a, tok_b])}``): rows that reach no
    read row are not computed, nor, for a final linear or matmul, the columns not read; a callable
    ``reads=lambda logits: logits[:, -1, [tok_a, tok_b]]`` says the same by indexing. The metric then
    receives copies of the outputs holding the declared elements, everything else poisoned, on every
    path (batched or not, rows or whole cones): it is run with the undeclared elements NaN, +inf, -inf
    and 0.75, and a result that differs between the four (it read outside ``reads``) raises a ValueError
    naming the output, rather than a NaN batched and the true value one at a time. So the metric runs
    four times per site and must be a function of the outputs. ``reads="auto"`` infers the
    declaration from one call of the metric on the clean outputs (torch_ext/_read_inference.py: the
    elements that reach an op other than a view, a constant index or a copy); each site is checked as
    above, and a site that reads outside it makes the sweep start again without ``reads``
    (``extra["inferred_reads"]``: the reads, why, and whether it reran; raised under ``distributed``). Standing
    patches fall back to node-granular cones; batched sites use them too. With early cutoff on, a
    patched value equal to the clean one is cut off at the site and a changed one takes the same
    row-range path as with cutoff off (same bits).

    With ``skip_identical=True`` (the default) a one-at-a-time site whose patched value is
    bit-identical to the node's current value (same shape, dtype, strides and bits: -0.0 is not 0.0;
    the same bits in another layout are another input, which a reduction reads in another order) is not
    evaluated: its cone would recompute the cached values, so it takes the current outputs (the
    unpatched metric, as batched sites always do), the same bits. It costs zero evaluations and
    leaves the ledger: ``predicted_evaluations`` sums ``|V+(s)|`` over the other sites only,
    ``extra["identical_sites"]`` counts the skipped ones and ``extra["skipped_evaluations"]`` what
    their cones would have cost (docs/cost-model-positions.md, "Identical sites"). With
    ``skip_identical=False`` every site costs its cone, as the plain cost model states.
    """
    with _one_check_per_call():  # the weights are compared once: patching looked them up already
        site_list = _expand_sites(rg, sites)
        if not site_list:
            raise ValueError("sweep needs at least one site")
        rg._refuse_during_sweep("sweep()")
        if positions is not None and not isinstance(positions, bool):
            raise TypeError(f"sweep(positions=...) must be a bool or None, got {type(positions).__name__}")
        if not isinstance(batch_sites, bool) and (not isinstance(batch_sites, int) or batch_sites < 2):
            raise ValueError(f"sweep(batch_sites=...) must be a bool or an int >= 2 (sites per batch), "
                             f"got {batch_sites!r}")
        use_rows = rg.positions if positions is None else positions
        if not isinstance(skip_identical, bool):
            raise TypeError(f"sweep(skip_identical=...) must be a bool, got {type(skip_identical).__name__}")
        auto = isinstance(reads, str) and reads == "auto"
        if isinstance(reads, str) and not auto:
            raise ValueError(f"sweep(reads=...) takes a dict, a callable, \"auto\" or None, got {reads!r}")
        # The model written in place before the sweep is an edit the engine takes now (num_dirty reads, so it
        # settles); during it, a patch function or metric writing into the model is refused (engine.h, I15).
        eng = rg._engine
        rg._take_untracked_writes()
        eng.num_dirty()
        inferred = None
        if auto:  # from the settled outputs
            reads, why = _infer_sweep_reads(rg, metric)
            inferred = {"reads": reads, "why": why, "rerun_without": None}
        rows = ((rg._read_spec(reads) if reads is not None else ([], [])), reads) if use_rows else None
        if reads is not None and not use_rows:
            rg._read_rows(reads)  # still checked: a bad reads argument is refused either way
        if getattr(rg, "_no_kv_cache", None):
            metric = _MarksNoKVCache(metric, rg._no_kv_cache)  # innermost: it marks the copies the metric reads
        plain = metric  # what a rerun without reads= measures
        if reads is not None and rg._last_inputs is not None:
            metric = _ReadCheck(rg, metric, reads)  # the same inputs on every path; reading outside them is refused
        metric = _InMetric(rg, metric)  # value() / demand() from the metric would read the unpatched graph: refused
        rg._sweeping = True
        eng.set_inputs_frozen(True)
        try:
            try:
                result = _sweep(rg, site_list, patch, metric, progress, batch_sites, distributed, rows, skip_identical)
            except _ReadsOutside as e:
                # An inferred reads= was too small at some site (the metric's reads depend on the values): the
                # sites done so far were rolled back as always; the sweep starts again reading every element.
                # Not under distributed=True: the other ranks would not know, and the collectives would hang.
                if inferred is None or distributed:
                    raise
                inferred["rerun_without"] = str(e).split(":")[0]
                plain_rows = (([], []), None) if use_rows else None
                result = _sweep(rg, site_list, patch, _InMetric(rg, plain), progress, batch_sites, distributed,
                                plain_rows, skip_identical)
            if inferred is not None:
                result.extra["inferred_reads"] = inferred
            return result
        finally:
            rg._sweeping = False
            eng.set_inputs_frozen(False)


def _infer_sweep_reads(rg: ReactiveGraph, metric: Callable):
    """(reads, why) for ``sweep(reads="auto")``: what the metric reads of the current outputs (_read_inference),
    or (None, why) where nothing is gained or it cannot be found. A training-mode graph's (loss, gradients) are
    not read-checked, so nothing is inferred for it."""
    if rg._last_inputs is None or (rg._single_output is None and rg._loss_output is not None):
        return None, "no read check for this graph's outputs"
    names = rg._output_nodes()
    values = [rg._engine.value(n) if n is not None else None for n in names]
    reads, why = _read_inference.infer_reads(metric, values, names, rg._user)
    if reads is not None:
        try:
            rg._read_rows(reads)
        except (ValueError, TypeError) as e:  # e.g. a sequence-axis index the row rule cannot express
            return None, f"inferred reads not usable: {e}"
    return reads, why


def _rows_between(before: dict, after: dict) -> fractions.Fraction:
    """The row-weighted evaluations (stats["row_evaluations"]) from engine stats ``before`` to ``after``, exactly:
    from their integer parts ({T: rows}, meaning the sum of rows / T), so a sweep's share equals its closed form
    in docs/cost-model-positions.md once rounded, instead of a difference of two rounded sums."""
    a, b = after["row_evaluations_exact"], before["row_evaluations_exact"]
    if all(t == 1 or k == b.get(t, 0) for t, k in a.items()):  # whole evaluations only (T = 1): an integer
        return fractions.Fraction(a.get(1, 0) - b.get(1, 0))
    return sum((fractions.Fraction(k - b.get(t, 0), t) for t, k in a.items()), fractions.Fraction(0))


def _sweep_plan(rg: ReactiveGraph, site_list: list) -> tuple:
    """(names, nodes, labels, cone sizes) of a site list: each site's node or hook name, its node, the label
    of each name, and |V+| of each node; an unknown node is refused."""
    known = rg._node_names()
    resolve = rg._hooks.get
    names = [s[0] if isinstance(s, tuple) else s for s in site_list]
    site_nodes = [resolve(n, n) for n in names]  # node_of, once per site
    cones = {}
    labels = {}
    paths_of = rg._module_paths.get
    for name, n in zip(names, site_nodes):
        if n not in cones:
            if n not in known:
                rg.resolve(name)  # a hook refused, or nothing reads it: says why
                raise ValueError(f"sweep: unknown node {n!r}")
            rg._refuse_non_tensor(n, "sweep")
            rg._refuse_joint_edit(n, "sweep")
            cones[n] = None
        if name not in labels:
            labels[name] = paths_of(n, "") if name == n else n
    rg._cone_size(next(iter(cones)))  # makes the cache (per node below: a dict read, not a method call)
    sizes = rg._cone_sizes
    for n in cones:
        size = sizes.get(n)
        cones[n] = size if size is not None else rg._cone_size(n)
    return names, site_nodes, labels, cones


def _sweep(rg: ReactiveGraph, site_list: list, patch, metric, progress: bool, batch_sites: bool,
           distributed: bool, rows=None, skip_identical: bool = False, claim=None) -> SweepResult:
    """``claim`` (distributed batched sweeps): ``(claim(units, costs), keep_identical)``; the units, planned
    the same on every rank, are run as ``claim`` hands them out, and identical sites are answered only
    where ``keep_identical``."""
    if distributed:
        return _distributed_sweep(rg, site_list, patch, metric, progress, batch_sites, rows, skip_identical)
    read_rows = rows[0] if rows is not None else None
    eng = rg._engine
    if eng.in_transaction():
        raise RuntimeError("sweep: a sweep transaction is already open on this graph (sweeps do not nest)")

    def node_of(site):
        return rg.resolve(site[0] if isinstance(site, tuple) else site)

    # What a site list resolves to (names, nodes, labels, cone sizes) depends only on the graph: kept per
    # site list until a graft or another input shape replaces the graph (with _cone_sizes), so a repeated
    # sweep does none of this per-site Python.
    plans = rg.__dict__.get("_sweep_plans")
    if plans is None:
        plans = rg._sweep_plans = {}
    plan_key = tuple(site_list)
    plan = plans.get(plan_key)
    if plan is None:
        plan = _sweep_plan(rg, site_list)
        if len(plans) >= 8:  # a few site lists at a time
            del plans[next(iter(plans))]
        plans[plan_key] = plan
    names, site_nodes, labels, cones = plan
    labels = dict(labels)  # the result's own: a caller editing it leaves the plan intact
    if rg._last_inputs is None:
        raise ValueError("sweep: the graph has no values yet; give example_inputs or call run() first")
    full = len(site_list) * rg.num_nodes
    # Pending mutations are brought up to date once, outside the measured loop; the unpatched metric
    # centres the plots. rg.demand() less what sweep() did already in this call (the contents compared,
    # _take_untracked_writes): its hook and attribute checks, then the engine's demand. Where every site
    # runs in one sweep_sites call (one at a time, no standing patch, no progress bar) and nothing is stale,
    # that call measures the unpatched outputs first (`clean`), the same metric on the same copies.
    clean: list | None = None
    standing = eng.pinned()  # asked once: the sweep refuses mutations while it runs
    if standing or rg.__dict__.get("_graft_hook_names"):
        for site, node in zip(site_list, site_nodes):
            rg._refuse_other_hook_name(site[0] if isinstance(site, tuple) else site, node, "sweep")
    shows = _shows_progress(progress)
    if (not batch_sites and not standing and not shows and eng.num_dirty() == 0
            and eng.can_evaluate_patched()):
        rg._refuse_changed_hooks("demand")
        rg._refuse_changed_attributes("demand")
        clean = []
        clean_metric = None
    else:
        clean_metric, wrote = _measure(rg, metric, rg._demand(None), "unpatched")
        if wrote:
            _raise_metric_wrote(rg, "unpatched")
    metrics: dict = {}
    # What patching a node costs now: its strict cone up to the standing patches (a pinned node keeps its
    # value, so the cone stops there), the same for every site of the node.
    live = {n: len(eng.cone(n, True)) for n in cones} if standing else cones
    if not batch_sites:
        predicted = sum(map(live.__getitem__, site_nodes))
        st0 = eng.stats()  # the engine's counters (rg.stats adds only per-shape fields)
        t0 = time.perf_counter()
        pinned = set(standing)
        paths: dict = {}
        identical: list | None = [] if skip_identical else None
        if not shows:  # no progress bar to update per site: the loop runs in C++
            _sweep_in_cpp(rg, site_list, site_nodes, names, patch, metric, pinned, rows, metrics, identical, clean)
            if clean is not None:
                clean_metric = clean[0]
        else:
            if clean is not None:  # left to the C++ loop, which does not run: measured here, before any site
                clean_metric, wrote = _measure(rg, metric, rg._user(eng.demand()), "unpatched")
                if wrote:
                    _raise_metric_wrote(rg, "unpatched")
            for s in _progress(site_list, len(site_list), progress, "sweep"):
                node = node_of(s)
                path = paths.get(node)
                if path is None:
                    path = paths[node] = _site_path(rg, node, pinned, read_rows)
                metrics[s] = _one_site(rg, s, node, patch, metric, pinned, read_rows, path, identical)
        wall = time.perf_counter() - t0
        st1 = eng.stats()
        extra = {"row_evaluations": float(_rows_between(st0, st1)),
                 "positions": read_rows is not None and not pinned}
        if identical is not None:
            # Skipped sites leave the ledger (docs/cost-model-positions.md, "Identical sites").
            skipped = sum(live[node_of(s)] for s in identical) if identical else 0
            predicted -= skipped
            extra.update(identical_sites=len(identical), skipped_evaluations=skipped)
        return SweepResult(metrics, st1["evaluations"] - st0["evaluations"], predicted, full, rg.num_nodes, wall,
                           cost=st1["cost"] - st0["cost"], clean_metric=clean_metric, node_labels=labels,
                           extra=extra)

    groups: dict = {}
    for s, node in zip(site_list, site_nodes):  # the plan's nodes (node_of, resolved once per site list)
        groups.setdefault(node, []).append(s)
    measured = 0
    cost = 0.0
    row_evals = fractions.Fraction(0)
    setup = 0
    t0 = time.perf_counter()
    # A site whose patched value is bit-identical to the node's current one changes nothing: its metric is
    # the unpatched one (what one-at-a-time recomputation gives), and it is not stacked. With token-granular
    # cones, a node's other sites are sorted by the first row their patch changes and split into batches
    # that each start at their own first row: batch_sites=K, batches of at most K; batch_sites=True, the
    # split that minimises the predicted cost (_row_batches).
    chunk = batch_sites if not isinstance(batch_sites, bool) else None
    units = []  # (entries ((node, k), ...), members, values), members in entry order
    rowed = {}  # batch_sites=True on the row path: node -> (node, members, values, first rows, length)
    row_nodes = []  # every row-path node, its sites identical or not: chains do not depend on patch values
    identical = 0
    # The sweep demanded above and refuses mutations while it runs: the current outputs are the cached ones,
    # read from the engine (rg.demand() would repeat the per-call hook and attribute checks per site).
    for node, members in groups.items():
        if len(members) > 1:
            rg._check_batchable(node)
    # The patch function runs once per site, in site order (as an eager-hook sweep calls it); each value is
    # passed on, also to the sites evaluated one at a time below.
    value_of = dict(zip(site_list, _patched_values(rg, site_nodes, site_list, patch)))
    for node, members in groups.items():
        vals = [value_of[s] for s in members]
        current = eng.value(node)
        by_rows = _row_path_node(rg, node, read_rows)
        if by_rows and chunk is None:
            row_nodes.append(node)
        # A value in another layout than the cached one (the same bits or not) is another input to the cone: a
        # reduction over it rounds otherwise, as eager, which runs the cone on it, does. It is never identical,
        # and never stacked (torch.cat lays the stack out afresh) nor run from its first changed row (the rows
        # before it were computed from the cached layout): it runs alone, on its whole cone, in its layout.
        strides = current.stride()  # the same strides (the common case) is the same layout
        layout = [v.stride() == strides or _same_layout(v, current) for v in vals]
        if by_rows:
            # One byte scan per site gives both answers: the first changed row, and (== the length, for a
            # value of the node's shape and dtype) bit-identity, as _same_bits would say.
            length = current.shape[eng.seq_axis(node)]
            first_of = [eng.first_changed_row(node, v) if _same_type(v, current) and lay else -1
                        for v, lay in zip(vals, layout)]
            same = [f >= length for f in first_of]
        else:
            first_of = None
            same = [lay and _same_bits(v, current) for v, lay in zip(vals, layout)]
        kept = []
        for i, (s, v) in enumerate(zip(members, vals)):
            if not layout[i]:
                units.append((((node, 1),), [s], [v]))
            elif same[i]:
                if claim is None or claim[1]:
                    metrics[s], w = _measure(rg, metric, rg._user(eng.demand()), s)  # _user: single-output fast path
                    if w:
                        _raise_metric_wrote(rg, s)
                    identical += 1
            else:
                kept.append((s, v, first_of[i] if first_of is not None else None))
        members, vals = [s for s, _, _ in kept], [v for _, v, _ in kept]
        if not members:
            continue
        if by_rows and chunk is None:
            rowed[node] = (node, members, vals, [f for _, _, f in kept], length)
        elif len(members) > 1 and by_rows:
            first = [f for _, _, f in kept]
            order = sorted(range(len(members)), key=lambda i: (first[i], i))
            for j in range(0, len(order), chunk):
                part = order[j:j + chunk]
                units.append((((node, len(part)),), [members[i] for i in part], [vals[i] for i in part]))
        elif chunk is not None and len(members) > chunk:
            for j in range(0, len(members), chunk):
                units.append((((node, len(members[j:j + chunk])),), members[j:j + chunk], vals[j:j + chunk]))
        else:
            units.append((((node, len(members)),), members, vals))
    for nodes in _node_chains(rg, row_nodes):
        chain = [rowed[n] for n in nodes if n in rowed]
        if chain:
            units.extend(_chain_units(rg, chain))
    total_units = len(units)
    if claim is not None:  # every rank planned the same units: each runs those it claims
        costs = [sum(eng.cone_cost(n) * k for n, k in entries) for entries, _, _ in units]
        units = (u for part in claim[0](units, costs) for u in part)
    predicted_batched = 0
    ran = 0
    # The graph, its inputs and standing patches cannot change while the sweep runs (mutations are refused,
    # the inputs frozen): the batched cones' cache key is taken once, not per unit.
    batched_state = rg._batched_state() if rg._last_inputs is not None else None
    for entries, members, given in _progress(units, total_units, progress, "sweep (batched)"):
        ran += 1
        k = len(members)
        node = entries[0][0]
        if k == 1:  # nothing to batch: the graph itself is the cheapest
            predicted_batched += live[node]
            before, cost_before = rg.stats["evaluations"], rg.stats["cost"]
            rows_before = eng.stats()
            pinned = set(eng.pinned())
            # A value in another layout takes the one-site paths as well: the engine runs its whole cone on the
            # functional kernels, which keep that layout as eager's do (Engine::evaluate_cone_whole).
            metrics[members[0]] = _one_site(rg, members[0], node, patch, metric, pinned, read_rows, given=given[0])
            measured += rg.stats["evaluations"] - before
            cost += rg.stats["cost"] - cost_before
            row_evals += _rows_between(rows_before, eng.stats())
            continue
        key = entries[0] if len(entries) == 1 else entries
        old = rg._batched.get(key)
        bc = rg._batched_entries(entries, batched_state)
        if bc is not old:
            setup += bc.setup
        if bc.engine is None:  # an empty cone (the node is an output, or pins cut it off): one at a time
            predicted_batched += k * live[node]
            for s, v in zip(members, given):
                before, cost_before = rg.stats["evaluations"], rg.stats["cost"]
                metrics[s] = _one_site(rg, s, node, patch, metric, set(eng.pinned()), read_rows, given=v)
                measured += rg.stats["evaluations"] - before
                cost += rg.stats["cost"] - cost_before
            continue
        # The batched cone: the live cone less the nodes that reach no output (only through a pinned node),
        # with the entries' slices and joins when copies enter at several nodes.
        predicted_batched += bc.calls
        values = given
        big = bc.engine
        st_before = bc.last_stats if bc.last_stats is not None else big.stats()
        bc.last_stats = None  # stays so if the evaluation or a metric raises: read again next time
        by_rows = read_rows is not None and big.can_evaluate_patched_rows() and big.seq_axis(node) >= 0
        wrote = []
        if by_rows:
            flat = big.evaluate_patched_rows(node, torch.cat(values), *rows[0])
        else:
            flat = big.evaluate_patched(node, torch.cat(values))
        for s, parts in zip(members, bc.split(flat)):
            metrics[s], w = _measure(rg, metric, rg._user(parts), s)
            if w:
                wrote.append(s)
        # Drop the outputs now: the engine reuses their buffers only while it holds the sole reference.
        del flat, parts
        if wrote:  # into the copies _measure handed it: the batched engine's outputs are intact
            _raise_metric_wrote(rg, wrote[0])
        st_after = bc.last_stats = big.stats()
        measured += st_after["evaluations"] - st_before["evaluations"]
        cost += st_after["cost"] - st_before["cost"]
        row_evals += _rows_between(st_before, st_after)
    wall = time.perf_counter() - t0
    return SweepResult(metrics, measured, predicted_batched, full, rg.num_nodes, wall, batched=True,
                       groups=ran, cost=cost, extra={"setup_evaluations": setup, "row_evaluations": float(row_evals),
                                                            "identical_sites": identical},
                       clean_metric=clean_metric,
                       node_labels=labels)
