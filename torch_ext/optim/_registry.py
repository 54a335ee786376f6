"""The Python half of an optimizer: which torch.optim class maps to which C++ descriptor.

A descriptor (csrc/optim/descriptor.h, read here through ``_C.optimizer_descriptors()``) states a
kind's state slots, scalar hyperparameters and ops. A :class:`Registration` adds what only Python
knows: the torch.optim class, how to read a param group into the kind and its hyperparameters, and
how to move state between ``optimizer.state`` and the step's state entries. The defaults below
follow the slot descriptions, so most registrations only supply ``read``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from .. import _C

__all__ = ["Registration", "register", "registration_for", "registrations", "descriptor", "state_name", "lr_name",
           "group_input_name",
           "parse_state_name", "aten_updates", "onnx_updates", "onnx_kinds", "aten_grad", "F64", "once",
           "refuse_rounded_tensor_lr", "operand", "refuse_default_foreach", "read_betas"]


@functools.lru_cache(maxsize=None)
def _descriptors() -> dict[str, dict]:
    return {d["kind"]: d for d in _C.optimizer_descriptors()}


def descriptor(kind: str) -> dict:
    """The C++ descriptor of ``kind``: kind, title, op, inplace_op, slots [(name, "zeros"|"step"|"one"|"factored")],
    scalars [(name, "float"|"int"|"bool")], schedulable [the float scalars a scheduler may change: tensor
    arguments of the ops' "scheduled" overload, fed per step as lr is], elementwise."""
    try:
        return _descriptors()[kind]
    except KeyError:
        raise ValueError(f"unknown update kind {kind!r} (registered: {', '.join(sorted(_descriptors()))})") from None


def state_name(param: str, slot: str) -> str:
    """The state entry of ``param``'s optimizer slot (built in C++, as the passes name it)."""
    return _C.optimizer_state_name(param, slot)


def lr_name(group: int) -> str:
    return _C.optimizer_lr_name(group)


def group_input_name(hyper: str, group: int) -> str:
    """The input of param group ``group`` that feeds ``hyper`` per step: "opt:lr:group<g>", or a scheduled
    scalar's "opt:<scalar>:group<g>"."""
    return _C.optimizer_group_input_name(hyper, group)


# Called for every state entry of every step call: cached, as the names are fixed per program.
parse_state_name: Callable[[str], tuple | None] = functools.lru_cache(maxsize=None)(_C.parse_optimizer_state_name)
parse_state_name.__doc__ = """("lr", group) for an lr input, ("hyper", scalar, group) for a scheduled scalar's
input, ("slot", param, slot) for an optimizer slot, else None."""


def default_initial_state(kind: str, st: dict, param: torch.Tensor, group: dict) -> dict[str, torch.Tensor]:
    """Each slot from torch.optim's per-parameter state ``st``, or as the descriptor starts it
    (zeros like the parameter; a step counter at 0; a scalar "one" slot, NAdam's mu_product, at 1; a
    "factored" slot, Adafactor's row_var and col_var, zeros of the shape the descriptor derives from the
    parameter's) when torch.optim has not created it yet."""
    out = {}
    for slot, init in descriptor(kind)["slots"]:
        v = st.get(slot)
        if init == "factored":
            out[slot] = v.detach().clone() if v is not None else param.new_zeros(
                _C.optimizer_slot_shape(kind, slot, list(param.shape)))
        # A scalar slot is an f32[] on the CPU whatever the parameter's device (the program declares it so, as
        # torch.optim keeps its step): one torch.optim holds elsewhere (a loaded state dict) is copied there.
        elif init == "step":
            out[slot] = (v.detach().to("cpu", torch.float32, copy=True) if isinstance(v, torch.Tensor)
                         else torch.tensor(float(v or 0.0)))
        elif init == "one":
            out[slot] = v.detach().to("cpu", torch.float32, copy=True) if isinstance(v, torch.Tensor) else torch.tensor(1.0)
        else:
            out[slot] = v.detach().clone() if v is not None else torch.zeros_like(param)
    return out


def default_torch_state(kind: str, values: dict[str, torch.Tensor], group: dict) -> dict[str, torch.Tensor]:
    """The entries ``optimizer.state[p]`` gets back from the step's ``values`` (slot -> tensor):
    every slot, the step counter first, once the parameter has been updated (step > 0); nothing
    before, as torch.optim creates its state on the first step."""
    slots = descriptor(kind)["slots"]
    steps = [s for s, init in slots if init == "step"]
    if any(float(values[s]) == 0 for s in steps):
        return {}
    return {s: values[s].clone() for s in steps + [s for s, init in slots if init != "step"]}


@dataclass(frozen=True)
class Registration:
    """How the pure step reads one torch.optim class.

    ``read(opt, group, param, gi)`` returns ``dict(kind=..., hyper={...}, flags={...})`` for one
    parameter of param group ``gi``: the kind names a C++ descriptor, ``hyper`` holds its float and
    int scalars and ``flags`` its bool scalars, by name. It raises ValueError for options the kind
    cannot replay. ``initial_state`` and ``torch_state`` convert state (see the defaults above).
    ``foreach_exact``: torch.optim's foreach path computes the same numbers as the single-tensor
    path the kernel replays, so foreach=True is accepted.
    ``aten``: for each kind, its update op written as functional ATen with the op's signature and
    returns (a slot the kind does not use may come back as None), for compilers that fuse it
    (``TrainStep.to_aoti``; see :func:`aten_updates`). A kind without one runs its C++ kernel there.
    ``onnx``: for each kind, its update op written in onnxscript (helpers in ``optim/_onnx.py``), the
    translation ``torch.onnx.export`` uses for the op (``TrainStep.to_onnx``; see :func:`onnx_updates`):
    parameters unannotated and named as the op's schema arguments, as the exporter binds them by name.
    A kind without one is refused by ``to_onnx``, naming its op.
    ``scheduled``: where each schedulable scalar of its kinds (the descriptor's ``schedulable``) lives
    in a param group, as a scheduler that cycles momentum writes it: (key, None) for ``group[key]``,
    (key, i) for ``group[key][i]``. A scalar not listed here stays baked in (a change is refused).
    """

    optimizer: type
    read: Callable[..., dict]
    initial_state: Callable[..., dict] = default_initial_state
    torch_state: Callable[..., dict] = default_torch_state
    foreach_exact: bool = True
    aten: Mapping[str, Callable] = field(default_factory=dict)
    onnx: Mapping[str, Callable] = field(default_factory=dict)
    scheduled: Mapping[str, tuple[str, int | None]] = field(default_factory=dict)


_REGISTRY: dict[type, Registration] = {}


def register(registration: Registration) -> Registration:
    cls = registration.optimizer
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"register: optimizer must be a torch.optim.Optimizer subclass, got {cls!r}")
    if cls in _REGISTRY:
        raise ValueError(f"register: {cls.__qualname__} is registered twice")
    for kind in registration.aten:
        descriptor(kind)  # an unknown kind is refused here, naming it
    for kind, fn in registration.onnx.items():
        _check_onnx_form(cls, kind, fn)
    _REGISTRY[cls] = registration
    return registration


