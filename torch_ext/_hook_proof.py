"""TransformerLens hook names on a Hugging Face decoder, proven in the traced graph.

``_compat.hf_hook_points`` picks each name's tensor by module names (the layer's input and output, the
attention's and the MLP's outputs, the second norm's input, the output projection's input). A module-name
rule is a guess about the architecture: on sandwich-norm models it named other tensors than TransformerLens
does, silently. So after tracing, each name is kept only where the graph shows what TransformerLens
promises for it (HookedTransformer's TransformerBlock, TransformerLens 4's BlockBridge):

- ``hook_resid_post`` of layer L is ``hook_resid_pre`` of layer L+1 (the same value);
- ``hook_resid_mid = hook_resid_pre + hook_attn_out``: one add, exactly those two inputs, in either order;
- ``hook_resid_post = hook_resid_mid + hook_mlp_out`` (likewise), or, with no resid_mid (parallel
  attention and MLP: GPT-J, Phi, Cohere, CodeGen, parallel Falcon; TransformerLens names none there),
  ``hook_resid_post = hook_resid_pre + hook_attn_out + hook_mlp_out``, a sum of adds in any order;
- ``attn.hook_z`` feeds a matrix product (the output projection) whose result reaches ``hook_attn_out``, and is
  a reshape of the attention's [batch, head, pos, d_head] output with head and pos swapped, so that its last dim is
  the heads side by side (hook_z's [batch, pos, head, d_head] view splits it by head).

Where resid_mid = resid_pre + X (or resid_post = resid_mid + Y) is proven and X is read by that add alone, X is
what TransformerLens's attn_out (mlp_out) is, whatever module computes it: the name is put there (Granite scales
each branch before the add; BLOOM's attention and MLP add the residual themselves). Any other name whose promise
does not hold is not offered: asking for it raises an error naming the hook, the model's class and what the
graph holds instead.
"""
from __future__ import annotations

import torch

_aten = torch.ops.aten
# Values that are their input: a hook marker's alias, eval-mode dropout, a copy.
_SAME = {_aten.alias.default, _aten.clone.default}
_VIEWS = {_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default, _aten.alias.default,
          _aten.clone.default, _aten.contiguous.default, _aten.flatten.using_ints}
_MATMULS = {_aten.linear.default, _aten.addmm.default, _aten.mm.default, _aten.matmul.default, _aten.bmm.default}
_ADD = _aten.add.Tensor

PROMISES = {
    "hook_resid_post": "the layer's output, which is the next layer's hook_resid_pre",
    "hook_resid_mid": "hook_resid_pre + hook_attn_out (one add of exactly those two)",
    "hook_attn_out": "what the attention adds to the residual stream (hook_resid_mid = hook_resid_pre + hook_attn_out, "
                     "or without a resid_mid, hook_resid_post = hook_resid_pre + hook_attn_out + hook_mlp_out)",
    "hook_mlp_out": "what the MLP adds to the residual stream (hook_resid_post = hook_resid_mid + hook_mlp_out, "
                    "or without a resid_mid, hook_resid_pre + hook_attn_out + hook_mlp_out)",
    "attn.hook_z": "the attention's per-head output, heads side by side, read by the output projection that gives "
                   "hook_attn_out",
}


_CASTS = {_aten.to.dtype, _aten.to.dtype_layout, _aten.to.device, _aten._to_copy.default, _aten.type_as.default}


def _same_meta(a, b) -> bool:
    x, y = a.meta.get("val"), b.meta.get("val") if isinstance(b, torch.fx.Node) else None
    return (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype
            and x.device == y.device and x.shape == y.shape)


def _value(n):
    """The node whose value ``n`` is: through aliases, copies, eval-mode dropout and casts to the dtype the
    value has (``hidden_states.to(torch.float32)`` of a float32 stream: eager returns the tensor itself)."""
    while isinstance(n, torch.fx.Node) and n.op == "call_function" and n.args:
        if (n.target in _SAME or (n.target is _aten.dropout.default and len(n.args) > 2 and n.args[2] is False)
                or (n.target in _CASTS and _same_meta(n, n.args[0]))):
            n = n.args[0]
        else:
            break
    return n


