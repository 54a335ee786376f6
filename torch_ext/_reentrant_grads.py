"""Eager's order of gradient accumulation for parameters read inside reentrant activation checkpoints.

Eager's reentrant checkpoint (``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)``) runs the block's
backward as its own ``torch.autograd.backward``: a parameter the block reads gets the block's gradient added
into ``.grad`` by that inner backward, on its own, when the outer backward reaches the block. Its gradient
from reads outside the block is summed by the outer backward and added when the last of those arrives (after
the backward of its first read in forward order). The step inlines the block (``_compat.
inline_reentrant_checkpoints``), so the traced joint graph sums all reads into one gradient, in another order:
with gradient accumulation, a later micro-batch added ``G + (g_block + g_outside)`` where eager adds
``(G + g_outside) + g_block`` (fuzz_step 29:10).

While the step's forward is exported, a parameter read inside a reentrant block that gradients flow through
is read through ``torch_ext_ckpt::read(p, block, path)`` (path: the enclosing blocks, outermost first); its backward is ``torch_ext_ckpt::grad(g, block)``,
the block's own gradient of ``p``. ``split_events`` then takes the joint graph apart: the markers go, each
gradient of such a parameter becomes the sum of its "events" (one per block, one for the outside reads), in
the order eager adds them into ``.grad``, and the step's accumulation (csrc/passes/accumulate.cpp) adds each
micro-batch's events one at a time, as eager's backward does.

What the block reads by closure (a tensor requiring grad made before it) is not its own: a view of a parameter is
read as the same view of the block's marker (its gradient joins the block's event, as eager's inner backward takes
it through the view's backward); a torch.cond inside the block gets its parameter operands marked after export
(``mark_hop_reads``: a marker made while the cond runs was lifted as a constant); any other is marked with
``torch_ext_ckpt::closure`` and ``check_closures`` keeps it where nothing else gives its history a gradient, refuses
it otherwise.
"""
from __future__ import annotations

import contextlib
import itertools

import torch
from torch.utils._pytree import tree_leaves, tree_map_only

FOLD_PREFIX = "reentrant_grad_fold"  # the names of the sums split_events makes (accumulate.cpp checks them)


@torch.library.custom_op("torch_ext_ckpt::read", mutates_args=())
def _read(p: torch.Tensor, block: int, path: list[int]) -> torch.Tensor:
    return p.clone()


@_read.register_fake
def _(p, block, path):
    return torch.empty_like(p)


@torch.library.custom_op("torch_ext_ckpt::grad", mutates_args=())
def _grad(g: torch.Tensor, block: int) -> torch.Tensor:
    return g.clone()


@_grad.register_fake
def _(g, block):
    return torch.empty_like(g)


@torch.library.custom_op("torch_ext_ckpt::closure", mutates_args=())
def _closure(t: torch.Tensor, index: int) -> torch.Tensor:
    return t.clone()


@_closure.register_fake
def _(t, index):
    return torch.empty_like(t)


_closure.register_autograd(lambda ctx, g: (g, None), setup_context=lambda ctx, inputs, output: None)


def _read_setup(ctx, inputs, output):
    ctx.block = inputs[1]


def _read_backward(ctx, g):
    return torch.ops.torch_ext_ckpt.grad(g, ctx.block), None, None


_read.register_autograd(_read_backward, setup_context=_read_setup)

_NO_GRAD_REGION = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)
_READ = torch.ops.torch_ext_ckpt.read.default
_CLOSURE = torch.ops.torch_ext_ckpt.closure.default
_GRAD = torch.ops.torch_ext_ckpt.grad.default

_model: torch.nn.Module | None = None  # the module whose parameters are marked (set while the step exports)
_modes: list = []  # the reentrant blocks being traced (their _BlockReads), innermost last
_ids = itertools.count(1)
_METADATA = {"__get__", "size", "stride", "storage_offset", "numel", "dim", "ndimension", "is_contiguous",
             "element_size", "nelement", "data_ptr", "untyped_storage", "is_floating_point", "is_complex",
             "__len__", "get_device", "_is_view"}  # reads of no value: a closure tensor is not read by them
