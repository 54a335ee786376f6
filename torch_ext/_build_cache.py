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
- nn.Module's global hooks, grad mode, inference mode, autocast (per device type, with its dtype) and the default dtype.

An object it cannot describe (an unhashable C extension object, a tensor over 64 Ki elements held as an
attribute) makes the module uncacheable: it is built, not cached.

Code is in the key with what it reads: a class of the tree by its bases and the functions, static and
class methods and properties of its own namespace (so a method replaced on the class misses); a function
by its code object, defaults, closure and every global its code names (so a module-level helper or
constant reassigned between builds misses); a Python module of the user's code that it names (``import config``,
then ``config.SCALE``) by the module's attributes that the code names, walked as values (so ``config.SCALE = 3.0``
misses). Classes and functions of installed packages (the standard
library, torch, transformers, transformer_lens: anything under site-packages) are taken by identity:
patching a library between builds is not detected (turn the cache off with ``TORCH_EXT_BUILD_CACHE=0``
or ``ReactiveGraph(..., cache=False)``). torch_ext installed in development mode counts as user code.

``fingerprint(..., portable=True)`` is the same walk made process-independent, for the on-disk cache
(``torch_ext._disk_cache``): a hex digest over values only. Classes, functions and modules of installed
packages are named (module and qualified name) and their package identified by its version and the size
and modification time of the files that define them (``_origin``); one not reachable by its name (made
in a function) is described as user code is. Code objects are described by their fields (bytecode,
constants, names, line table). C objects with no Python state are refused, except regular expressions
(by pattern) and locks (by type), since their identity means nothing in another process. The digest
also covers Python's, torch's and torch_ext's identity (torch_ext by the contents of its Python sources
and its compiled libraries' size and modification time).
"""
from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import gc
import hashlib
import io
import logging
import re
import os
import pickle
import sys
import sysconfig
import threading
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
_PRIMITIVE_NAMES = {t: t.__name__ for t in (type(None), bool, int, float, complex, str, bytes, tuple, list, dict, set,
                                            frozenset)}
_CONTAINER_LIMIT = 1 << 16


@functools.lru_cache(maxsize=None)
def _installed() -> tuple:
    """The folders of Python's standard library and installed packages (read on first use: sysconfig is slow)."""
    return tuple(sorted({p for p in (sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib"))
                         if p}))


@functools.lru_cache(maxsize=None)
def _is_installed_module(name: str) -> bool:
    """The module comes with Python or from an installed package (site-packages), not the user's code."""
    root = name.partition(".")[0]
    if root in sys.stdlib_module_names or root in sys.builtin_module_names:
        return True
    module = sys.modules.get(name) or sys.modules.get(root)
    path = getattr(module, "__file__", None)
    return path is not None and os.path.abspath(path).startswith(_installed())


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


def _importable(obj) -> bool:
    """``obj`` is what its module and qualified name lead to (so a name designates it in any process)."""
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    qualname = getattr(obj, "__qualname__", None)
    if module is None or not isinstance(qualname, str) or "<" in qualname:
        return False
    target = module
    for part in qualname.split("."):
        target = getattr(target, part, _MISSING)
        if target is _MISSING:
            return False
    return target is obj


_MISSING = object()


@functools.lru_cache(maxsize=None)
def _stat(path: str) -> tuple:
    try:
        st = os.stat(path)
    except OSError:
        return (path, None)
    return (path, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=None)
def _origin(name: str) -> tuple:
    """What identifies the code of module ``name`` across processes: the file defining it (size and
    modification time) and its top-level package's version and folder (a reinstall rewrites both)."""
    root = name.partition(".")[0]
    if root in sys.builtin_module_names:
        return ("builtin",)
    module, top = sys.modules.get(name), sys.modules.get(root)
    file = getattr(module, "__file__", None)
    version = getattr(top, "__version__", None)
    top_file = getattr(top, "__file__", None)
    origin = (_stat(os.path.abspath(file)) if isinstance(file, str) else None,
              str(version) if isinstance(version, str) else None,
              _stat(os.path.dirname(os.path.abspath(top_file))) if isinstance(top_file, str) else None)
    return ("origin", hashlib.sha256(repr(origin).encode()).hexdigest()[:32])


@functools.lru_cache(maxsize=None)
def _portable_type(t: type) -> tuple | str:
    name = _PRIMITIVE_NAMES.get(t)
    return name if name is not None else ("cls", t.__module__, t.__qualname__, _origin(t.__module__))


def _const(c):
    """A code object's constant, portably (frozensets sorted: their order depends on the hash seed)."""
    if isinstance(c, types.CodeType):
        return _code_digest(c)
    if isinstance(c, tuple):
        return ("tuple", tuple(_const(x) for x in c))
    if isinstance(c, frozenset):
        return ("frozenset", tuple(sorted((_const(x) for x in c), key=repr)))
    return (type(c).__name__, repr(c))


@functools.lru_cache(maxsize=None)
def _code_digest(co: types.CodeType) -> str:
    """A code object by the fields code equality compares (bytecode, constants, names, line table)."""
    parts = (co.co_name, getattr(co, "co_qualname", co.co_name), co.co_argcount, co.co_posonlyargcount,
             co.co_kwonlyargcount, co.co_flags, co.co_firstlineno, co.co_code, co.co_linetable if
             hasattr(co, "co_linetable") else co.co_lnotab, getattr(co, "co_exceptiontable", b""), co.co_names,
             co.co_varnames, co.co_freevars, co.co_cellvars, tuple(_const(c) for c in co.co_consts))
    return "code:" + hashlib.sha256(repr(parts).encode()).hexdigest()


def _sources_digest(folder: str) -> str:
    h = hashlib.sha256()
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for f in sorted(files):
            path = os.path.join(root, f)
            if f.endswith(".py"):
                with open(path, "rb") as fh:
                    h.update(path.encode() + b"\0" + fh.read() + b"\0")
            elif f.endswith(".so"):
                h.update(repr(_stat(path)).encode())
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def environment() -> tuple:
    """Python, torch and torch_ext, as a portable key sees them (computed once per process)."""
    from . import __version__

    torch_c = getattr(torch._C, "__file__", None)
    return (sys.version, sys.implementation.cache_tag, sys.platform, str(torch.__version__),
            getattr(torch.version, "git_version", None), _stat(os.path.abspath(torch.__file__)),
            _stat(torch_c) if torch_c else None, __version__, _sources_digest(os.path.dirname(os.path.abspath(__file__))))


_CLASS_SKIP = frozenset({"__dict__", "__weakref__", "__doc__", "__module__", "__qualname__", "__firstlineno__",
                         "__static_attributes__", "_abc_impl", "__annotations__", "__annotate__", "__orig_bases__",
                         "__parameters__"})
_LOCK_TYPES = tuple({type(threading.Lock()), type(threading.RLock())})


class _Walker:
    """Describes Python objects as hashable tuples (see the module docstring). ``portable``: as values
    only (names, digests), for a key that means the same in another process."""

    def __init__(self, state_names: dict, module_paths: dict, portable: bool = False):
        self.state_names = state_names  # id(tensor) -> name of a parameter/buffer of the tree
        self.module_paths = module_paths  # id(module) -> path in the tree
        self.portable = portable
        self.memo: dict[int, object] = {}
        self.keep: list = []  # objects whose ids are memo keys stay alive during the walk
        # Per walk (tens of thousands of visits, a few dozen types): each type's description, and
        # whether a class is a library one described by name.
        self._tys: dict[type, object] = {}
        self._library: dict[type, bool] = {}
        self._prim = {t: self.ty(t) for t in _PRIMITIVE}

    def ty(self, t: type):
        """A type as the key holds it: itself, or (portable) its module, name and origin."""
        r = self._tys.get(t)
        if r is None:
            r = self._tys[t] = t if not self.portable else _portable_type(t)
        return r

    def meta(self, t: torch.Tensor) -> tuple:
        m = _tensor_meta(t)
        return m if not self.portable else (self.ty(m[0]), m[1], m[2], str(m[3]), m[4], m[5], str(m[6]))

    def code(self, co: types.CodeType):
        return co if not self.portable else _code_digest(co)

    def __call__(self, obj, depth: int = 0):
        t = type(obj)
        prim = self._prim.get(t)
        if prim is not None:
            # Typed, so that 1, 1.0 and True differ; floats by repr, so that -0.0 and 0.0 differ.
            return (prim, repr(obj) if t is float or t is complex else obj)
        if t is dict and all(type(k) is str for k in obj) and all(type(v) in _PRIMITIVE for v in obj.values()):
            # A dict of plain values (hook alias tables, configs): described without a call per entry.
            return (self.ty(dict), tuple((k, self._prim[type(v)], repr(v) if type(v) in (float, complex) else v)
                                         for k, v in obj.items()))
        if isinstance(obj, (bool, int, float, complex, str, bytes)):  # subclasses (enum.IntEnum handled below)
            if isinstance(obj, enum.Enum):
                return (self.ty(type(obj)), obj.name)
            return (self.ty(type(obj)), repr(obj))
        if isinstance(obj, (torch.dtype, torch.device, torch.layout, torch.memory_format, torch.Size)):
            return (self.ty(type(obj)), str(obj))
        if isinstance(obj, enum.Enum):
            return (self.ty(type(obj)), obj.name)
        if isinstance(obj, type):
            library = self._library.get(obj)
            if library is None:
                library = self._library[obj] = _is_library(obj) and (not self.portable or _importable(obj))
            if library:
                return ("type", self.ty(obj))
        oid = id(obj)
        if oid in self.memo:
            return ("ref", self.memo[oid])
        if depth > 64:
            raise Uncacheable(f"an object graph deeper than 64 ({type(obj).__name__})")
        self.memo[oid] = len(self.memo)
        self.keep.append(obj)
        if t is dict or t is collections.OrderedDict:  # the common case (a module's hook tables), first
            if len(obj) > _CONTAINER_LIMIT:
                raise Uncacheable(f"a {t.__name__} of {len(obj)} entries")
            return (self.ty(t), tuple((self(k, depth + 1), self(v, depth + 1)) for k, v in obj.items()))
        if isinstance(obj, torch.Tensor):
            name = self.state_names.get(oid)
            if name is not None:
                return ("state", name, self.meta(obj))
            if obj.numel() > _TENSOR_ATTR_LIMIT or obj.layout != torch.strided or obj.is_meta:
                raise Uncacheable(f"a tensor attribute of {obj.numel()} elements")
            data = obj.detach().cpu().contiguous().reshape(-1)  # a 0-dim tensor cannot be viewed as bytes
            return ("tensor", self.meta(obj), hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).hexdigest())
        if isinstance(obj, torch.nn.Module) and oid in self.module_paths:
            return ("module", self.module_paths[oid])
        if isinstance(obj, type):
            # A method replaced on the class (Block.forward = f) keeps the class object: describe its
            # namespace, class-level data (Block.scale = 2.0) included.
            own = tuple((k, self(v, depth + 1)) for k, v in vars(obj).items() if k not in _CLASS_SKIP)
            return ("type", self.ty(obj), tuple(self(b, depth + 1) for b in obj.__bases__), own)
        if isinstance(obj, (staticmethod, classmethod)):
            return (self.ty(type(obj)), self(obj.__func__, depth + 1))
        if isinstance(obj, property):
            return ("property", self(obj.fget, depth + 1), self(obj.fset, depth + 1), self(obj.fdel, depth + 1))
        if isinstance(obj, (list, tuple, collections.deque, dict, set, frozenset)) and len(obj) > _CONTAINER_LIMIT:
            raise Uncacheable(f"a {type(obj).__name__} of {len(obj)} entries")
        if isinstance(obj, _IdKeyed):
            return ("id-keyed", tuple(sorted((self(v, depth + 1) for v in obj.values), key=repr)))
        if isinstance(obj, (list, tuple, collections.deque)):
            return (self.ty(type(obj)), tuple(self(x, depth + 1) for x in obj))
        if isinstance(obj, types.MappingProxyType):
            return ("mappingproxy", self(dict(obj), depth + 1))
        if isinstance(obj, dict):
            return (self.ty(type(obj)), tuple((self(k, depth + 1), self(v, depth + 1)) for k, v in obj.items()))
        if isinstance(obj, (set, frozenset)):
            items = [self(x, depth + 1) for x in obj]
            return (self.ty(type(obj)), tuple(sorted(items, key=repr)))
        if isinstance(obj, types.FunctionType):
            if _is_library(obj):
                if not self.portable:
                    return ("builtin", obj)
                if _importable(obj):
                    return ("function", obj.__module__, obj.__qualname__, _origin(obj.__module__))
                # A library function made in a function (a closure): described as user code is.
            cells = tuple(self(c.cell_contents, depth + 1) if _filled(c) else ("empty",) for c in obj.__closure__ or ())
            env = obj.__globals__
            names = _global_names(obj.__code__)
            reads = tuple((n, self._read(env[n], names, depth + 1)) for n in names if n in env)
            return ("function", self.code(obj.__code__), self(obj.__defaults__, depth + 1),
                    self(obj.__kwdefaults__, depth + 1), cells, self(getattr(obj, "__dict__", None), depth + 1), reads)
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
            return ("builtin", obj) if not self.portable else self._portable_builtin(obj, depth)
        # A module outside the tree (TransformerLens 4 keeps the wrapped model as a plain attribute) is
        # described like any object: its submodules and parameters mostly are the tree's own.
        if isinstance(obj, (logging.Logger, logging.LoggerAdapter)):
            return ("logger", obj.name if isinstance(obj, logging.Logger) else id(obj))
        state = getattr(obj, "__dict__", None)
        slots = [s for c in type(obj).__mro__ for s in getattr(c, "__slots__", ()) if s not in ("__dict__", "__weakref__")]
        if state is None and not slots and type(obj).__hash__ is not None:
            # An object with no Python state (a C object: a compiled regex, a lock): by value where it
            # compares by value (re.Pattern), else by identity; the key holds it.
            if not self.portable:
                return ("library", type(obj), obj)
            if isinstance(obj, re.Pattern):
                return ("regex", self.ty(type(obj.pattern)), obj.pattern, obj.flags)
            if isinstance(obj, _LOCK_TYPES):
                return ("lock", self.ty(type(obj)))
            raise Uncacheable(f"an object of type {type(obj).__module__}.{type(obj).__qualname__} (no Python state; "
                              "its identity means nothing in another process)")
        if state is None and not slots:
            raise Uncacheable(f"an object of type {type(obj).__module__}.{type(obj).__qualname__}")
        if self.portable and state is not None:
            state = _without_ids(type(obj), state)
        return ("object", self(type(obj), depth + 1), self(dict(state) if state is not None else None, depth + 1),
                tuple((s, self(getattr(obj, s, None), depth + 1)) for s in slots))

    def _read(self, obj, names: tuple, depth: int):
        """A global a function reads. A Python module of the user's code (``import config`` then
        ``config.SCALE`` in forward) is described with its attributes that the code names (``co_names``
        holds attribute names too), walked as values, and so on through its user submodules: by identity
        alone, ``config.SCALE = 3.0`` (or ``config.cfg.shift = 1.0``) between two builds reused the
        first graph, which computes with the old value. Modules of installed packages stay by identity."""
        if not isinstance(obj, types.ModuleType) or _is_installed_module(obj.__name__):
            return self(obj, depth)
        if depth > 64:
            raise Uncacheable(f"an object graph deeper than 64 (module {obj.__name__})")
        env = vars(obj)
        attrs = []
        for n in names:
            if n in env:
                v = env[n]
                if isinstance(v, types.ModuleType) and v is not obj and not _is_installed_module(v.__name__):
                    key = ("module-read", id(v), names)
                    if key in self.memo:  # an import cycle between user modules, or a second path to one
                        attrs.append((n, ("ref", self.memo[key])))
                        continue
                    self.memo[key] = len(self.memo)
                    self.keep.append(v)
                    attrs.append((n, self._read(v, names, depth + 1)))
                elif v is not obj:
                    attrs.append((n, self(v, depth + 1)))
        return ("user-module", self(obj, depth), tuple(attrs))

    def _portable_builtin(self, obj, depth: int):
        """A C function, slot wrapper, operator or Python module by name (a bound one with its receiver)."""
        if isinstance(obj, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            return ("op", type(obj).__name__, str(obj))
        if isinstance(obj, types.ModuleType):
            return ("pymodule", obj.__name__, _origin(obj.__name__))
        if isinstance(obj, (types.WrapperDescriptorType, types.MethodDescriptorType)):
            return ("descriptor", self(obj.__objclass__, depth + 1), obj.__name__)
        receiver = getattr(obj, "__self__", None)
        if receiver is None or isinstance(receiver, types.ModuleType):
            module = getattr(obj, "__module__", None) or getattr(receiver, "__name__", None)
            return ("cfunction", module, obj.__qualname__, _origin(module) if module else None)
        return ("bound", type(obj).__name__, obj.__name__, self(receiver, depth + 1))


class _IdKeyed:
    """The values of a dict keyed by id() of objects of earlier runs (see _compat.ID_KEYED_STATE)."""

    def __init__(self, values: list):
        self.values = values


def _without_ids(cls: type, state: dict) -> dict:
    """``state`` with the id-keyed dicts of ``cls`` (_compat.ID_KEYED_STATE) reduced to their values: ids of
    tensors from earlier runs differ per process, and a trace can only read them through an id collision,
    which no key could predict."""
    from ._compat import ID_KEYED_STATE

    names = ID_KEYED_STATE.get((cls.__module__, cls.__qualname__))
    if not names:
        return state
    out = dict(state)
    for name in names:
        if isinstance(out.get(name), dict):
            out[name] = _IdKeyed(list(out[name].values()))
    return out


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018
        return True
    except ValueError:
        return False


_SKIP = {"_parameters", "_buffers", "_modules"}


def fingerprint(module: torch.nn.Module, args: tuple, kwargs: dict, options: tuple, portable: bool = False):
    """The cache key of a build, or raises ``Uncacheable``. ``portable``: a hex digest that means the
    same in any process (see the module docstring). Taken under the trace patches' lock: a trace in another
    thread installs process-global things the walk reads (torch.export's global module hooks, holding fake
    tensors), so a walk during it read another thread's trace state (or failed on its fake tensors)."""
    from . import _trace_patches

    with _trace_patches.serialized():
        key = describe(module, args, kwargs, options, portable)
    if not portable:
        return key
    return hashlib.sha256(_portable_bytes(key)).hexdigest()


class _KeyPickler(pickle.Pickler):
    """Serialises a portable key: plain values only (None, bools, ints, floats, strings, bytes, tuples;
    anything else is refused, as a walker leak: a stricter net than looking for " at 0x" in its repr).
    No memo (``fast``): the bytes depend on the values alone, not on which of them share one object,
    so equal keys give equal bytes in every process. A tenth of the time of repr() on a 1.3 MB key."""

    def reducer_override(self, obj):
        raise Uncacheable(f"an object of type {type(obj).__module__}.{type(obj).__qualname__} in a portable key")


def _portable_bytes(key) -> bytes:
    buf = io.BytesIO()
    pickler = _KeyPickler(buf, protocol=4)
    pickler.fast = True
    pickler.dump(key)
    return buf.getvalue()


def describe(module: torch.nn.Module, args: tuple, kwargs: dict, options: tuple, portable: bool = False) -> tuple:
    """The key as a tuple (``fingerprint`` digests the portable one)."""
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
    walk = _Walker(state_names, module_paths, portable)
    # The walk builds tens of thousands of small tuples: the cyclic GC would scan them again and again.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _fingerprint(walk, module, named, module_paths, args, kwargs, options)
    finally:
        if gc_was_enabled:
            gc.enable()


_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "mtia", "maia", "privateuseone")