def _check_onnx_form(cls: type, kind: str, fn: Callable) -> None:
    """Refuses an ONNX form the exporter would bind otherwise than the op: torch.onnx's dynamo exporter
    matches a translation's parameters to the op's arguments by name, and an annotated parameter by its
    type (an annotated float becomes an ONNX attribute, not the Python value the forms branch on)."""
    import inspect

    schema = getattr(torch.ops.torch_ext, descriptor(kind)["op"]).default._schema
    want = [a.name for a in schema.arguments]
    params = inspect.signature(fn).parameters
    got = list(params)
    if got != want:
        raise ValueError(f"register: {cls.__qualname__}'s ONNX form of {kind!r} ({getattr(fn, '__qualname__', fn)}) "
                         f"takes ({', '.join(got)}); the exporter binds by name, so it must take the op's arguments "
                         f"({', '.join(want)})")
    annotated = [n for n, p in params.items() if p.annotation is not inspect.Parameter.empty]
    if annotated:
        raise ValueError(f"register: {cls.__qualname__}'s ONNX form of {kind!r} annotates {', '.join(annotated)}; "
                         "the exporter reads annotations as ONNX types and attributes, so leave them out")


def registrations() -> list[Registration]:
    return list(_REGISTRY.values())


def registration_for(opt: torch.optim.Optimizer) -> Registration:
    """The registration of ``opt``'s class or of its nearest registered base class."""
    for cls in type(opt).__mro__:
        if cls in _REGISTRY:
            return _REGISTRY[cls]
    names = ", ".join(r.optimizer.__name__ for r in _REGISTRY.values())
    raise TypeError(f"optimizer {type(opt).__name__} is not supported (supported: {names})")


F64 = torch.float64


def refuse_rounded_tensor_lr(opt: torch.optim.Optimizer, group: dict, gi: int, computes: str) -> None:
    """Refuses a group whose lr is a tensor of a dtype other than float64, for a kind whose eager step
    computes ``computes`` from lr in the tensor's own arithmetic: with ``lr=torch.tensor(0.01)`` (float32)
    torch.optim rounds that scalar to float32 (Adam's step size: 1e-7 off after 5 steps), while the
    step computes it in double, as eager does for a Python float or a float64 tensor."""
    lr = group["lr"]
    if isinstance(lr, torch.Tensor) and lr.dtype != F64:
        raise ValueError(
            f"{type(opt).__name__} param group {gi}: lr is a {lr.dtype} tensor ({float(lr)!r}); eager "
            f"{type(opt).__name__} then computes {computes} in {lr.dtype} arithmetic, which the pure step does "
            f"not reproduce bit for bit. Pass lr as a Python float or a torch.float64 tensor.")


