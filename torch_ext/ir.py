"""Python face of the C++ graph IR: import from torch.export, print, parse, verify, export back to FX.

The importer only translates FX nodes to IR nodes; it performs no graph transformation.
"""
from __future__ import annotations

import copy
import operator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Sequence

import torch
import torch.fx

from . import _C, _compat

_DTYPE_SHORT = {
    torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
    torch.bool: "b8", torch.complex64: "c64", torch.complex128: "c128",
}
_SHORT_DTYPE = {v: k for k, v in _DTYPE_SHORT.items()}
_SPECIALS = {
    "dtype": {f"torch.{str(d).split('.')[-1]}": d for d in _DTYPE_SHORT},
    "layout": {"torch.strided": torch.strided, "torch.sparse_coo": torch.sparse_coo, "torch.sparse_csr": torch.sparse_csr},
    "memory_format": {
        "torch.contiguous_format": torch.contiguous_format, "torch.preserve_format": torch.preserve_format,
        "torch.channels_last": torch.channels_last, "torch.channels_last_3d": torch.channels_last_3d,
    },
}


def _higher_order_table() -> dict:
    """FX target -> entry of the C++ higher-order op table (csrc/ir/higher_order.h)."""
    table = {}
    for hop in _C.higher_order_ops():
        op = getattr(torch.ops.higher_order, hop["name"], None)  # absent from this torch: not importable
        if op is not None:
            table[op] = dict(hop, op=op)
    return table


_HIGHER_ORDER = _higher_order_table()
_HIGHER_ORDER_BY_TARGET = {hop["target"]: hop for hop in _HIGHER_ORDER.values()}


def _fetch_attr(owner, target: str):
    obj = owner
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _higher_order_args(node: torch.fx.Node, hop: dict):
    """(IR args, region get_attr nodes) of a higher-order call, in its table entry's FX layout."""
    args, regions = [None] * len(hop["args"]), [None] * hop["num_regions"]
    for value, (kind, i) in zip(node.args, hop["fx_args"]):
        if kind == "region":
            regions[i] = value
        else:
            args[i] = list(value) if hop["args"][i][1] == "list" else value
    return args, regions


class UnsupportedNodeError(NotImplementedError):
    """The importer met an FX node it cannot translate yet."""


def _type_of(val: Any, where: str):
    if isinstance(val, torch.Tensor):
        if val.dtype not in _DTYPE_SHORT:
            raise UnsupportedNodeError(f"{where}: dtype {val.dtype} is not supported")
        if any(not isinstance(s, int) for s in val.shape):
            raise UnsupportedNodeError(f"{where}: dynamic shape {tuple(val.shape)} is not supported (export with static shapes)")
        return ("tensor", _DTYPE_SHORT[val.dtype], list(val.shape), list(val.stride()), str(val.device))
    if isinstance(val, (tuple, list)):
        return ("tuple", [_type_of(v, where) for v in val])
    if isinstance(val, bool):
        return ("bool",)
    if isinstance(val, int):
        return ("int",)
    if isinstance(val, float):
        return ("float",)
    if val is None:
        return ("none",)
    raise UnsupportedNodeError(f"{where}: value of type {type(val).__name__} is not supported")


def _eval_batch_norm_saved(node, val):
    """An eval-mode batch norm's empty saved statistics in the CPU kernel's dtype, the running mean's: export
    declares the input's, and a bfloat16 input with float32 statistics (a BatchNorm in eval under bfloat16
    autocast) failed the IR verifier with an internal error."""
    rm = node.args[3].meta.get("val") if len(node.args) > 3 and isinstance(node.args[3], torch.fx.Node) else None
    if not isinstance(rm, torch.Tensor) or len(val) != 3:
        return val
    return (val[0], *(v.new_empty((0,), dtype=rm.dtype) if isinstance(v, torch.Tensor) and v.numel() == 0
                      and v.dtype != rm.dtype else v for v in val[1:]))


