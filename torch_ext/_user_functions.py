"""A user's ``torch.autograd.Function`` in the pure step: its own ``backward`` gives the gradients.

Tracing (torch.export) runs a Function's ``forward`` only: the joint graph, differentiated afterwards, would
get the derivative of that forward and never run the class's ``backward`` (a gradient reversal, a
straight-through estimator, Hugging Face BLOOM's ``GeLUFunction``). So while the step's forward is exported,
each application of a user Function to a tensor that requires grad (under grad mode) is recorded as one call of
``torch_ext_autograd::function_apply(tensors, key)``: ``key`` names the class and the application's non-tensor
arguments in this process's table. That op's Autograd kernel is the class itself (``cls.apply`` on the same
arguments), so when the joint graph is traced, autograd records the class's node as eager does, and
differentiating runs its ``backward`` under the tracer: forward and backward are inlined as the ATen ops
eager runs, and the joint program holds no call of this op (a pure graph that ``.pt2`` saves and AOTInductor
compiles). Below autograd (no gradient wanted) the op runs the class's forward under ``no_grad``.
"""
from __future__ import annotations

import threading

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

_NS = "torch_ext_autograd"
_LIB = torch.library.Library(_NS, "DEF")
_LIB.define("function_apply(Tensor[] tensors, int key) -> Tensor[]")

_LOCK = threading.Lock()
_ENTRIES: list = []  # key -> _Entry


class _Entry:
    """One application site's constants: the class, the arguments' tree with tensors taken out, the
    non-tensor leaves, and (after the first run) the output's tree and its non-tensor leaves."""

    def __init__(self, cls, spec, consts):
        self.cls, self.spec, self.consts = cls, spec, consts
        self.out_spec = None
        self.out_consts = None

    def same(self, cls, spec, consts) -> bool:
        if cls is not self.cls or spec != self.spec or len(consts) != len(self.consts):
            return False
        for a, b in zip(consts, self.consts):
            if a is b:
                continue
            if type(a) is not type(b) or not isinstance(a, (int, float, bool, str, bytes, complex, type(None),
                                                              torch.dtype, torch.device, torch.Size)):
                return False
            if a != b or (isinstance(a, float) and str(a) != str(b)):  # -0.0 vs 0.0
                return False
        return True


def _intern(cls, spec, consts) -> int:
    with _LOCK:
        for key, e in enumerate(_ENTRIES):
            if e.same(cls, spec, consts):
                return key
        _ENTRIES.append(_Entry(cls, spec, consts))
        return len(_ENTRIES) - 1


def _call_args(entry: _Entry, tensors):
    """(args, kwargs) of the application, its tensors replaced by ``tensors``."""
    it = iter(tensors)
    leaves = [next(it) if c is _TENSOR else c for c in entry.consts]
    return pytree.tree_unflatten(leaves, entry.spec)


class _TensorSlot:
    def __repr__(self):
        return "<tensor>"


_TENSOR = _TensorSlot()


def _flat_outputs(entry: _Entry, out):
    leaves, spec = pytree.tree_flatten(out)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    consts = [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]
    if entry.out_spec is None:
        entry.out_spec, entry.out_consts = spec, consts
    elif spec != entry.out_spec or len(consts) != len(entry.out_consts) or any(
            (a is _TENSOR) != (b is _TENSOR) for a, b in zip(consts, entry.out_consts)):
        cls = entry.cls
        raise TypeError(f"custom torch.autograd.Function {cls.__module__}.{cls.__qualname__}: forward returned "
                        f"{spec} where the same application returned {entry.out_spec} before; the pure step "
                        "records one output structure per application")
    return tensors


def _apply(tensors, key, cls=None):
    entry = _ENTRIES[key]
    args, kwargs = _call_args(entry, tensors)
    return entry, (cls or entry.cls).apply(*args, **kwargs)


_NAMED: dict = {}  # cls -> its subclass whose backward names the class when it cannot be traced


