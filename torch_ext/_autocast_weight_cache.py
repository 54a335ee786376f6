"""Eager's autocast weight cache, made explicit in an export's flat pre-dispatch graph (one pass).

Eager (``at::autocast::cached_cast``, torch 2.9) casts a float32 leaf that requires grad (a parameter) to the
autocast dtype once per outermost autocast region while the weight cache is on (``cache_enabled``, the default),
and every later cast of it in the region returns that one copy; the cache is cleared where the outermost region
exits. So a layer applied twice, or a weight shared by two layers, has its uses' gradients added in bfloat16 before
the one cast back to float32. Tracing turns the cache off: the trace cast the weight at each use, and the joint graph
added two float32 gradients (momentum buffers 1e-4 off eager after 3 SGD steps). ``share_autocast_weight_casts``
runs on the flat graph before torch's grad-mode and autocast passes split it into regions
(_compat.autocast_weight_cache installs it, and marks each traced ``_enter_autocast`` with eager's cache flag).
"""
from __future__ import annotations

import torch
from torch.export.graph_signature import InputKind


CACHE_FLAG = "torch_ext_autocast_cache"  # meta of a traced _enter_autocast: eager's weight-cache flag there


class _CastRecorder:
    """The casts to ``dtype`` of the tensors ``watched`` that run under it (a dispatch mode: it sees autocast's
    casts, made above it)."""

    def __init__(self, watched: list, dtype):
        from torch.utils._python_dispatch import TorchDispatchMode

        counts = [0] * len(watched)

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == dtype:
                    for i, t in enumerate(watched):
                        if args[0] is t:
                            counts[i] += 1
                return func(*args, **kwargs)

        self.mode, self.counts = Mode(), counts


_AUTOCAST_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA", "xpu": "AutocastXPU", "mps": "AutocastMPS",
                  "hpu": "AutocastHPU", "xla": "AutocastXLA", "mtia": "AutocastMTIA", "maia": "AutocastMAIA"}


def _has_autocast_kernel(node: torch.fx.Node, device: str) -> bool:
    """Whether autocast has a kernel of its own for ``node``'s op on ``device`` (every other op falls through:
    autocast casts nothing for it)."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return False
    key = _AUTOCAST_KEYS.get(device, "AutocastPrivateUse1")
    return torch._C._dispatch_has_kernel_for_dispatch_key(node.target.name(), key)


def _autocast_cast_operands(node: torch.fx.Node, params: set, device: str, dtype) -> list[int]:
    """Which occurrences of ``params`` (placeholder nodes) among ``node``'s operands, counted in ``map_arg``'s
    order, ``torch.autocast(device, dtype)`` casts to ``dtype`` when it runs ``node``'s op: those it casts with
    autocast on and not with it off (the op's own casts, an explicit ``.to()``, run either way). Found by running
    the op on fresh fake tensors (raises what that raised)."""
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
            counts[enabled] = rec.counts
    return [i for i, (on, off) in enumerate(zip(counts[True], counts[False])) if on > off]


def share_autocast_weight_casts(gm: torch.fx.GraphModule, signature) -> None:
    """Eager's autocast weight cache, made explicit in the flat pre-dispatch graph ``gm`` of an export.

    Eager (``at::autocast::cached_cast``) casts a float32 leaf that requires grad (a parameter) to the autocast
    dtype once per outermost autocast region while the weight cache is on (``cache_enabled``, the default), and
    every later cast of it in the region returns that one copy: a layer applied twice, or a weight shared by two
    layers, has its two uses' gradients added in bfloat16 before the one cast back to float32. Tracing disables
    the cache, so the trace cast the weight at each use, and the joint graph added two float32 gradients (momentum
    buffers 1e-4 off eager after 3 SGD steps). Here the casts autocast would serve from its cache (found by running
    each op on fake tensors, _autocast_cast_operands) read one explicit ``_to_copy`` placed before the first: in
    its grad mode, as eager's copy is made there (a copy made under no_grad gives no gradient through later uses,
    as in eager). Explicit ``.to()`` calls are not cached by eager and stay as they are; a frozen parameter
    (cast anew by eager) gives the same values and no gradient either way. The cache is cleared where the
    outermost region exits, so two regions keep a cast each."""
    enter, exit_ = torch.amp.autocast_mode._enter_autocast, torch.amp.autocast_mode._exit_autocast
    names = {s.arg.name: s.target for s in signature.input_specs if s.kind == InputKind.PARAMETER}
    params = {n for n in gm.graph.nodes if n.op == "placeholder" and n.name in names
              and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dtype == torch.float32}
    if not params or not any(n.op == "call_function" and n.target is enter for n in gm.graph.nodes):
        return
    # Per outermost region: the parameters' uses, and then the nodes that use one of them twice or more.
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
    for uses in regions:
        counted: dict[torch.fx.Node, int] = {}
        for _, _, used in uses:
            for p in used:
                counted[p] = counted.get(p, 0) + 1
        shared = {p for p, k in counted.items() if k > 1}
        if not shared:
            continue
        sites: dict[torch.fx.Node, list[tuple[torch.fx.Node, int, torch.dtype]]] = {}
        for node, inside, used in uses:
            if not shared & set(used):
                continue
            if not inside[-1].meta.get(CACHE_FLAG, False):  # the innermost region sets the cache flag
                continue
            device = used[0].meta["val"].device.type
            region = next((e for e in reversed(inside) if e.args[0] == device), None)
            if region is None or not region.args[2]:
                continue
            dtype = region.args[1]
            if not _has_autocast_kernel(node, device):
                continue
            try:
                cast = _autocast_cast_operands(node, params, device, dtype)
            except Exception as e:  # noqa: BLE001 - re-raised naming the op
                raise NotImplementedError(
                    f"cannot tell which operands of {node.target} (reading parameter(s) "
                    f"{sorted({names[p.name] for p in used})}) torch.autocast casts, running it on fake tensors "
                    f"failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); eager's autocast weight "
                    "cache shares such casts within a region, which the step would not reproduce. Pass "
                    "cache_enabled=False to torch.autocast, or compute this op outside the autocast region") from e
            for i in cast:
                if used[i] in shared:
                    sites.setdefault(used[i], []).append((node, i, dtype))
        for p, cached in sites.items():
            if len(cached) < 2:
                continue
            dtypes = {d for _, _, d in cached}
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
            for node, i, _ in cached:
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
