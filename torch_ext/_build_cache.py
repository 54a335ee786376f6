"""A per-process cache of the graphs ReactiveGraph builds, keyed by what the trace depends on.

Tracing a module (make_fx or torch.export) is most of the cost of a ReactiveGraph. The trace runs on
fake tensors, so it depends on the module's code and Python state, the shapes (not the values) of its
parameters, buffers and inputs, and a few global flags, never on tensor data: a second module of the
same architecture (a fresh instance, a fine-tuned copy, the same model after load_state_dict) reuses
the imported graph and only binds its own weights.

The key (``fingerprint``) covers:
- torch's and torch_ext's versions, the front end and the graph options that change the graph;
- every input leaf: a tensor's shape, strides, dtype, device and requires_grad; other values as they are;
- every module of the tree, by path: its class (the class object itself, so a redefined class
  misses), training flag, and its whole Python state, walked recursively: numbers, strings, configs
  and other objects by value, functions and bound methods (forward wrappers, hooks) by code object,
  defaults and closure contents; parameters and buffers by name, shape, strides, dtype, device and
  requires_grad; a tensor held as a plain attribute by its contents; modules of the tree by path;
- nn.Module's global hooks, grad mode, inference mode, autocast and the default dtype.

An object it cannot describe (an unhashable C extension object, a tensor over 64 Ki elements held as an
attribute) makes the module uncacheable: it is built, not cached. Module-level globals that a forward
is built, not cached.

Code is in the key with what it reads: a class of the tree by its bases and the functions, static and
class methods and properties of its own namespace (so a method replaced on the class misses); a function
by its code object, defaults, closure and every global its code names (so a module-level helper or
constant reassigned between builds misses). Classes and functions of installed packages (the standard
library, torch, transformers, transformer_lens: anything under site-packages) are taken by identity:
patching a library between builds is not detected (turn the cache off with ``TORCH_EXT_BUILD_CACHE=0``
or ``ReactiveGraph(..., cache=False)``). torch_ext installed in development mode counts as user code.
"""
from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import gc
import hashlib
import logging
import os
import sys
import sysconfig
import types
import weakref

import torch
import torch.utils._pytree as pytree

MAX_ENTRIES = 16
_TENSOR_ATTR_LIMIT = 1 << 16
_entries: "collections.OrderedDict[tuple, object]" = collections.OrderedDict()
_counters = {"hits": 0, "misses": 0, "uncacheable": 0}


class Uncacheable(Exception):
    """The key cannot describe something the trace may depend on."""


def enabled() -> bool:
    return os.environ.get("TORCH_EXT_BUILD_CACHE", "1") not in ("0", "false", "off", "")


def clear() -> None:
    _entries.clear()
    for k in _counters:
        _counters[k] = 0


def info() -> dict:
    return {"entries": len(_entries), **_counters}


def get(key):
    entry = _entries.get(key)
    if entry is not None:
        _entries.move_to_end(key)
        _counters["hits"] += 1
    else:
        _counters["misses"] += 1
    return entry


def put(key, entry) -> None:
    _entries[key] = entry
    _entries.move_to_end(key)
    while len(_entries) > MAX_ENTRIES:
        _entries.popitem(last=False)