def _named_backward(cls):
    """``cls`` with its ``backward`` (or ``vjp``) wrapped so that an error while the joint trace runs it names the
    class (a backward calling numpy fails inside torch's autograd engine, far from the user's code)."""
    sub = _NAMED.get(cls)
    if sub is not None:
        return sub
    Function = torch.autograd.Function
    name = "vjp" if cls.vjp is not Function.vjp and cls.backward is Function.backward else "backward"
    user = getattr(cls, name)

    def backward(ctx, *grads):
        try:
            return user(ctx, *grads)
        except Exception as e:  # noqa: BLE001 - re-raised naming the class
            raise TypeError(
                f"custom torch.autograd.Function {cls.__module__}.{cls.__qualname__}: its {name} cannot be traced "
                f"into the step's program ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). The "
                "step runs it under the tracer, so it must compute with torch ops on its tensors (no .numpy(), no "
                "Python branch on a tensor's value, no code outside torch); or train eagerly") from e

    sub = type(cls.__name__, (cls,), {name: staticmethod(backward), "__module__": cls.__module__,
                                      "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})
    _NAMED[cls] = sub
    return sub


def _autograd_kernel(tensors, key):
    """The class itself, as eager applies it: autograd records its node, differentiating runs its backward.
    With no gradient wanted (grad mode off, no input requiring grad: the step's export) the forward kernel."""
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        with torch._C._AutoDispatchBelowAutograd():
            return OP(tensors, key)
    entry, out = _apply(tensors, key, _named_backward(_ENTRIES[key].cls))
    return _flat_outputs(entry, out)


def _forward_kernel(tensors, key):
    """Below autograd: the class's forward, fresh tensors out (the op's schema declares no alias)."""
    writes = _Writes(tensors)
    with torch.no_grad(), writes:
        entry, out = _apply(tensors, key)
    written = sorted(writes.written)
    if written:
        cls = entry.cls
        raise TypeError(
            f"custom torch.autograd.Function {cls.__module__}.{cls.__qualname__} writes in place into its tensor "
            f"argument(s) {written} in forward (ctx.mark_dirty): the pure step records the Function as one call that "
            "writes nothing, so the write would be lost. Return a new tensor instead, or train eagerly")
    flat = _flat_outputs(entry, out)
    ins = list(tensors)
    return [t.clone() if any(t._is_view() or _aliases(t, i) for i in ins) else t for t in flat]


class _Writes(TorchDispatchMode):
    """Records which of ``inputs`` the ops run inside write into (the version counter is not kept below
    autograd, where a fake kernel runs)."""

    def __init__(self, inputs):
        super().__init__()
        self.inputs, self.written = list(inputs), set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            for t in pytree.tree_leaves(value):
                if isinstance(t, torch.Tensor):
                    self.written.update(j for j, x in enumerate(self.inputs) if _aliases(t, x))
        return func(*args, **kwargs)


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return torch._C._is_alias_of(a, b)
    except RuntimeError:
        return False


_LIB.impl("function_apply", _autograd_kernel, "Autograd")
_LIB.impl("function_apply", _forward_kernel, "CompositeExplicitAutograd")
torch.library.register_fake(f"{_NS}::function_apply", _forward_kernel, lib=_LIB)  # fake tensors: the same forward

OP = getattr(torch.ops, _NS).function_apply.default


def applied_as_op(cls, args, kwargs):
    """``cls.apply(*args, **kwargs)`` as one call of the op (see the module's docstring): its result, the same
    structure the class's forward returns."""
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    consts = [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]
    key = _intern(cls, spec, consts)
    outs = OP(tensors, key)
    entry = _ENTRIES[key]
    it = iter(outs)
    leaves = [next(it) if c is _TENSOR else c for c in entry.out_consts]
    out = pytree.tree_unflatten(leaves, entry.out_spec)
    return out


_MISSING = object()
_pending: dict = {}  # cls -> (thread, {name: what cls.__dict__ held}) while its forward is redirected


def untraceable(cls) -> str | None:
    """Why an application of ``cls`` (to a tensor that requires grad) cannot be recorded as the op, or None."""
    if torch._C._are_functorch_transforms_active():
        return "applied under a functorch transform (vmap, grad), which the pure step cannot trace through"
    return None


def _restore(cls) -> None:
    _, saved = _pending.pop(cls, (None, {}))
    for name, held in saved.items():
        if held is _MISSING:
            try:
                delattr(cls, name)
            except AttributeError:
                pass
        else:
            setattr(cls, name, held)


def restore_all() -> None:
    """Puts back every class whose redirected forward was not reached (an application that raised before)."""
    for cls in list(_pending):
        _restore(cls)


def redirect_next_forward(cls, args, kwargs) -> None:
    """The next ``forward`` that ``cls.apply`` runs on this thread (the one being applied now: torch calls it
    right after) returns ``applied_as_op(cls, args, kwargs)`` instead; the class is put back first thing."""
    _restore(cls)
    me = threading.get_ident()
    originals = {name: cls.__dict__.get(name, _MISSING) for name in ("forward", "setup_context")}
    base_forward = cls.forward
    base_setup = cls.setup_context
    custom_setup = base_setup is not torch.autograd.Function.setup_context

    def forward(*a, **k):
        if threading.get_ident() != me:  # another thread's application meanwhile: the class's own
            return base_forward(*a, **k)
        _restore(cls)
        return applied_as_op(cls, args, kwargs)

    def setup_context(ctx, inputs, output):
        if threading.get_ident() != me:
            return base_setup(ctx, inputs, output)

    _pending[cls] = (me, originals)
    cls.forward = staticmethod(forward)
    if custom_setup:
        cls.setup_context = staticmethod(setup_context)