_HOP_META = "torch_ext_ckpt_hop"  # on a cond / while_loop node inside a reentrant block: (block, path, operands)
_VIEW_META = "torch_ext_ckpt_view"  # on a replayed closure view: (block, eager's sequence number of the view)
_closures: list[str] = []  # per closure read (torch_ext_ckpt::closure's index): what a refusal names


@contextlib.contextmanager
def marking(model: torch.nn.Module):
    """While the step's forward is exported: reentrant blocks mark their reads of ``model``'s parameters."""
    global _model, _closures
    outer, _model = _model, model
    outer_closures, _closures = _closures, []
    try:
        yield
    finally:
        _model, _closures = outer, outer_closures


class _BlockReads(torch.overrides.TorchFunctionMode):
    """Inside one reentrant block: each parameter that requires grad (not one passed as a block argument,
    whose gradient eager returns to the outer backward) is read through one ``torch_ext_ckpt::read``.

    A tensor requiring grad that the block reads by closure (made before the block: its autograd node is older
    than the block's arguments) is not the block's own: eager's inner backward runs through its history in the
    outer graph with the block's gradient alone, and adds what reaches a parameter into ``.grad`` as part of the
    block's event. A view of a parameter is read as the same view of the block's marker (``_view_func``: the
    view replayed), so its gradient joins the block's event, as in eager; anything else is refused."""

    def __init__(self, params: dict, block: int, path: list[int], entry: int, name: str):
        super().__init__()
        self.params, self.block, self.path, self.alias = params, block, path, {}
        self.entry, self.name = entry, name  # the autograd sequence number of the block's first node

    def _outside(self, t) -> bool:
        # A tensor requiring grad made before the block (not one of its parameters): read by closure
        if self.entry is None or not isinstance(t, torch.Tensor) or not t.requires_grad or id(t) in self.params:
            return False
        fn = t.grad_fn
        return fn is None or fn._sequence_nr() < self.entry

    def _describe(self, t, where: str = "") -> int:
        # What a refusal of this closure read names (check_closures refuses it if it is not exact)
        fn = t.grad_fn
        what = (f"a tensor {tuple(t.shape)} {t.dtype} made before it by {type(fn).__name__}" if fn is not None
                else f"a leaf tensor {tuple(t.shape)} {t.dtype} that requires grad")
        _closures.append(f"the reentrant activation checkpoint around {self.name} reads by closure{where} {what}")
        return len(_closures) - 1

    def _sub(self, t, metadata: bool = False):
        if id(t) not in self.params:
            if metadata or not self._outside(t):  # (a shape, a layout: no value read)
                return t
            a = self.alias.get(id(t))
            if a is not None:
                return a[1]
            base = t._base if t._is_view() else None
            view = None
            if base is not None and id(base) in self.params:
                # The view of the block's marker: its gradient reaches the marker, as eager's inner backward
                # takes it through the view's backward in the outer graph to the parameter
                try:
                    view = t._view_func(self._sub(base))
                except RuntimeError:
                    view = None  # (not replayable: checked as any other closure tensor)
                if view is not None:
                    _tag_view(view, self.block, t.grad_fn._sequence_nr() if t.grad_fn is not None else 0)
            if view is None:  # exact only where nothing else gives its history a gradient (check_closures)
                view = _CLOSURE(t, self._describe(t))
            self.alias[id(t)] = (t, view)
            return view
        a = self.alias.get(id(t))
        if a is None:
            a = self.alias[id(t)] = _READ(t, self.block, self.path)
        return a

    def _hop(self, func, args, kwargs):
        # torch.cond / while_loop: the markers made while the operator runs would be lifted as constants (no
        # gradient: the block's parameters trained without the branch's gradient). The operator reads its
        # operands as they are; mark_hop_reads marks its parameter operands in the exported program.
        flat = tree_leaves((args, kwargs))
        hop_name = getattr(func, "__name__", str(func))
        closures = [(i, self._describe(t, f" (an operand of {hop_name})")) for i, t in enumerate(flat) if self._outside(t)]
        marks = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and id(t) in self.params]
        from torch.fx.experimental import proxy_tensor

        tracer = getattr(proxy_tensor.get_proxy_mode(), "tracer", None)
        graph = getattr(tracer, "graph", None)
        last = next(iter(reversed(graph.nodes))) if graph is not None and len(graph.nodes) else None
        out = func(*args, **kwargs)
        if marks or closures:
            found = []
            if graph is not None:
                node = last.next if last is not None else next(iter(graph.nodes), None)
                while node is not None and node.op != "root":
                    if node.op == "call_function" and node.target is func:
                        found.append(node)
                    node = node.next
            if len(found) != 1:
                raise NotImplementedError(
                    f"the reentrant activation checkpoint around {self.name} calls {getattr(func, '__name__', func)}, "
                    "which reads a parameter the step could not mark as the block's (eager adds the block's gradient "
                    "into .grad on its own). Checkpoint with use_reentrant=False")
            found[0].meta[_HOP_META] = (self.block, list(self.path), marks, closures)
        return out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # A torch.cond branch (dynamo inlines this mode there) reads what it reads: a parameter it reads is
        # lifted to an operand of the cond (marked by mark_hop_reads).
        if torch.compiler.is_dynamo_compiling() or func in (_READ, torch.ops.torch_ext_ckpt.read):
            # (an inner block's marker reads the parameter itself)
            return func(*args, **kwargs)
        if isinstance(func, torch._ops.HigherOrderOperator):
            return self._hop(func, args, kwargs)
        name = getattr(func, "__name__", "")
        if name in _METADATA:
            return func(*tree_map_only(torch.Tensor, lambda t: self._sub(t, True), tuple(args)), **kwargs)
        if args and (name == "__setitem__" or (name.endswith("_") and not name.endswith("__"))):
            # A write into the parameter stays one (and is refused as such): never into its marker
            args = (args[0],) + tuple(tree_map_only(torch.Tensor, self._sub, tuple(args[1:])))
        else:
            args = tree_map_only(torch.Tensor, self._sub, tuple(args))
        return func(*args, **tree_map_only(torch.Tensor, lambda t: t if "out" in kwargs else self._sub(t), kwargs))