def refuse_default_foreach(opt: torch.optim.Optimizer, group: dict, param: torch.Tensor, gi: int) -> None:
    """For a kind whose registration is not ``foreach_exact`` (foreach=True is refused by name): refuses
    foreach=None where torch.optim would pick its foreach path by default (parameters on CUDA and the like;
    on CPU it picks the single-tensor path the kernel replays), as that path rounds differently."""
    if group.get("foreach") is not None or group.get("differentiable"):
        return
    from torch.optim.optimizer import _default_to_fused_or_foreach

    if _default_to_fused_or_foreach([param], differentiable=False, use_fused=False)[1]:
        raise ValueError(
            f"{type(opt).__name__} param group {gi}: foreach=None on {param.device.type} runs torch.optim's foreach "
            f"path, which rounds differently from the single-tensor path the pure step replays; pass foreach=False")


def read_betas(opt: torch.optim.Optimizer, group: dict, gi: int) -> tuple[float, float]:
    """``group["betas"]`` as (beta1, beta2), Python floats, for a kind that takes them as scalars; tensor
    betas are refused by name, with their values."""
    betas = group["betas"]
    if any(isinstance(b, torch.Tensor) for b in betas):
        raise ValueError(f"{type(opt).__name__} param group {gi}: tensor betas are not supported (got {betas!r}); "
                         "pass them as Python floats")
    beta1, beta2 = betas
    return float(beta1), float(beta2)


def once(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a 0-d value of the step count or lr, in an ATen form) computed once per call.

    Inductor inlines 0-d arithmetic into the loop of the elementwise update that reads it, so
    Adam's bias corrections (two double ``pow``) ran once per vector of every parameter, and the C
    compiler cannot hoist them past the loop's stores (13% of the AdamW update at ResNet-18 size).
    ``as_strided`` needs a realized input in Inductor, so ``t`` gets a buffer of its own, computed
    before the loop. The same value, bit for bit."""
    if t.dim() != 0:  # as_strided to () would silently keep only the first element
        raise ValueError(f"once: expected a 0-d tensor, got shape {tuple(t.shape)}")
    return torch.as_strided(t, (), ())


def aten_grad(param, grad, weight_decay, maximize):
    """The gradient with maximize and coupled weight decay applied, as the C++ kernels do."""
    g = grad.neg() if maximize else grad
    return g.add(param, alpha=weight_decay) if weight_decay != 0 else g


def aten_updates() -> dict:
    """{torch_ext update OpOverload: its ATen form} over every registration's ``aten``.

    In the pure step each parameter's update is one ``torch_ext::<kind>_update`` call whose kernel is C++
    (csrc/optim/<kind>.cpp) made of eager ATen calls. AOTInductor cannot look inside it: it calls the
    kernel as an opaque fallback, one eager op (and one allocation) per line of the update, and the update
    costs most of a step (ResNet-18 with AdamW: 83% of the AOTInductor step's CPU time, measured under load).
    Written as functional ATen, the same formula is fused by Inductor into a kernel or two per parameter.
    The C++ kernel stays the reference (the executor and the arena run it bit-exact with torch.optim); the
    ATen forms follow it line by line, in the same dtypes (scalars that torch.optim keeps as Python floats
    are computed in float64), so they agree with it to float32 rounding (tests/python/test_optim_decompositions.py).
    """
    ops = torch.ops.torch_ext
    table = {}
    for reg in _REGISTRY.values():
        for kind, fn in reg.aten.items():
            op = getattr(ops, descriptor(kind)["op"])
            table[op.default] = fn
            if descriptor(kind)["schedulable"]:  # the same form: its scalars take a float64 0-d tensor too
                table[op.scheduled] = fn
    return table


def onnx_updates() -> dict:
    """{torch_ext update OpOverload: its ONNX form} over every registration's ``onnx``, the
    ``custom_translation_table`` of ``torch_ext.onnx.to_onnx``; a kind with schedulable scalars maps its
    "scheduled" overload to the same form (a scheduled scalar arrives as a float64 tensor)."""
    ops = torch.ops.torch_ext
    table = {}
    for reg in _REGISTRY.values():
        for kind, fn in reg.onnx.items():
            op = getattr(ops, descriptor(kind)["op"])
            table[op.default] = fn
            if descriptor(kind)["schedulable"]:
                table[op.scheduled] = fn
    return table


def onnx_kinds() -> list[str]:
    """"<optimizer> (<kinds>)" for every registration with ONNX forms, in registration order (error messages)."""
    return [f"{r.optimizer.__name__} ({', '.join(r.onnx)})" for r in _REGISTRY.values() if r.onnx]


def operand(x, dtype: torch.dtype):
    """A hyperparameter as an ATen form multiplies or interpolates with it: a Python float as is, or a
    scheduled one (a float64 0-d tensor) cast to the tensors' dtype, as eager converts a Python
    scalar to the op's compute type."""
    return x.to(dtype) if isinstance(x, torch.Tensor) else x