_PRIMITIVE = frozenset({type(None), bool, int, float, complex, str, bytes})
_CONTAINER_LIMIT = 1 << 16
_INSTALLED = tuple(sorted({p for p in (sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib"))
                           if p}))


@functools.lru_cache(maxsize=None)
def _is_installed_module(name: str) -> bool:
    """The module comes with Python or from an installed package (site-packages), not the user's code."""
    root = name.partition(".")[0]
    if root in sys.stdlib_module_names or root in sys.builtin_module_names:
        return True
    module = sys.modules.get(name) or sys.modules.get(root)
    path = getattr(module, "__file__", None)
    return path is not None and os.path.abspath(path).startswith(_INSTALLED)


def _is_library(obj) -> bool:
    """Code of Python and of installed packages (torch, transformers, transformer_lens, ...): taken by
    identity, not walked; the user's own code (scripts, their package) is walked with what it reads."""
    module = getattr(obj, "__module__", None)
    return isinstance(module, str) and _is_installed_module(module)


@functools.lru_cache(maxsize=None)
def _global_names(code: types.CodeType) -> tuple:
    """Names a code object (and the code nested in it: lambdas, comprehensions) may read as globals."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.update(_global_names(const))
    return tuple(sorted(names))


def _tensor_meta(t: torch.Tensor) -> tuple:
    return (type(t), tuple(t.shape), tuple(t.stride()) if t.layout == torch.strided else None, t.dtype,
            str(t.device), t.requires_grad, t.layout)


class _Walker:
    """Describes Python objects as hashable tuples (see the module docstring)."""

    def __init__(self, state_names: dict, module_paths: dict):
        self.state_names = state_names  # id(tensor) -> name of a parameter/buffer of the tree
        self.module_paths = module_paths  # id(module) -> path in the tree
        self.memo: dict[int, object] = {}
        self.keep: list = []  # objects whose ids are memo keys stay alive during the walk

    def __call__(self, obj, depth: int = 0):
        t = type(obj)
        if t in _PRIMITIVE:
            # Typed, so that 1, 1.0 and True differ; floats by repr, so that -0.0 and 0.0 differ.
            return (t, repr(obj) if t is float or t is complex else obj)
        if t is dict and all(type(k) is str for k in obj) and all(type(v) in _PRIMITIVE for v in obj.values()):
            # A dict of plain values (hook alias tables, configs): described without a call per entry.
            return (dict, tuple((k, type(v), repr(v) if type(v) in (float, complex) else v) for k, v in obj.items()))
        if isinstance(obj, (bool, int, float, complex, str, bytes)):  # subclasses (enum.IntEnum handled below)
            if isinstance(obj, enum.Enum):
                return (type(obj), obj.name)
            return (type(obj), repr(obj))
        if isinstance(obj, (torch.dtype, torch.device, torch.layout, torch.memory_format, torch.Size)):
            return (type(obj), str(obj))
        if isinstance(obj, enum.Enum):
            return (type(obj), obj.name)
        if isinstance(obj, type) and _is_library(obj):
            return ("type", obj)
        oid = id(obj)
        if oid in self.memo:
            return ("ref", self.memo[oid])
        if depth > 64:
            raise Uncacheable(f"an object graph deeper than 64 ({type(obj).__name__})")
        self.memo[oid] = len(self.memo)
        self.keep.append(obj)
        if isinstance(obj, torch.Tensor):
            name = self.state_names.get(oid)
            if name is not None:
                return ("state", name, _tensor_meta(obj))
            if obj.numel() > _TENSOR_ATTR_LIMIT or obj.layout != torch.strided or obj.is_meta:
                raise Uncacheable(f"a tensor attribute of {obj.numel()} elements")
            data = obj.detach().cpu().contiguous()
            return ("tensor", _tensor_meta(obj), hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).hexdigest())
        if isinstance(obj, torch.nn.Module) and oid in self.module_paths:
            return ("module", self.module_paths[oid])
        if isinstance(obj, type):
            # A method replaced on the class (Block.forward = f) keeps the class object: describe its namespace.
            own = tuple((k, self(v, depth + 1)) for k, v in vars(obj).items()
                        if isinstance(v, (types.FunctionType, staticmethod, classmethod, property)))
            return ("type", obj, tuple(self(b, depth + 1) for b in obj.__bases__), own)
        if isinstance(obj, (staticmethod, classmethod)):
            return (type(obj), self(obj.__func__, depth + 1))
        if isinstance(obj, property):
            return ("property", self(obj.fget, depth + 1), self(obj.fset, depth + 1), self(obj.fdel, depth + 1))
        if isinstance(obj, (list, tuple, collections.deque, dict, set, frozenset)) and len(obj) > _CONTAINER_LIMIT:
            raise Uncacheable(f"a {type(obj).__name__} of {len(obj)} entries")
        if isinstance(obj, (list, tuple, collections.deque)):
            return (type(obj), tuple(self(x, depth + 1) for x in obj))
        if isinstance(obj, types.MappingProxyType):
            return ("mappingproxy", self(dict(obj), depth + 1))
        if isinstance(obj, dict):
            return (type(obj), tuple((self(k, depth + 1), self(v, depth + 1)) for k, v in obj.items()))
        if isinstance(obj, (set, frozenset)):
            items = [self(x, depth + 1) for x in obj]
            return (type(obj), tuple(sorted(items, key=repr)))
        if isinstance(obj, types.FunctionType):
            if _is_library(obj):
                return ("builtin", obj)
            cells = tuple(self(c.cell_contents, depth + 1) if _filled(c) else ("empty",) for c in obj.__closure__ or ())
            env = obj.__globals__
            reads = tuple((n, self(env[n], depth + 1)) for n in _global_names(obj.__code__) if n in env)
            return ("function", obj.__code__, self(obj.__defaults__, depth + 1), self(obj.__kwdefaults__, depth + 1),
                    cells, self(getattr(obj, "__dict__", None), depth + 1), reads)
        if isinstance(obj, types.MethodType):
            return ("method", self(obj.__func__, depth + 1), self(obj.__self__, depth + 1))
        if isinstance(obj, functools.partial):
            return ("partial", self(obj.func, depth + 1), self(obj.args, depth + 1), self(obj.keywords, depth + 1))
        if isinstance(obj, weakref.ReferenceType):
            return ("weakref", self(obj(), depth + 1))
        if isinstance(obj, (types.BuiltinFunctionType, types.MethodWrapperType, types.WrapperDescriptorType,
                            types.MethodDescriptorType, torch._ops.OpOverload, torch._ops.OpOverloadPacket,
                            types.ModuleType)):
            self.keep.append(obj)
            return ("builtin", obj)
        # A module outside the tree (TransformerLens 4 keeps the wrapped model as a plain attribute) is
        # described like any object: its submodules and parameters mostly are the tree's own.
        if isinstance(obj, (logging.Logger, logging.LoggerAdapter)):
            return ("logger", obj.name if isinstance(obj, logging.Logger) else id(obj))
        state = getattr(obj, "__dict__", None)
        slots = [s for c in type(obj).__mro__ for s in getattr(c, "__slots__", ()) if s not in ("__dict__", "__weakref__")]
        if state is None and not slots and type(obj).__hash__ is not None:
            # An object with no Python state (a C object: a compiled regex, a lock): by value where it
            # compares by value (re.Pattern), else by identity; the key holds it.
            return ("library", type(obj), obj)
        if state is None and not slots:
            raise Uncacheable(f"an object of type {type(obj).__module__}.{type(obj).__qualname__}")
        if dataclasses.is_dataclass(obj) or state is not None or slots:
            return ("object", type(obj), self(dict(state) if state is not None else None, depth + 1),
                    tuple((s, self(getattr(obj, s, None), depth + 1)) for s in slots))
        raise Uncacheable(type(obj).__qualname__)


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018
        return True
    except ValueError:
        return False


_SKIP = {"_parameters", "_buffers", "_modules"}


def fingerprint(module: torch.nn.Module, args: tuple, kwargs: dict, options: tuple):
    """The cache key of a build, or raises ``Uncacheable``."""
    named = list(torch.nn.Module.named_modules(module, remove_duplicate=False))
    module_paths: dict[int, str] = {}
    for path, m in named:
        module_paths.setdefault(id(m), path)
    state_names: dict[int, str] = {}
    for path, m in named:
        for kind in ("_parameters", "_buffers"):
            for k, t in vars(m)[kind].items():
                if t is not None:
                    state_names.setdefault(id(t), f"{path}.{k}" if path else k)
    walk = _Walker(state_names, module_paths)
    # The walk builds tens of thousands of small tuples: the cyclic GC would scan them again and again.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _fingerprint(walk, module, named, module_paths, args, kwargs, options)
    finally:
        if gc_was_enabled:
            gc.enable()


def _fingerprint(walk, module, named, module_paths, args, kwargs, options):
    from . import __version__

    modules = []
    for path, m in named:
        own = vars(m)
        params = tuple((k, None if t is None else walk(t)) for k, t in own["_parameters"].items())
        buffers = tuple((k, None if t is None else walk(t)) for k, t in own["_buffers"].items())
        children = tuple((k, None if c is None else module_paths[id(c)]) for k, c in own["_modules"].items())
        rest = walk({k: v for k, v in own.items() if k not in _SKIP})
        modules.append((path, walk(type(m)), params, buffers, children, rest))
    flat, spec = pytree.tree_flatten((tuple(args), dict(kwargs or {})))
    inputs = tuple(_tensor_meta(x) if isinstance(x, torch.Tensor) else walk(x) for x in flat)
    from torch.nn.modules import module as nn_module

    global_hooks = walk([getattr(nn_module, h, None) for h in sorted(dir(nn_module)) if h.startswith("_global_")
                         and h.endswith("hooks")])
    flags = (torch.__version__, __version__, torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
             torch.is_autocast_enabled(), torch.get_default_dtype())
    return (flags, options, str(spec), inputs, tuple(modules), global_hooks)