@contextlib.contextmanager
def block_reads(args: tuple, function=None):
    """Around a reentrant block's call while the step exports (else nothing); gives the block's arguments."""
    if _model is None or not any(isinstance(a, torch.Tensor) and a.requires_grad for a in tree_leaves(args)):
        yield args
        return
    given = {id(t) for t in tree_leaves(args) if isinstance(t, torch.Tensor)}
    params = {id(p): p for p in _model.parameters() if p.requires_grad and id(p) not in given}
    block = next(_ids)
    path = [m.block for m in _modes] + [block]
    outer = _modes[-1] if _modes else None

    def argument(a):
        # Eager's inner backward sums the block's reads of an argument (its detached copy's .grad) and returns
        # the sum to the backward around it as one gradient: one read there (marked with -block), of the
        # enclosing block's marker where the argument is a parameter that block reads
        if not isinstance(a, torch.Tensor) or not a.requires_grad:
            return a
        return _READ(outer._sub(a) if outer is not None else a, -block, path)

    args = tuple(argument(a) for a in args)
    # The block's first autograd node: older ones were made before it (what it reads by closure)
    # (None: no gradient flows from the block, under no_grad; nothing it reads gets one)
    entry = min((a.grad_fn._sequence_nr() for a in args if isinstance(a, torch.Tensor) and a.grad_fn is not None),
                default=None)
    mode = _BlockReads(params, block, path, entry, _name_of(function))
    _modes.append(mode)
    try:
        with mode:
            yield args
    finally:
        _modes.pop()


def _tag_view(view: torch.Tensor, block: int, seq: int) -> None:
    # The node of a replayed closure view, for order_views (eager made the view before the block)
    from torch.fx.experimental import proxy_tensor

    tracer = getattr(proxy_tensor.get_proxy_mode(), "tracer", None)
    slot = proxy_tensor.get_proxy_slot(view, tracer, None) if tracer is not None else None
    if slot is not None:
        slot.proxy.node.meta[_VIEW_META] = (block, seq)