def _describe(n) -> str:
    n = _value(n)
    if not isinstance(n, torch.fx.Node):
        return repr(n)
    if n.op != "call_function":
        return f"'{n.name}' ({n.op})"
    args = ", ".join(f"'{_value(a).name}'" if isinstance(a, torch.fx.Node) else repr(a) for a in n.args[:3])
    target = getattr(n.target, "__name__", str(n.target))
    return f"'{n.name}' = {target}({args})"


def _add_operands(n):
    """(x, y) of ``n = x + y`` (aten.add.Tensor of two tensors, alpha 1), else None."""
    n = _value(n)
    if not (isinstance(n, torch.fx.Node) and n.op == "call_function" and n.target is _ADD and len(n.args) == 2):
        return None
    if n.kwargs.get("alpha", 1) != 1 or not all(isinstance(a, torch.fx.Node) for a in n.args):
        return None
    return _value(n.args[0]), _value(n.args[1])


def _sole_operand(add, value):
    """The argument of ``add`` whose value is ``value``, if ``add`` is its only reader (so patching it changes
    only what the residual add reads, as patching TransformerLens's hook does), else None."""
    for a in add.args:
        if isinstance(a, torch.fx.Node) and _value(a) is value and len(a.users) == 1 and a.op == "call_function":
            return a
    return None


def _terms(n, stop: set) -> list:
    """The summands of ``n`` through adds, stopping at the nodes in ``stop``."""
    n = _value(n)
    if n in stop:
        return [n]
    ops = _add_operands(n)
    if ops is None:
        return [n]
    return _terms(ops[0], stop) + _terms(ops[1], stop)


def _reaches(src, dst, limit: int = 400) -> bool:
    seen, todo = set(), [src]
    while todo and len(seen) < limit:
        n = todo.pop()
        if n is dst:
            return True
        if n in seen:
            continue
        seen.add(n)
        todo.extend(n.users)
    return False


def _feeds_projection(z, target) -> str | None:
    """None if ``z`` (through views) is an input of a matrix product whose result reaches ``target``,
    else what was found."""
    seen, todo, products = set(), [z], []
    while todo:
        n = todo.pop()
        for u in n.users:
            if u in seen:
                continue
            seen.add(u)
            if u.target in _VIEWS:
                todo.append(u)
            elif u.target in _MATMULS:
                products.append(u)
    if not products:
        return f"no matrix product reads it (its readers: {', '.join(_describe(u) for u in z.users) or 'none'})"
    if target is None or any(_reaches(p, target) for p in products):
        return None
    return f"the product reading it ({_describe(products[0])}) does not reach {_describe(target)}"


def _head_layout(z, heads: int) -> str | None:
    """None if ``z``'s last dim is the heads' outputs side by side, head-major (index h * d_head + d), as
    TransformerLens's [batch, pos, head, d_head] view of hook_z takes it: through views only, ``z`` is a reshape of
    ``x.transpose(1, 2)`` (or ``x.permute(0, 2, 1, 3)``) of an ``x`` of shape [batch, heads, pos, d_head] whose
    last dim is heads * d_head (a reshape keeps the row-major order, so z[..., h * d_head + d] is x[b, h, s, d]);
    else what was found."""
    val = z.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() < 1 or val.shape[-1] % heads:
        return f"its shape {tuple(getattr(val, 'shape', ()))} does not split into {heads} heads"
    n = z
    while isinstance(n, torch.fx.Node) and n.op == "call_function" and n.target in _VIEWS and n.args:
        n = n.args[0]
    swap = None
    if isinstance(n, torch.fx.Node) and n.op == "call_function":
        if n.target is _aten.transpose.int and len(n.args) == 3:
            swap = sorted(d % 4 for d in n.args[1:]) == [1, 2]
        elif n.target is _aten.permute.default:
            swap = [d % 4 for d in n.args[1]] == [0, 2, 1, 3]
    x = n.args[0].meta.get("val") if swap else None
    if not (isinstance(x, torch.Tensor) and x.dim() == 4 and x.shape[1] == heads
            and x.shape[1] * x.shape[3] == val.shape[-1]):
        return (f"its head layout is not proven: it is not a reshape of [batch, {heads} heads, pos, d_head] with "
                f"heads and pos swapped (it reshapes {_describe(n)})")
    return None


