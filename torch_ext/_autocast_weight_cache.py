"""Eager's autocast weight cache, made explicit in an export's flat pre-dispatch graph (one pass).

Eager (``at::autocast::cached_cast``, torch 2.9) casts a float32 leaf that requires grad (a parameter) to the
autocast dtype once per outermost autocast region while the weight cache is on (``cache_enabled``, the default),
and every later cast of it in the region returns that one copy; the cache is cleared where the outermost region
exits. So a layer applied twice, or a weight shared by two layers, or a GRU's / LSTM's recurrent weights (their
decomposition casts them at every time step) have their uses' gradients added in bfloat16 before the one cast back
to float32. Tracing turns the cache off: the trace cast the weight at each use, and the joint graph
added two float32 gradients (momentum buffers 1e-4 off eager after 3 SGD steps). ``share_autocast_weight_casts``
runs on the flat graph before torch's grad-mode and autocast passes split it into regions
(_compat.autocast_weight_cache installs it, and marks each traced ``_enter_autocast`` with eager's cache flag).
A ``torch.cond`` branch runs below autograd in eager: a cast it makes first is cached without a gradient, and later
casts outside it in the region read that copy (_dropped_by_conds).
"""
from __future__ import annotations

import torch
from torch.export.graph_signature import InputKind


CACHE_FLAG = "torch_ext_autocast_cache"  # meta of a traced _enter_autocast: eager's weight-cache flag there


class _CastRecorder:
    """The casts to ``dtype`` of the tensors ``watched`` that run under it, and which of them another op reads
    uncast (a dispatch mode: it sees autocast's casts, made above it)."""

    def __init__(self, watched: list, dtype):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        counts, read = [0] * len(watched), [False] * len(watched)

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                cast = func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == dtype
                if not cast and not any("Tensor" in str(r.type) for r in func._schema.returns):
                    return func(*args, **kwargs)  # a metadata query (prim.device, sym_size) reads no values
                for leaf in tree_leaves((args, kwargs)):
                    for i, t in enumerate(watched):
                        if leaf is t:
                            if cast:
                                counts[i] += 1
                            else:
                                read[i] = True
                return func(*args, **kwargs)

        self.mode, self.counts, self.read = Mode(), counts, read


_AUTOCAST_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA", "xpu": "AutocastXPU", "mps": "AutocastMPS",
                  "hpu": "AutocastHPU", "xla": "AutocastXLA", "mtia": "AutocastMTIA", "maia": "AutocastMAIA"}