def order_views(ep: torch.export.ExportedProgram) -> None:
    """The replayed closure views of each reentrant block (and their markers) moved to the block's start, in the
    order eager made the views: eager's inner backward meets a view's backward (older than every node of the
    block) after the block's own, and adds what arrives at the parameter in that order."""
    graph = ep.graph_module.graph
    tagged = [n for n in graph.nodes if _VIEW_META in n.meta]
    if not tagged:
        return
    pos = {n: i for i, n in enumerate(graph.nodes)}
    for block in sorted({n.meta[_VIEW_META][0] for n in tagged}):
        mine = sorted((n for n in tagged if n.meta[_VIEW_META][0] == block), key=lambda n: n.meta[_VIEW_META][1])
        chains, markers, whole = [], [], True
        for n in mine:
            chain = [n]
            while not (chain[-1].op == "call_function" and chain[-1].target is _READ):
                ins = chain[-1].all_input_nodes
                if len(ins) != 1:
                    chain = None
                    break
                chain.append(ins[0])
            if chain is None:
                whole = False  # (not a chain of views: the block's views left where traced)
                break
            markers.append(chain[-1])
            chains.append(chain[-2::-1])
        # The block's start: its first node reading an argument's or a parameter's marker
        if not whole:
            continue
        starts = [u for n in graph.nodes if n.op == "call_function" and n.target is _READ and abs(n.args[1]) == block
                  for u in n.users]
        moved = list(dict.fromkeys(sorted(set(markers), key=lambda n: pos[n]) + [n for c in chains for n in c]))
        anchor = min(starts + moved, key=lambda n: pos[n])
        while anchor in moved:
            anchor = anchor.next
        for n in moved:
            anchor.prepend(n)
        pos = {n: i for i, n in enumerate(graph.nodes)}
    for n in tagged:
        del n.meta[_VIEW_META]
    graph.lint()
    ep.graph_module.recompile()


def _name_of(function) -> str:
    import functools

    while isinstance(function, functools.partial):
        function = function.func
    owner = getattr(function, "__self__", None)
    if isinstance(owner, torch.nn.Module) and _model is not None:
        path = next((n for n, m in _model.named_modules() if m is owner), None)
        return f"{type(owner).__name__}.{getattr(function, '__name__', 'forward')} ({path or 'model'})"
    return getattr(function, "__qualname__", None) or repr(function)


def mark_hop_reads(ep: torch.export.ExportedProgram) -> None:
    """The forward program as exported: each parameter operand of a torch.cond / while_loop inside a reentrant
    block (a parameter its branch reads, lifted) read through the block's marker, as the block's other reads."""
    graph = ep.graph_module.graph
    hops = [n for n in graph.nodes if _HOP_META in n.meta]
    if not hops:
        return
    from torch.utils._pytree import tree_flatten, tree_unflatten

    for hop in hops:
        block, path, marks, closures = hop.meta.pop(_HOP_META)
        flat, spec = tree_flatten((hop.args, hop.kwargs))
        for i, index in closures:  # read through a closure marker too (check_closures)
            with graph.inserting_before(hop):
                c = graph.call_function(_CLOSURE, (flat[i], index))
            c.meta.update({k: v for k, v in flat[i].meta.items() if k == "val"})
            flat[i] = c
        for i in marks:
            p = flat[i]
            if not (isinstance(p, torch.fx.Node) and p.op == "placeholder"):
                raise NotImplementedError(
                    f"a torch.cond / while_loop inside a reentrant activation checkpoint reads a parameter the step "
                    f"could not mark as the block's (operand {i}: {p}). Checkpoint with use_reentrant=False")
            marker = next((u for u in p.users if u.op == "call_function" and u.target is _READ and u.args[1] == block),
                          None)
            if marker is None:
                with graph.inserting_before(hop):
                    marker = graph.call_function(_READ, (p, block, list(path)))
                val = p.meta.get("val")
                if isinstance(val, torch.Tensor):
                    with val.fake_mode if hasattr(val, "fake_mode") else contextlib.nullcontext():
                        marker.meta["val"] = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype,
                                                                 device=val.device)
            else:
                hop.prepend(marker)  # (its first reader may come later in the block)
            flat[i] = marker
        hop.args, hop.kwargs = tree_unflatten(flat, spec)
    graph.lint()
    ep.graph_module.recompile()