def verify(graph: torch.fx.Graph, hooks: dict, layers: int, arch: str, heads: int | None = None) -> dict:
    """Checks the TransformerLens names of a Hugging Face decoder's ``layers`` layers in ``graph`` (hook name ->
    node name, as strip_hook_points left them); removes from ``hooks`` each name whose promise does not hold
    and returns {name: why} for them."""
    by_name = {n.name: n for n in graph.nodes}
    refused: dict = {}

    def node(name):
        return _value(by_name[hooks[name]]) if name in hooks and hooks[name] in by_name else None

    def put(name, operand, add, what):
        """Names ``operand`` (the add's own argument, read by it alone), else refuses ``name``."""
        arg = _sole_operand(add, operand)
        if arg is not None:
            hooks[name] = arg.name
            return arg
        refuse(name, what)
        return None

    def refuse(name, found):
        if name in hooks and name not in refused:
            refused[name] = (f"hook '{name}' is not offered on this {arch}: TransformerLens defines it as "
                             f"{PROMISES[name.split('.', 2)[2]]}, but in the traced graph {found}")

    for l in range(layers):
        b = f"blocks.{l}."
        pre, mid, post = node(b + "hook_resid_pre"), node(b + "hook_resid_mid"), node(b + "hook_resid_post")
        attn, mlp, z = node(b + "hook_attn_out"), node(b + "hook_mlp_out"), node(b + "attn.hook_z")
        nxt = node(f"blocks.{l + 1}.hook_resid_pre")
        if post is not None and nxt is not None and post is not nxt:
            refuse(b + "hook_resid_post", f"the layer's output is {_describe(post)} while blocks.{l + 1}.hook_resid_pre "
                                          f"is {_describe(nxt)}")
        if mid is not None:
            ops = _add_operands(mid)
            if mid is pre:
                refuse(b + "hook_resid_mid", f"it is hook_resid_pre itself ({_describe(pre)}): the MLP reads the "
                                             "layer's input, as with parallel attention and MLP, where TransformerLens "
                                             "names no resid_mid")
                mid = None
            elif ops is None or pre not in ops:
                refuse(b + "hook_resid_mid", f"it is {_describe(mid)}, not an add reading hook_resid_pre "
                                             f"({_describe(pre)})")
                mid = None
            else:
                other = ops[1] if ops[0] is pre else ops[0]
                if other is not attn:
                    attn = put(b + "hook_attn_out", other, mid,
                               f"hook_resid_mid is {_describe(mid)}: the attention's contribution is {_describe(other)}, "
                               f"which other nodes read too, while the name was on {_describe(attn)}")
        if mid is not None:
            ops = _add_operands(post) if post is not None else None
            if ops is None or mid not in ops:
                refuse(b + "hook_mlp_out", f"hook_resid_post is {_describe(post)}, not hook_resid_mid ({_describe(mid)}) "
                                           "plus one other value")
            else:
                other = ops[1] if ops[0] is mid else ops[0]
                if other is not mlp:
                    mlp = put(b + "hook_mlp_out", other, _value(post),
                              f"hook_resid_post is {_describe(post)}: the MLP's contribution is {_describe(other)}, "
                              f"which other nodes read too, while the name was on {_describe(mlp)}")
        elif post is not None and pre is not None:
            stop = {x for x in (pre, attn, mlp) if x is not None}
            terms = _terms(post, stop)
            summed = ", ".join(_describe(t) for t in terms)
            for name, x in ((b + "hook_attn_out", attn), (b + "hook_mlp_out", mlp)):
                if x is not None and (pre not in terms or terms.count(x) != 1 or terms.count(pre) != 1):
                    refuse(name, f"hook_resid_post ({_describe(post)}) sums {summed}, not hook_resid_pre "
                                 f"({_describe(pre)}) plus {_describe(x)} once")
        if z is not None:
            target = attn if attn is not None and (b + "hook_attn_out") not in refused else post
            why = _feeds_projection(z, target)
            if why is None and heads:
                why = _head_layout(z, heads)
            if why is not None:
                refuse(b + "attn.hook_z", f"it is {_describe(z)}: {why}")
    for name in refused:
        hooks.pop(name, None)
    return refused