def _may_cast(node: torch.fx.Node, device: str) -> bool:
    """Whether autocast can cast an operand of ``node``'s op on ``device``: it has a kernel of its own there, or
    the op is a composite whose decomposition runs under autocast (GRU and LSTM cast their recurrent weights at
    every time step, from the cache after the first). Every other op falls through: autocast casts nothing."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return False
    name = node.target.name()
    return any(torch._C._dispatch_has_kernel_for_dispatch_key(name, key)
               for key in (_AUTOCAST_KEYS.get(device, "AutocastPrivateUse1"), "CompositeImplicitAutograd"))


def _autocast_cast_operands(node: torch.fx.Node, params: set, device: str, dtype) -> tuple[dict, dict]:
    """({occurrence: casts}, {occurrence: casts}) of ``params`` (placeholder nodes) among ``node``'s operands,
    counted in ``map_arg``'s order, that ``torch.autocast(device, dtype)`` casts to ``dtype`` when it runs
    ``node``'s op: first those nothing in the op reads uncast, then those it also reads uncast (one explicit cast
    cannot stand for those: the op's own uncast read stays). Casts are those with autocast on less those with it
    off (the op's own casts, an explicit ``.to()``, run either way). Found by running the op on fresh fake tensors
    (raises what that raised)."""
    from torch._subclasses.fake_tensor import FakeTensor

    vals = [a.meta.get("val") for a in node.all_input_nodes]
    fake_mode = next((v.fake_mode for v in vals if isinstance(v, FakeTensor)), None)
    if fake_mode is None:
        raise LookupError("no fake tensor among its operands")
    counts = {}
    with fake_mode:
        for enabled in (True, False):
            watched: list = []

            def fresh(a):
                v = a.meta.get("val")
                if not isinstance(v, torch.Tensor):
                    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)):
                        return v
                    raise LookupError(f"operand {a.name} has no example value")
                t = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
                if a in params:
                    watched.append(t)
                return t

            args = torch.fx.node.map_arg(node.args, fresh)
            kwargs = torch.fx.node.map_arg(node.kwargs, fresh)
            rec = _CastRecorder(watched, dtype)
            with torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=False), rec.mode:
                node.target(*args, **kwargs)
            counts[enabled] = (rec.counts, rec.read)
    (on, read), (off, _) = counts[True], counts[False]
    return ({i: on[i] - off[i] for i in range(len(on)) if on[i] > off[i] and not read[i]},
            {i: on[i] - off[i] for i in range(len(on)) if on[i] > off[i] and read[i]})


def _cond_name(cond: torch.fx.Node) -> str:
    """``cond`` as the user wrote it: the torch.cond in the module that called it."""
    stack = list(cond.meta.get("nn_module_stack", {}).values())
    path, cls = stack[-1] if stack else (None, "")
    where = f"module {path.removeprefix('model.')!r}" if path and path.startswith("model.") else "the model's forward"
    # (the step's loss module, at path '', runs loss_fn)
    inside = "" if path is None else " in loss_fn" if not path else f" in {where} ({cls.rsplit('.', 1)[-1]})"
    return f"the torch.cond{inside} (graph node {cond.name})"


def _branch_casts(sub: torch.fx.GraphModule, index: int, device: str, dtype) -> bool | None:
    """Whether the cond branch ``sub`` has autocast cast its ``index``-th operand (a parameter) to ``dtype`` on
    ``device``, as eager runs it inside the region; None where that cannot be told here: the branch enters an
    autocast region of its own, or passes the operand on to a nested cond / while_loop (whose branch is taken by a
    predicate the enclosing graph cannot read)."""
    ph = [n for n in sub.graph.nodes if n.op == "placeholder"][index]
    if not ph.users:
        return False
    enter = torch.amp.autocast_mode._enter_autocast
    if any(n.op == "call_function" and n.target is enter for n in sub.graph.nodes):
        return None
    for node in ph.users:
        if node.op == "output":  # returned as it is: no cast
            continue
        if node.op != "call_function" or isinstance(node.target, torch._ops.HigherOrderOperator):
            return None
        if not _may_cast(node, device):
            continue
        try:
            cast, cast_and_read = _autocast_cast_operands(node, {ph}, device, dtype)
        except Exception:  # noqa: BLE001 - cannot tell: refused by the caller where it matters
            return None
        if cast or cast_and_read:
            return True
    return False


def _dropped_by_conds(gm: torch.fx.GraphModule, copy: torch.fx.Node, conds: list) -> torch.fx.Node:
    """``copy`` (a parameter's cast, placed before its first cast outside ``conds``) as eager's cache serves it
    after those conds: without a gradient where a taken branch cast the parameter first (eager runs it below
    autograd), with one otherwise. ``where(dropped, copy.detach(), copy)``: the same values either way, and a
    gradient of exactly the incoming one or zero."""
    g = copy.graph
    fake = copy.meta["val"].fake_mode

    def add(target, *args):
        with g.inserting_after(add.last):
            n = g.call_function(target, args)
        with fake:
            n.meta["val"] = target(*[a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args])
        for key in ("stack_trace", "nn_module_stack"):
            if key in copy.meta:
                n.meta[key] = copy.meta[key]
        add.last = n
        return n

    add.last = copy
    if any(all(casts) for _, casts, _ in conds):  # both branches of one cast it: always without a gradient
        return add(torch.ops.aten.detach.default, copy)
    dropped = None
    for cond, (in_true, _), _ in conds:
        pred = cond.args[0]
        if not isinstance(pred, torch.fx.Node) or not isinstance(pred.meta.get("val"), torch.Tensor):
            raise ValueError(
                f"{_cond_name(cond)} casts a parameter in one branch under autocast, and its predicate "
                f"({pred!r}) is not a traced tensor; pass cache_enabled=False to torch.autocast")
        taken = pred if in_true else add(torch.ops.aten.logical_not.default, pred)
        dropped = taken if dropped is None else add(torch.ops.aten.logical_or.default, dropped, taken)
    detached = add(torch.ops.aten.detach.default, copy)
    return add(torch.ops.aten.where.self, dropped, detached, copy)


def _reentrant_leaves(gm: torch.fx.GraphModule, names: dict) -> dict[str, str]:
    """The float32 tensors eager's reentrant checkpoint recomputation casts through its autocast weight cache,
    by graph node name, each with a name for messages: what a reentrant block reads as a leaf that requires
    grad. Eager (``CheckpointFunction.backward``) reruns the block in a fresh outermost autocast region (so a
    cache of its own) on ``detach()``-ed copies of its tensor arguments, made to require grad: leaves, so
    autocast caches their casts like a parameter's. Two ops reading the block's input (BERT's query, key and
    value projections) get one bfloat16 copy, and their gradients are added in bfloat16 before the one cast
    back. A parameter read in the block is cached within it too. The step's trace reads each inside the block
    through one ``torch_ext_ckpt::read`` marker per block (_reentrant_grads.block_reads: an argument marked
    with a negative block, a parameter with the block): sharing the casts of a marker is sharing them per
    block, as eager's recomputation does."""
    read = getattr(getattr(torch.ops, "torch_ext_ckpt", None), "read", None)
    if read is None:
        return {}
    out = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not read.default:
            continue
        v = n.meta.get("val")
        if not isinstance(v, torch.Tensor) or v.dtype != torch.float32:
            continue
        src, block = n.args[0], n.args[1]
        what = names.get(getattr(src, "name", None), getattr(src, "name", "?"))
        out[n.name] = (f"{what} (read in reentrant checkpoint block {block})" if block > 0
                       else f"{what} (argument of reentrant checkpoint block {-block})")
    return out


def _first_cast_in_reentrant_blocks(sites: dict, order: dict) -> dict:
    """Per parameter (placeholder), the position of the first autocast cast of it inside a reentrant block
    (a cast site of its ``torch_ext_ckpt::read`` marker there, _reentrant_leaves), among one region's ``sites``."""
    read = getattr(getattr(torch.ops, "torch_ext_ckpt", None), "read", None)
    first: dict = {}
    for m, cached in sites.items():
        if m.op == "call_function" and read is not None and m.target is read.default and m.args[1] > 0:
            at = min(order[n] for n, *_ in cached)
            p = m.args[0]
            first[p] = min(first.get(p, at), at)
    return first


def share_autocast_weight_casts(gm: torch.fx.GraphModule, signature) -> None:
    """Eager's autocast weight cache, made explicit in the flat pre-dispatch graph ``gm`` of an export.

    Eager (``at::autocast::cached_cast``) casts a float32 leaf that requires grad (a parameter) to the autocast
    dtype once per outermost autocast region while the weight cache is on (``cache_enabled``, the default), and
    every later cast of it in the region returns that one copy: a layer applied twice, or a weight shared by two
    layers, has its two uses' gradients added in bfloat16 before the one cast back to float32. Tracing disables
    the cache, so the trace cast the weight at each use, and the joint graph added two float32 gradients (momentum
    buffers 1e-4 off eager after 3 SGD steps). Here the casts autocast would serve from its cache (found by running
    each op on fake tensors, _autocast_cast_operands: an op with an autocast kernel used with a parameter twice in
    the region, or a composite op, whose decomposition may cast an operand many times) read one explicit
    ``_to_copy`` placed before the first: in
    its grad mode, as eager's copy is made there (a copy made under no_grad gives no gradient through later uses,
    as in eager). Explicit ``.to()`` calls are not cached by eager and stay as they are; a frozen parameter
    (cast anew by eager) gives the same values and no gradient either way. The cache is cleared where the
    outermost region exits, so two regions keep a cast each."""
    enter, exit_ = torch.amp.autocast_mode._enter_autocast, torch.amp.autocast_mode._exit_autocast
    names = {s.arg.name: s.target for s in signature.input_specs if s.kind == InputKind.PARAMETER}
    params = {n for n in gm.graph.nodes if n.op == "placeholder" and n.name in names
              and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dtype == torch.float32}
    leaves = _reentrant_leaves(gm, names)
    names.update(leaves)
    params |= {n for n in gm.graph.nodes if n.name in leaves}
    if not params or not any(n.op == "call_function" and n.target is enter for n in gm.graph.nodes):
        return
    # Per outermost region: the nodes that read a parameter, with the regions they are in.
    stack: list[torch.fx.Node] = []
    regions: list[list[tuple[torch.fx.Node, list[torch.fx.Node]]]] = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is enter:
            if not stack:
                regions.append([])
            stack.append(node)
        elif node.target is exit_:
            stack.pop()
        elif stack:
            used = []
            torch.fx.node.map_arg((node.args, node.kwargs), lambda a: used.append(a) if a in params else None)
            if used:
                regions[-1].append((node, stack[:], used))
    swaps: dict[torch.fx.Node, dict[int, torch.fx.Node]] = {}  # node -> occurrence -> the shared cast
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for uses in regions:
        counted: dict[torch.fx.Node, int] = {}
        for _, _, used in uses:
            for p in used:
                counted[p] = counted.get(p, 0) + 1
        sites: dict[torch.fx.Node, list[tuple[torch.fx.Node, int, torch.dtype, int]]] = {}
        mixed: dict[torch.fx.Node, list[tuple[torch.fx.Node, int]]] = {}  # cast inside an op that reads it uncast
        # Conds whose branch casts a parameter before any cast of it outside: (cond, casts in (true, false) branch)
        conds: dict[torch.fx.Node, list[tuple[torch.fx.Node, tuple, torch.dtype]]] = {}
        for node, inside, used in uses:
            if not inside[-1].meta.get(CACHE_FLAG, False):  # the innermost region sets the cache flag
                continue
            device = used[0].meta["val"].device.type
            region = next((e for e in reversed(inside) if e.args[0] == device), None)
            if region is None or not region.args[2]:
                continue
            dtype = region.args[1]
            if node.target is torch.ops.higher_order.cond:
                # Eager runs the taken branch below autograd (CondAutogradOp), so a cast made there enters the
                # cache without a gradient, and later casts of the parameter outside the cond in the region get
                # that copy: no gradient through them. The branch's own gradient is traced apart, a cast per use.
                _, true_gm, false_gm, operands = node.args
                for i, a in enumerate(operands):
                    if a in used and a not in sites and a not in mixed:
                        casts = tuple(_branch_casts(gm.get_submodule(b.target), i, device, dtype)
                                      for b in (true_gm, false_gm))
                        if any(c is not False for c in casts):
                            conds.setdefault(a, []).append((node, casts, dtype))
                continue
            if not _may_cast(node, device):
                continue
            own = torch._C._dispatch_has_kernel_for_dispatch_key(
                node.target.name(), _AUTOCAST_KEYS.get(device, "AutocastPrivateUse1"))
            if own and all(counted[p] == 1 and p.op == "placeholder" for p in used):
                continue  # autocast's own kernel casts an operand once (a reentrant block's first cast: recorded)
            try:
                cast, cast_and_read = _autocast_cast_operands(node, params, device, dtype)
            except Exception as e:  # noqa: BLE001 - re-raised naming the op
                raise NotImplementedError(
                    f"cannot tell which operands of {node.target} (reading parameter(s) "
                    f"{sorted({names[p.name] for p in used})}) torch.autocast casts, running it on fake tensors "
                    f"failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); eager's autocast weight "
                    "cache shares such casts within a region, which the step would not reproduce. Pass "
                    "cache_enabled=False to torch.autocast, or compute this op outside the autocast region") from e
            for i, k in cast.items():
                sites.setdefault(used[i], []).append((node, i, dtype, k))
            for i, k in cast_and_read.items():
                mixed.setdefault(used[i], []).append((node, k))
        for p, inside in mixed.items():
            # A composite op that casts the parameter and also reads it uncast (torch.mm(x, w) + w.sum() in one
            # op): eager serves that cast from the cache too, shared with the region's other casts of it, but its
            # occurrence cannot be replaced by one explicit cast (the uncast read would become a cast one), so the
            # trace kept a cast of its own and added its gradient in float32: 1e-5 off eager after 3 SGD steps,
            # silently. Refused where eager would share (two casts or more in the region).
            if sum(k for _, k in inside) + sum(k for *_, k in sites.get(p, ())) >= 2:
                ops = sorted({str(n.target) for n, _ in inside})
                raise NotImplementedError(
                    f"autocast casts parameter {names[p.name]!r} inside {', '.join(ops)}, which also reads it uncast, "
                    "and casts it again in the same autocast region: eager's weight cache gives every one of those "
                    "casts one shared copy, which the step cannot reproduce inside that op. Pass "
                    "cache_enabled=False to torch.autocast, or run the op outside the autocast region")
        for p, before in conds.items():
            # A cond's branch cast p first; casts of p outside after it read the cache (refused where the step
            # cannot say whether the taken branch made that copy).
            if p not in sites and p not in mixed:
                continue  # no cast outside after it: the branches' own gradients, as eager's
            unknown = [c for c, casts, _ in before if None in casts]
            if p in mixed or unknown:
                cond = (unknown or [before[0][0]])[0]
                why = ("an op outside that also reads it uncast" if p in mixed else
                       "a nested autocast region or control flow in the branch that reads it")
                raise ValueError(
                    f"parameter {names[p.name]!r} is cast by autocast inside a branch of {_cond_name(cond)} and "
                    f"again after it in the same autocast region: eager's weight cache then serves "
                    f"the later casts the copy made in the branch, below autograd, so they give no gradient; the "
                    f"step cannot reproduce that here ({why}). Pass cache_enabled=False to torch.autocast, or "
                    "end the autocast region before the cond or read the parameter before it")
        # Eager runs a reentrant block's forward under no_grad: the first cast of a parameter there enters the
        # region's cache without a gradient, and the region's casts of it after the block read that copy.
        in_blocks = _first_cast_in_reentrant_blocks(sites, order)
        for p, cached in sites.items():
            before = conds.get(p, [])
            dropped = p in in_blocks and in_blocks[p] < min(order[n] for n, *_ in cached)
            if sum(k for *_, k in cached) < 2 and not before and not dropped:  # cast once: nothing to share
                continue
            dtypes = {d for _, _, d, _ in cached} | {d for *_, d in before}
            if len(dtypes) > 1:
                raise NotImplementedError(
                    f"autocast casts parameter {names[p.name]!r} to {sorted(map(str, dtypes))} inside one autocast "
                    "region (a nested region of another dtype): eager's weight cache returns the first cast for "
                    "both (the second op then mixes dtypes), which the step does not reproduce. Use one autocast "
                    "dtype per region, or pass cache_enabled=False to the inner torch.autocast")
            first = cached[0][0]
            with gm.graph.inserting_before(first):
                copy = gm.graph.call_function(torch.ops.aten._to_copy.default, (p,), {"dtype": cached[0][2]})
            with p.meta["val"].fake_mode:
                copy.meta["val"] = torch.ops.aten._to_copy.default(p.meta["val"], dtype=cached[0][2])
            for key in ("stack_trace", "nn_module_stack", "source_fn_stack", "torch_fn"):
                if key in first.meta:
                    copy.meta[key] = first.meta[key]
            if before:
                copy = _dropped_by_conds(gm, copy, before)
            if dropped:
                with gm.graph.inserting_after(copy):
                    detached = gm.graph.call_function(torch.ops.aten.detach.default, (copy,))
                detached.meta.update({k: v for k, v in copy.meta.items() if k != "val"})
                with p.meta["val"].fake_mode:
                    detached.meta["val"] = torch.ops.aten.detach.default(copy.meta["val"])
                copy = detached
            for node, i, _, _ in cached:
                swaps.setdefault(node, {})[i] = copy
    # Rewritten once per node, after all: the occurrences are counted on the operands as traced.
    for node, by_index in swaps.items():
        seen = [-1]

        def swap(a, by_index=by_index, seen=seen):
            if a not in params:
                return a
            seen[0] += 1
            return by_index.get(seen[0], a)

        node.args, node.kwargs = torch.fx.node.map_arg((node.args, node.kwargs), swap)
    gm.graph.lint()
    gm.recompile()