def check_closures(ep: torch.export.ExportedProgram) -> None:
    """Each tensor requiring grad that a reentrant block reads by closure (not a view of a parameter, read as
    the view of the block's marker): eager's inner backward runs its history in the outer graph with the block's
    gradient alone and adds what reaches a parameter into .grad on its own. That is the step's gradient where
    nothing else gives that history a gradient: no other reader of the tensor, of a node of its history that
    depends on a parameter, or of such a parameter (a few ulp off eager otherwise, fuzz-measured: refused, naming
    the block and the tensor). The closure markers go."""
    graph = ep.graph_module.graph
    found = [n for n in graph.nodes if n.op == "call_function" and n.target is _CLOSURE]
    if not found:
        return
    params = {s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "PARAMETER"}
    for c in found:
        t = c.args[0]
        # The history that depends on a parameter: ancestors of t reachable from a parameter placeholder
        ancestors, todo = set(), [t]
        while todo:
            n = todo.pop()
            if n in ancestors:
                continue
            ancestors.add(n)
            todo += [a for a in n.all_input_nodes]
        live = {n for n in ancestors if n.op == "placeholder" and n.name in params}
        for n in graph.nodes:
            if n in ancestors and n not in live and any(a in live for a in n.all_input_nodes):
                live.add(n)
        leaked = [(n, u) for n in graph.nodes if n in live for u in n.users if u not in live and u is not c]
        if leaked and t in live:
            n, u = leaked[0]
            raise NotImplementedError(
                f"{_closures[c.args[1]]}: eager's inner backward (use_reentrant=True) runs that tensor's history in "
                "the outer graph with the block's gradient alone and adds what reaches a parameter into .grad on its "
                f"own, and that history also gets a gradient elsewhere (%{n.name} is read by %{u.name}), so eager "
                "adds its parameters' gradient in pieces the step cannot reproduce bit for bit (a few ulp off eager). "
                "Pass the tensor to the block as an argument (checkpoint(fn, x, t, use_reentrant=True)), or "
                "checkpoint with use_reentrant=False")
    for c in found:
        c.replace_all_uses_with(c.args[0])
        graph.erase_node(c)
    graph.lint()
    ep.graph_module.recompile()


def strip_reads(ep: torch.export.ExportedProgram) -> None:
    """The forward program without the markers (each reads its parameter again)."""
    gm = ep.graph_module
    found = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _READ]
    for n in found:
        n.replace_all_uses_with(n.args[0])
        gm.graph.erase_node(n)
    if found:
        gm.recompile()