def _refuse_python_number(node, tname: str) -> None:
    """A node whose value is a symbolic Python number (``.item()``, ``.tolist()``, ``float(t)`` read in forward
    and used in arithmetic) is refused naming the op and the module whose forward read it: the program cannot
    hold a number that changes per call (this was "value of type SymFloat is not supported")."""
    val = node.meta.get("val")
    if not isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return
    stack = list((node.meta.get("nn_module_stack") or {}).values())
    path, cls = stack[-1] if stack else ("", "")
    cls = str(getattr(cls, "__qualname__", cls)).rsplit(".", 1)[-1]
    owner = f"{cls}.forward" + (f" (module {path!r})" if path else " (the model itself)") if cls else "forward"
    raise UnsupportedNodeError(
        f"the model reads a tensor's value as a Python number (node '{node.name}', {tname.split('.')[0]}) in "
        f"{owner}: `.item()`, `.tolist()` or `float(t)` give a number that changes per call, which one traced "
        "program cannot hold; keep it a tensor (`t.sum()` for `sum(t.tolist())`, `t.amax()` for `max(t.tolist())`)")


def _arg_to_ir(a: Any, where: str):
    if isinstance(a, torch.fx.Node):
        return _C.NodeRef(a.name)
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    if isinstance(a, (list, tuple)):
        return [_arg_to_ir(x, where) for x in a]
    if isinstance(a, torch.dtype):
        return _C.Special("dtype", f"torch.{str(a).split('.')[-1]}")
    if isinstance(a, torch.device):
        return _C.Special("device", str(a))
    if isinstance(a, torch.layout):
        return _C.Special("layout", str(a))
    if isinstance(a, torch.memory_format):
        return _C.Special("memory_format", str(a))
    raise UnsupportedNodeError(f"{where}: argument {a!r} of type {type(a).__name__} is not supported")


def _arg_from_ir(a: Any, env: dict):
    if isinstance(a, _C.NodeRef):
        return env[a.name]
    if isinstance(a, list):
        return [_arg_from_ir(x, env) for x in a]
    if isinstance(a, _C.Special):
        if a.kind == "device":
            return torch.device(a.text)
        return _SPECIALS[a.kind][a.text]
    return a


def _resolve_target(target: str):
    if target == "getitem":
        return operator.getitem
    ns, rest = target.split("::", 1)
    name, overload = rest.split(".", 1)
    packet = getattr(getattr(torch.ops, ns), name)
    return getattr(packet, overload)


def _fake_of(t):
    """A meta-device tensor standing in for an IR type (for node.meta['val'])."""
    if t[0] == "tensor":
        return torch.empty_strided(t[2], t[3], dtype=_SHORT_DTYPE[t[1]], device="meta")
    if t[0] == "tuple":
        return tuple(_fake_of(e) for e in t[1])
    return None


@dataclass(frozen=True, eq=False)
class Node:
    """A read-only view of one IR node, as it was when ``Graph.nodes()`` / ``Graph.node()`` read it.

    ``args`` hold ``_C.NodeRef`` (a reference by name), Python scalars and strings, lists, and
    ``_C.Special`` constants (dtype, device, layout, memory format); ``type`` is the IR type as a tuple
    (``("tensor", dtype, sizes, strides, device)``, ``("tuple", [...])``, ``("int",)`` ...).
    """

    kind: str  # "placeholder", "call" or "output"
    name: str
    type: tuple
    module_path: str
    target: str | None  # call nodes: "ns::op.overload" or "getitem"
    role: str | None  # placeholders: "parameter", "buffer", "optimizer_state", "constant" or "input"
    state_name: str | None  # placeholders: the state_dict key ("" for user inputs)
    args: tuple
    kwargs: tuple  # (name, arg) pairs, in call order
    users: tuple  # names of the nodes that read this one, in graph order
    num_regions: int
    _source: Any = field(repr=False)  # the _C.Graph read, for the regions

    @staticmethod
    def _of(d: dict, source) -> "Node":
        return Node(d["kind"], d["name"], d["type"], d["module_path"], d.get("target"), d.get("role"),
                    d.get("state_name"), tuple(d["args"]), tuple(d["kwargs"]), tuple(d["users"]),
                    d["num_regions"], source)

    @cached_property
    def regions(self) -> tuple["Graph", ...]:
        """The branches / bodies a cond or while_loop owns; copied once, on first read, not per view."""
        if not self.num_regions:
            return ()
        return tuple(Graph(r) for r in self._source.regions(self.name))