def _autocast_state() -> tuple:
    """Autocast per device type, with its dtype: ``torch.is_autocast_enabled()`` without a device reads
    CUDA's only, so a build under ``torch.autocast("cpu")`` keyed like a plain one."""
    state = []
    for device in _AUTOCAST_DEVICES:
        try:
            if torch.is_autocast_enabled(device):
                state.append((device, str(torch.get_autocast_dtype(device))))
        except RuntimeError:  # a device type this torch build does not know
            continue
    return tuple(state)


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
    inputs = tuple(walk.meta(x) if isinstance(x, torch.Tensor) else walk(x) for x in flat)
    from torch.nn.modules import module as nn_module

    global_hooks = walk([getattr(nn_module, h, None) for h in sorted(dir(nn_module)) if h.startswith("_global_")
                         and h.endswith("hooks")])
    flags = (str(torch.__version__), __version__, torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
             _autocast_state(), walk(torch.get_default_dtype()))
    if walk.portable:
        flags += (environment(),)
    return (flags, options, str(spec), inputs, tuple(modules), global_hooks)


_PORTABLE_LEAVES = frozenset({type(None), bool, int, float, complex, str, bytes})


def _check_portable(key) -> None:
    """A portable key holds values only: anything else would print its address (never hitting) or
    print ambiguously. A check of the walker, run by the tests on real models (too slow for every key)."""
    stack = [key]
    while stack:
        x = stack.pop()
        if type(x) is tuple:
            stack.extend(x)
        elif type(x) not in _PORTABLE_LEAVES:
            raise Uncacheable(f"an object of type {type(x).__qualname__} in a portable key")