def split_events(joint: torch.export.ExportedProgram) -> dict[str, int]:
    """Rewrites the joint graph in place: the markers go, and each parameter read inside a reentrant block
    and elsewhere (or in two blocks) gets as gradient the sum, in eager's order, of its events: the sum of
    its reads outside any block, and per block the sum of the block's own reads. Returns, per such
    parameter (state name), how many events its gradient sums: the nodes ``FOLD_PREFIX*`` add them."""
    gm = joint.graph_module
    graph = gm.graph
    nodes = list(graph.nodes)
    if not any(n.op == "call_function" and n.target is _READ for n in nodes):
        return {}
    pos = {n: i for i, n in enumerate(nodes)}
    all_reads = [n for n in nodes if n.op == "call_function" and n.target is _READ]
    reads = [r for r in all_reads if r.args[1] > 0]
    for g in [n for n in nodes if n.op == "call_function" and n.target is _GRAD and n.args[1] < 0]:
        g.replace_all_uses_with(g.args[0])  # a parameter argument's: one of the outer backward's reads
        graph.erase_node(g)
    # The forward ends at the backward's seed; a read's readers before it are forward reads.
    seed = min((pos[n] for n in nodes if n.op == "call_function" and n.target is torch.ops.aten.ones_like.default),
               default=len(nodes))
    parent: dict[int, int] = {}
    read_of: dict[tuple, torch.fx.Node] = {}  # (placeholder, block) -> marker
    first_in: dict[int, int] = {}  # block -> position of its first marker (any parameter's)
    for r in reads:
        p, b, path = r.args
        for j, c in enumerate(path):
            parent[c] = path[j - 1] if j else 0
        read_of[(p, b)] = r
        first_in.setdefault(b, pos[r])
    marked = {p for p, _ in read_of}
    placeholder_of = {s.target: s.arg.name for s in joint.graph_signature.input_specs if s.kind.name == "PARAMETER"}
    by_name = {n.name: n for n in nodes if n.op == "placeholder"}

    def first_read(users) -> int | None:
        # The first forward read that autograd differentiates (a detach passes no gradient back)
        at = [pos[u] for u in users if pos[u] < seed and u.target is not torch.ops.aten.detach.default
              and not (u.target is _READ and u.args[1] > 0)
              and not (u.target is _NO_GRAD_REGION and u.args and u.args[0] is False)]
        return min(at) if at else None

    out_node = next(n for n in reversed(nodes) if n.op == "output")
    outs = list(out_node.args[0])
    events: dict[str, int] = {}
    for i, spec in enumerate(joint.graph_signature.output_specs):
        if spec.kind.name != "GRADIENT_TO_PARAMETER" or not isinstance(outs[i], torch.fx.Node):
            continue
        p = by_name.get(placeholder_of.get(spec.target, ""))
        if p not in marked:
            continue
        # Take the blocks' gradients out of the sum autograd made (its input buffer adds each arrival)
        top, mine = outs[i], {}
        todo = [top]
        while todo:
            n = todo.pop()
            if n.op == "call_function" and n.target is _GRAD:
                mine[n.args[1]] = n
            elif n.op == "call_function" and n.target is torch.ops.aten.add.Tensor and not n.kwargs:
                todo += [a for a in n.args if isinstance(a, torch.fx.Node)]
        rest = top
        for g in mine.values():
            if g is rest:
                rest = None
                continue
            (add,) = g.users
            other = add.args[1] if add.args[0] is g else add.args[0]
            add.replace_all_uses_with(other)
            if add is rest:
                rest = other
            graph.erase_node(add)
        # Eager's order: in each scope (the outer backward, a block's inner one), the scope's own reads are
        # added once the backward of the first of them has run, each inner block when the backward reaches
        # it: by position, last in forward first.
        children: dict[int, list[int]] = {}
        for b in mine:
            c = b
            while c != 0 and c not in children.get(parent[c], []):
                children.setdefault(parent[c], []).append(c)
                c = parent[c]

        def span_at(b: int) -> int:  # a node inside block b (its reads of any parameter, or its inner blocks')
            inner = [first_in[b]] if b in first_in else []
            return min(inner + [span_at(c) for c in children.get(b, [])])

        def order(scope: int) -> list:
            items = []
            own = rest if scope == 0 else mine.get(scope)
            if own is not None:
                at = first_read(p.users) if scope == 0 else first_read(read_of[(p, scope)].users)
                items.append((at if at is not None else -1, [own.args[0] if scope else own]))
            for c in children.get(scope, []):
                items.append((span_at(c), order(c)))
            items.sort(key=lambda e: -e[0])
            return [x for _, xs in items for x in xs]

        seq = order(0)
        for g in mine.values():
            g.replace_all_uses_with(g.args[0])
            graph.erase_node(g)
        acc = seq[0]
        with graph.inserting_before(out_node):
            for k, e in enumerate(seq[1:], 1):
                acc = graph.create_node("call_function", torch.ops.aten.add.Tensor, (acc, e),
                                        name=f"{FOLD_PREFIX}_{spec.target}_{k}".replace(".", "_"))
                acc.meta["val"] = torch.ops.aten.add.Tensor(acc.args[0].meta["val"], e.meta["val"])
        outs[i] = acc
        if len(seq) > 1:
            events[spec.target] = len(seq)
    out_node.args = (tuple(outs),) if isinstance(out_node.args[0], tuple) else (outs,)
    for r in all_reads:
        r.replace_all_uses_with(r.args[0])
        graph.erase_node(r)
    graph.lint()
    gm.recompile()
    return events