def _inline_grad_mode_regions(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm``, or a copy whose grad-mode regions (``wrap_with_set_grad_enabled``: export's record of a
    ``torch.no_grad()`` block in forward) are inlined. torch_ext runs every graph without autograd (a
    joint graph holds its backward as ops), so a region's grad mode changes no value; its ops are
    copied in its place. A region that reads attributes of its own (a nested region) stays a region."""
    hop = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)
    if hop is None or not any(n.op == "call_function" and n.target is hop for n in gm.graph.nodes):
        return gm
    gm = copy.deepcopy(gm)
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not hop:
            continue
        region = node.args[1]
        sub = _fetch_attr(gm, region.target) if region.op == "get_attr" else None
        if not isinstance(sub, torch.fx.GraphModule) or any(n.op == "get_attr" for n in sub.graph.nodes):
            continue
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        with graph.inserting_before(node):
            outs = graph.graph_copy(sub.graph, dict(zip(placeholders, node.args[2:])))
        outs = outs if isinstance(outs, (list, tuple)) else (outs,)
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(outs[user.args[1]])
                graph.erase_node(user)
        if node.users:  # used whole: the tuple of its outputs is not an IR value
            raise UnsupportedNodeError(f"node '{node.name}': a grad-mode region whose outputs are used as a tuple")
        graph.erase_node(node)
        if not region.users:
            graph.erase_node(region)
    graph.lint()
    gm.recompile()
    return gm


class Graph:
    """A torch_ext IR graph (C++ owned)."""

    def __init__(self, cgraph: "_C.Graph | None" = None):
        self._g = cgraph if cgraph is not None else _C.Graph()

    # ---- construction
    @staticmethod
    def from_exported(ep: torch.export.ExportedProgram) -> "Graph":
        """Imports an ExportedProgram's graph and signature. Unsupported nodes raise UnsupportedNodeError."""
        if not isinstance(ep, torch.export.ExportedProgram):
            raise TypeError(f"from_exported expects a torch.export.ExportedProgram, got {type(ep).__name__}")
        gm = _inline_grad_mode_regions(ep.graph_module)
        return Graph.from_fx(gm.graph, ep.graph_signature, owner=gm)

    @staticmethod
    def from_fx(fx_graph: torch.fx.Graph, signature=None, owner: torch.nn.Module | None = None) -> "Graph":
        """Imports an FX graph. torch.cond / while_loop become call nodes owning their branches and
        bodies as regions; the region signatures are verified at import."""
        g = _C.Graph()
        owner = owner if owner is not None else fx_graph.owning_module
        subgraphs: dict[str, torch.fx.GraphModule] = {}
        retyped: dict[torch.fx.Node, tuple] = {}  # results declared otherwise than export's meta (see below)
        has_regions = False
        roles = {}
        if signature is not None:
            for spec in signature.input_specs:
                role = _compat.INPUT_ROLES.get(spec.kind)
                if role is None:
                    raise UnsupportedNodeError(f"input '{spec.arg.name}': input kind {spec.kind.name} is not supported")
                roles[spec.arg.name] = (role, spec.target or "")
        for node in fx_graph.nodes:
            where = f"node '{node.name}'"
            if node.op == "placeholder":
                role, state = roles.get(node.name, ("input", ""))
                val = node.meta.get("val")
                if isinstance(val, str) and role == "input":
                    # A string input (forward(x, mode="sum")): export specialised the program to its value
                    # (a constant; other values are refused at run, or built as their own graph), so nothing
                    # reads the placeholder: it takes None (reactive._flat_inputs passes None for it).
                    if node.users:
                        raise UnsupportedNodeError(f"{where}: the string input {val!r} is read by "
                                                   f"{sorted(u.name for u in node.users)}; string values in the "
                                                   "graph are not supported")
                    val = None
                g.add_placeholder(node.name, role, _type_of(val, where), state)
            elif node.op == "get_attr" and isinstance(_fetch_attr(owner, node.target), torch.fx.GraphModule):
                subgraphs[node.name] = _fetch_attr(owner, node.target)
            elif node.op == "call_function" and node.target in _HIGHER_ORDER:
                hop = _HIGHER_ORDER[node.target]
                tname = hop["target"]
                where = f"node '{node.name}' ({tname})"
                args, region_nodes = _higher_order_args(node, hop)
                regions = []
                for rn in region_nodes:
                    if rn.name not in subgraphs:
                        raise UnsupportedNodeError(f"{where}: region {rn.name!r} is not a GraphModule attribute")
                    sub = subgraphs[rn.name]
                    regions.append(Graph.from_fx(sub.graph, owner=sub)._g)
                g.add_call(node.name, tname, [_arg_to_ir(a, where) for a in args], [],
                           _type_of(node.meta.get("val"), where), _compat.module_path(node), regions)
                has_regions = True
            elif node.op == "call_function":
                target = node.target
                if target is operator.getitem:
                    tname = "getitem"
                else:
                    qual = _compat.op_name(target)
                    if isinstance(target, torch._ops.HigherOrderOperator):
                        raise UnsupportedNodeError(
                            f"{where}: higher-order operator {target.__name__!r} is not supported by torch_ext yet "
                            f"(torch {torch.__version__}; supported: {', '.join(h['name'] for h in _HIGHER_ORDER.values())})")
                    if qual is None:
                        raise UnsupportedNodeError(
                            f"{where}: target {getattr(target, '__name__', target)!r} is not supported "
                            "(only ATen/custom OpOverloads and getitem are)")
                    tname = f"{qual[0]}.{qual[1]}"
                where = f"node '{node.name}' ({tname})"
                _refuse_python_number(node, tname)
                args = [_arg_to_ir(a, where) for a in node.args]
                kwargs = [(k, _arg_to_ir(v, where)) for k, v in node.kwargs.items()]
                val = node.meta.get("val")
                if tname == "aten::_native_batch_norm_legit_no_training.default" and isinstance(val, (tuple, list)):
                    val = retyped[node] = _eval_batch_norm_saved(node, val)
                elif tname == "getitem" and node.args and node.args[0] in retyped:
                    val = retyped[node.args[0]][node.args[1]]
                g.add_call(node.name, tname, args, kwargs, _type_of(val, where), _compat.module_path(node))
            elif node.op == "output":
                outs = node.args[0]
                g.set_output([_arg_to_ir(a, "output") for a in (outs if isinstance(outs, (list, tuple)) else [outs])])
            else:
                raise UnsupportedNodeError(f"{where}: FX op '{node.op}' (target {node.target!r}) is not supported")
        if has_regions:
            errors = g.verify_errors()
            if errors:
                raise ValueError("invalid control flow at import:\n  " + "\n  ".join(errors))
        return Graph(g)

    @staticmethod
    def parse(text: str) -> "Graph":
        return Graph(_C.Graph.parse(text))

    # ---- inspection
    def __str__(self) -> str:
        return str(self._g)

    def __len__(self) -> int:
        return len(self._g)

    def verify(self) -> None:
        """Raises RuntimeError listing every structural or schema problem."""
        self._g.verify()

    def nodes(self) -> list[Node]:
        """Read-only views of every node, in graph order (the output node last)."""
        return [Node._of(d, self._g) for d in self._g.nodes()]

    def node(self, name: str) -> Node:
        """A read-only view of the node called ``name``; RuntimeError names it when there is none."""
        return Node._of(self._g.node(name), self._g)

    def clone(self) -> "Graph":
        return Graph(self._g.clone())

    # ---- IR-level passes (csrc/passes), for work on hand-written or imported graphs
    def schedule(self, donate: bool = True) -> tuple[str, list[tuple[str, int]]]:
        """Reorders the calls in place for the smallest simulated peak (csrc/passes/schedule.h); returns
        the chosen candidate order's name and every candidate's (name, peak bytes)."""
        return _C.schedule(self._g, donate)

    def plan_memory(self, donate: bool = True) -> dict:
        """The memory plan of the graph in its current order (csrc/passes/plan_memory.h): peak_bytes,
        arena_bytes, buffers, lower bounds, ... (the graph is not changed)."""
        return _C.plan_memory(self._g, donate)

    def split_convolution_backward(self, nodes: Sequence[str] | None = None) -> list[str]:
        """Splits each named convolution_backward (default: every splittable one) that computes the input and
        the weight gradient into one call per part, in place (csrc/passes/split_convolution_backward.h);
        returns the names split. RuntimeError names a node that cannot be split, the graph untouched."""
        names = self.splittable_convolution_backwards() if nodes is None else list(nodes)
        return _C.split_convolution_backward(self._g, names)

    def splittable_convolution_backwards(self) -> list[str]:
        """The convolution_backward calls ``split_convolution_backward`` can split, in graph order."""
        return _C.splittable_convolution_backwards(self._g)

    def rematerialize(self, nodes: Sequence[str]) -> tuple[int, int]:
        """Recomputes each named forward node at its backward uses, in place (csrc/passes/rematerialize.h);
        returns (nodes recomputed, clones added). RuntimeError names a node that cannot be recomputed."""
        return _C.rematerialize(self._g, list(nodes))

    def rematerialize_for_budget(self, budget: int, donate: bool = True, prune_by_bound: bool = True) -> dict:
        """Recomputes forward nodes, in place, until the planned peak fits ``budget`` bytes: feasible,
        peak, min_peak, forward_flops, added_flops, recomputed, evaluations (trials), pruned (trials settled
        by the liveness bound without planning the arena). ``prune_by_bound=False`` plans every trial in full:
        the same result, slower (a reference)."""
        return _C.rematerialize_for_budget(self._g, budget, donate, prune_by_bound)

    # ---- back to the ecosystem
    def to_graph_module(self) -> torch.fx.GraphModule:
        """A GraphModule taking every placeholder (lifted state and user inputs) as flat positional inputs."""
        return _to_graph_module(self)


def _to_graph_module(graph: Graph, scalar_output: bool = False) -> torch.fx.GraphModule:
    root = torch.nn.Module()
    fx = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}
    for n in graph.nodes():
        if n.kind == "placeholder":
            node = fx.placeholder(n.name)
        elif n.kind == "call" and n.num_regions:
            subs = []
            hop = _HIGHER_ORDER_BY_TARGET[n.target]
            for i, region in enumerate(n.regions):
                attr = f"{n.name}_region{i}"
                # Some regions return a bare value in FX, not a tuple (a while_loop's condition).
                setattr(root, attr, _to_graph_module(region, scalar_output=i in hop["bare_output_regions"]))
                subs.append(fx.get_attr(attr))
            args = [_arg_from_ir(a, env) for a in n.args]
            args = [tuple(a) if kind == "list" else a for a, (_, kind) in zip(args, hop["args"])]
            node = fx.call_function(hop["op"], tuple(subs[i] if kind == "region" else args[i]
                                                     for kind, i in hop["fx_args"]))
            node.name = n.name
        elif n.kind == "call":
            args = tuple(_arg_from_ir(a, env) for a in n.args)
            kwargs = {k: _arg_from_ir(v, env) for k, v in n.kwargs}
            node = fx.call_function(_resolve_target(n.target), args, kwargs)
            node.name = n.name
        else:
            outs = tuple(_arg_from_ir(a, env) for a in n.args[0])
            fx.output(outs[0] if scalar_output and len(outs) == 1 else outs)
            continue
        node.meta["val"] = _fake_of(n.type)
        env[n.name] = node
    fx.lint()
    return torch.fx.GraphModule(root, fx)
