"""The Python values of a model's modules that tracing bakes into a program.

Tracing (torch.export, make_fx) reads every Python attribute a forward uses as a constant: the
training flag, a softmax temperature, ``Dropout.p``, ``BatchNorm.momentum``. Eager code sees a
later change at once; a program built earlier does not. ``attributes`` snapshots them at build and
``changed`` lists what differs now, so the pure step and the reactive graph refuse to compute with
values the model no longer has.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import itertools
import operator
import types
from typing import Callable, Sequence

import torch

from . import _C

# The training flag and every public attribute holding one of these.
_SCALARS = (bool, int, float, complex, str, type(None))
_MISSING = object()


def contents_digest(tensors: list) -> list:
    """A 64-bit digest (XXH3, in C++ at memory bandwidth, csrc/reactive/content_digest.h) of each tensor's
    bytes, every byte read (None where there are none to read: a meta or sparse tensor). What tells a
    write through ``.data`` or ``.numpy()``, which leaves the version counter as it was."""
    # The tensors go as they are: the C++ side reads a tensor on another device through a detached host copy.
    return _C.content_digests(tensors)


_CONTAINERS = (list, tuple, dict, set, frozenset)


def _plain(v, depth: int = 0) -> bool:
    """Scalars, and lists, tuples, dicts and sets of plain values (nested up to 8 deep): what is
    compared by value. A dict of options (``{"scale": 0.5}``) is read by forward like a scalar."""
    if isinstance(v, _SCALARS):
        return True
    if not isinstance(v, _CONTAINERS) or depth >= 8:
        return False
    if isinstance(v, dict):
        return all(_plain(k, depth + 1) and _plain(e, depth + 1) for k, e in v.items())
    return all(_plain(e, depth + 1) for e in v)


def _options_object(v) -> bool:
    """A configuration object a forward reads its options from (``self.config.xxx``): a Hugging Face
    ``PretrainedConfig``, a dataclass instance (TransformerLens's configs), or a namespace of options
    (``types.SimpleNamespace``, ``argparse.Namespace``: research code's ``self.args``)."""
    if isinstance(v, type) or isinstance(v, (torch.Tensor, torch.nn.Module)):
        return False
    return (dataclasses.is_dataclass(v) or isinstance(v, (types.SimpleNamespace, argparse.Namespace))
            or any(c.__name__ in ("PretrainedConfig", "PreTrainedConfig") for c in type(v).__mro__))


def _user_object(v) -> bool:
    """An instance of the user's own class (``self.opts = Options()``), which a forward reads like a namespace."""
    from ._build_cache import _is_library

    return (not isinstance(v, (type, torch.Tensor, torch.nn.Module)) and not callable(v)
            and isinstance(getattr(v, "__dict__", None), dict) and not _is_library(type(v))
            and _generator_state(v) is _MISSING)


# Private options a Hugging Face forward reads from its config (the attention function is looked up by it).
_CONFIG_PRIVATE = ("_attn_implementation_internal", "_experts_implementation_internal")


def _config_entries(label: str, obj, seen: set, out: list, depth: int = 0) -> None:
    """(label, dict, key, value copy) for every plain option of a configuration object, and of the
    configuration objects it holds (a text_config), each object once."""
    if id(obj) in seen or depth > 2:
        return
    seen.add(id(obj))
    d = getattr(obj, "__dict__", None)
    if not isinstance(d, dict):
        return
    for k, v in list(d.items()):
        if k.startswith("_") and k not in _CONFIG_PRIVATE:
            continue
        if isinstance(v, _SCALARS) or _plain(v):
            out.append((label, d, k, v if isinstance(v, _SCALARS) else copy.deepcopy(v)))
        elif _options_object(v):
            _config_entries(f"{label}.{k}", v, seen, out, depth + 1)


def attributes(model: torch.nn.Module) -> tuple:
    """A snapshot of what every module holds as plain attributes, as it stands: scalars and (nested)
    lists, tuples, dicts and sets of them by value; by identity, tensors (neither parameters nor buffers:
    the trace bakes them in as constants), functions and other callables held by the instance (a
    ``forward`` replaced on it, an activation function), submodules, and the parameter and buffer
    objects (not their values). ``(paths, dicts, keys, values, identity paths, dicts, keys, objects,
    paths and dicts of the modules without an instance forward)``."""
    paths, dicts, keys, values = [], [], [], []
    tpaths, tdicts, tkeys, tensors = [], [], [], []
    fpaths, fdicts = [], []
    configs, seen_configs = [], set()
    for path, mod in model.named_modules():
        d = mod.__dict__
        for k, v in d.items():
            if k != "training" and k.startswith("_"):
                continue
            if _options_object(v):
                # A config edited in place after the build (model.config._attn_implementation = "eager")
                # changes what an eager forward computes: its plain options are compared by value too.
                _config_entries(f"{path}.{k}" if path else k, v, seen_configs, configs)
            elif isinstance(v, _SCALARS) or _plain(v):
                paths.append(path)
                dicts.append(d)
                keys.append(k)
                values.append(v if isinstance(v, _SCALARS) else copy.deepcopy(v))  # a copy: it may be edited
            elif isinstance(v, torch.Tensor) or (callable(v) and not isinstance(v, type)):
                tpaths.append(path)
                tdicts.append(d)
                tkeys.append(k)
                tensors.append(v)
            elif isinstance(v, (list, dict)) and len(v) <= _GLOBAL_CONTAINER_LIMIT:
                # Tensors held in a list or dict attribute (self.anchors = [t0, t1], {"bias": t}): the trace
                # bakes each in as a constant, so one replaced after the build (model.anchors[0] = t) made eager
                # calls and the program differ, silently. By identity, as a tensor attribute.
                items = v.items() if isinstance(v, dict) else enumerate(v)
                held = [(i, t) for i, t in items if isinstance(t, torch.Tensor)]
                for i, t in held:
                    tpaths.append(f"item {'model.' + path if path else 'model'}.{k}")
                    tdicts.append(v if isinstance(v, dict) else _Items(v))
                    tkeys.append(i)
                    tensors.append(t)
        if "forward" not in d:  # a forward set on the instance after the build shadows the one traced
            fpaths.append(path)
            fdicts.append(d)
        # Submodules, parameters and buffers by identity: a submodule replaced after the build
        # (model.act = nn.Tanh()) is code the program never ran; a parameter or buffer replaced by a
        # new tensor (m.weight = nn.Parameter(w)) is not the one a ReactiveGraph reads or a step's
        # write_back writes (values changed in place are read as they are).
        if d.get("_modules") is not None:
            # Which submodules it has, by name: one added after the build (model.layers.append(block), a
            # ModuleDict entry) is code the program never ran, where a forward iterating them runs it.
            paths.append(path)
            dicts.append(d)
            keys.append("_modules")
            values.append(_Keys(d["_modules"]))
        for table in ("_modules", "_parameters", "_buffers"):
            sub = d.get(table)
            if sub:
                for k, v in sub.items():
                    tpaths.append(path)
                    tdicts.append(sub)
                    tkeys.append(k)
                    tensors.append(v)
    for label, d, k, v in configs:
        paths.append(label)
        dicts.append(d)
        keys.append(k)
        values.append(v)
    # A forward replaced on a class after the build (Block.forward = f) is code the program never ran:
    # per module class, the class that defines the forward it runs holds that function by identity, and
    # every class before it in the MRO must still not define one (else it shadows the traced one).
    seen = set()
    for mod in model.modules():
        cls = type(mod)
        if cls in seen:
            continue
        seen.add(cls)
        label = f"class {cls.__module__}.{cls.__qualname__}"
        for c in cls.__mro__:
            d = c.__dict__
            if "forward" in d:
                tpaths.append(label)
                tdicts.append(d)
                tkeys.append("forward")
                tensors.append(d["forward"])
                break
            fpaths.append(label)
            fdicts.append(d)
    return paths, dicts, keys, values, tpaths, tdicts, tkeys, tensors, fpaths, fdicts


_GLOBAL_CONTAINER_LIMIT = 10_000  # a larger global container is not copied nor compared at every read


@functools.lru_cache(maxsize=None)
def _stored_names(code: types.CodeType, opnames: tuple, nested: bool) -> frozenset:
    """The names the instructions ``opnames`` of a code object store or delete (and of the code nested in it, with
    ``nested``): what _stored_globals, _stored_attrs and _stored_cells read, one dis walk cached per code object."""
    import dis

    out = {i.argval for i in dis.get_instructions(code) if i.opname in opnames}
    if nested:
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                out |= _stored_names(const, opnames, True)
    return frozenset(out)  # cached: not to be changed by a caller


def _stored_globals(code: types.CodeType) -> frozenset:
    """Names a code object (and the code nested in it) assigns as globals (``global N; N += 1``): bookkeeping
    a forward keeps, not a constant of its trace."""
    return _stored_names(code, ("STORE_GLOBAL", "DELETE_GLOBAL"), True)


def _stored_attrs(code: types.CodeType) -> frozenset:
    """Attribute names a code object (and the code nested in it) assigns (``Stats.calls += 1``): bookkeeping on
    a class it reads as a namespace, not a constant of its trace."""
    return _stored_names(code, ("STORE_ATTR", "DELETE_ATTR"), True)


def _user_class_members(mod: torch.nn.Module, classes: set):
    """(class, name, member) for every class of ``mod``'s MRO that is the user's (not a library's) and not in
    ``classes`` yet (it is added): a staticmethod or classmethod as its function, a property as its getter."""
    from ._build_cache import _is_library

    for cls in type(mod).__mro__:
        if cls in classes or _is_library(cls):
            continue
        classes.add(cls)
        for k, v in vars(cls).items():
            if isinstance(v, (staticmethod, classmethod)):
                v = v.__func__
            elif isinstance(v, property):
                v = v.fget
            yield cls, k, v


def global_reads(model: torch.nn.Module, functions: Sequence[Callable] = ()) -> tuple:
    """A snapshot (the layout ``attributes`` returns) of the module-level values that the user's forward
    code reads: for every module class of the tree, the functions its own classes define (forward and the
    helpers it calls on self), the user's ``functions`` traced with it (a step's loss_fn), and the user
    functions and user modules (``config.SCALE``) they name, one level after another. Plain values (numbers, strings, small tuples and dicts of them) by value, functions
    by identity; lists and sets are left out (a log the forward appends to would refuse every later call). The trace holds each as a constant, so ``OFFSET = 1.5`` after the build made eager calls and
    the graph differ, silently. Code of installed packages (torch, transformers, TransformerLens) is not
    walked; names the code assigns (a call counter) are not checked."""
    from ._build_cache import _global_names, _is_installed_module, _is_library

    paths, dicts, keys, values = [], [], [], []
    tpaths, tdicts, tkeys, objs = [], [], [], []
    seen: set = set()
    taken: set = set()
    # User classes and objects the code reads as namespaces without naming them as globals: a class held as a
    # module attribute (self.K = K; self.K.s), in a list or dict attribute, as a class attribute (type(self).X.s),
    # or a default argument (def forward(self, x, cfg=CFG)). Their attributes are taken once every function is
    # walked, those some walked code names and none assigns (K.calls += 1 is bookkeeping).
    namespaces: list = []
    all_names: set = set()
    all_stored: set = set()

    def namespace(label: str, v) -> None:
        if isinstance(v, type):
            if not _is_library(v) and not issubclass(v, torch.nn.Module):
                namespaces.append((label, v))
        elif _user_object(v):
            namespaces.append((label, v))

    def take(label: str, d: dict, name: str, v, names: tuple, skip: set, depth: int, lists: bool = False,
             attrs_set: frozenset = frozenset()) -> None:
        if (id(d), name) in taken or name in skip or name.startswith("__"):
            return
        if isinstance(v, (list, set)) and not lists:
            return  # a list or set at module level is mostly a log the forward appends to, not a constant
        if isinstance(v, _SCALARS) or (isinstance(v, _CONTAINERS) and len(v) <= _GLOBAL_CONTAINER_LIMIT and _plain(v)):
            taken.add((id(d), name))
            paths.append(label)
            dicts.append(d)
            keys.append(name)
            values.append(v if isinstance(v, _SCALARS) else copy.deepcopy(v))
        elif isinstance(v, torch.Tensor):
            # A module-level tensor (MASK = torch.tril(...)) is a constant of the trace: one rebound after the
            # build (MASK = other) is not the one the program holds (writes into it are found by content).
            taken.add((id(d), name))
            tpaths.append(label)
            tdicts.append(d)
            tkeys.append(name)
            objs.append(v)
        elif isinstance(v, types.FunctionType) and not _is_library(v):
            taken.add((id(d), name))
            tpaths.append(label)
            tdicts.append(d)
            tkeys.append(name)
            objs.append(v)
            function(v, depth + 1)
        elif isinstance(v, type) and not _is_library(v) and depth < 4:
            # A user class read as a namespace (``Cfg.SCALE``): its attributes the code names, as a module's. Once
            # per class and set of names: a function naming the class but not the attribute (an __init__ storing
            # ``self.K = K``) walked first left ``K.s`` read by forward unchecked.
            if (id(v), names) in seen:
                return
            seen.add((id(v), names))
            for klass in v.__mro__:
                if klass is not object and not _is_library(klass):
                    cd = vars(klass)
                    for a in names:
                        if a in cd and a not in attrs_set:
                            take(f"global {klass.__module__}.{klass.__qualname__}", cd, a, cd[a], names, set(),
                                 depth + 1)
        elif isinstance(v, types.ModuleType) and not _is_installed_module(v.__name__) and depth < 4:
            if id(v) in seen:
                return
            seen.add(id(v))
            md = vars(v)
            for a in names:
                if a in md and md[a] is not v:
                    take(f"global {v.__name__}", md, a, md[a], names, set(), depth + 1)

    def function(fn, depth: int = 0) -> None:
        if id(fn) in seen or depth > 4 or not isinstance(fn, types.FunctionType) or _is_library(fn):
            return
        seen.add(id(fn))
        env = fn.__globals__
        names = _global_names(fn.__code__)
        skip = _stored_globals(fn.__code__)
        label = f"global {env.get('__name__', '?')}"
        attrs_set = _stored_attrs(fn.__code__)
        all_names.update(names)
        all_stored.update(attrs_set)
        defaults = list(fn.__defaults__ or ()) + list((fn.__kwdefaults__ or {}).values())
        for v in defaults:
            namespace(f"default of {fn.__module__}.{fn.__qualname__}:", v)
        for n in names:
            if n in env:
                take(label, env, n, env[n], names, skip, depth, attrs_set=attrs_set)
        if fn.__closure__:
            # A module class defined inside a factory (``def make(scale): class M: ... x * scale[0]``) reads its
            # knobs from the factory's closure: a list of numbers there is a knob (scale = [2.0]), not a log.
            cells = _Closure(fn)
            assigned = _assigned_cells(fn)
            for n in fn.__code__.co_freevars:
                v = cells.get(n, _MISSING)
                if v is not _MISSING and n not in assigned and not n.startswith("_"):
                    take(f"closure {fn.__qualname__}", cells, n, v, names, set(), depth, lists=True)

    classes = set()
    for mod in model.modules():
        f = mod.__dict__.get("forward")
        if isinstance(f, types.FunctionType):
            function(f)
        for k, v in mod.__dict__.items():
            if k.startswith("_"):
                continue
            if isinstance(v, types.FunctionType) and not _is_library(v):
                # A function it holds and calls (a grafted function block) is walked as forward is: a user class
                # or module it reads by its global name (Cfg.SCALE), a class or object given as its default
                # argument. Its closure and plain globals are callable_reads' too (_held_reads): their labels
                # ("fn model.act: 'k'") come first in the joined snapshot.
                function(v)
            if isinstance(v, type):  # an object held as an attribute (self.opts.scale) is _held_reads'
                namespace(f"attribute {type(mod).__qualname__}.{k}:", v)
            if isinstance(v, (list, tuple, dict)) and len(v) <= _GLOBAL_CONTAINER_LIMIT:
                for i, e in (v.items() if isinstance(v, dict) else enumerate(v)):
                    if isinstance(e, type):
                        namespace(f"attribute {type(mod).__qualname__}.{k}[{i!r}]:", e)
        for cls, k, v in _user_class_members(mod, classes):
            if isinstance(v, types.FunctionType):
                function(v)
            elif isinstance(v, type):
                namespace(f"class attribute {cls.__qualname__}.{k}:", v)
            elif not k.startswith("_") and (isinstance(v, _SCALARS) or _plain(v)):
                # A class-level knob (``SCALE = 2.0`` in the class body, read as self.SCALE): the trace
                # holds it as a constant, so ``Block.SCALE = 3.0`` after the build was unseen.
                take(f"class {cls.__module__}.{cls.__qualname__}", vars(cls), k, v, (), set(), 0, lists=True)
    for fn in functions:
        for kind, f in _callable_parts(fn):
            if kind == "function":
                function(f)
    read = tuple(sorted(all_names - all_stored))
    for label, v in namespaces:
        if (id(v), read) in seen:
            continue
        seen.add((id(v), read))
        if not isinstance(v, type):
            own = vars(v)
            for a in read:
                if a in own and not a.startswith("__"):
                    take(f"{label} {type(v).__qualname__} object", own, a, own[a], read, set(), 1,
                         attrs_set=frozenset(all_stored))
        for klass in (v if isinstance(v, type) else type(v)).__mro__:
            if klass is object or _is_library(klass):
                continue
            cd = vars(klass)
            for a in read:
                if a in cd:
                    take(f"{label} class {klass.__module__}.{klass.__qualname__}", cd, a, cd[a], read, set(), 1,
                         attrs_set=frozenset(all_stored))
    return joined(_held_reads(model), (paths, dicts, keys, values, tpaths, tdicts, tkeys, objs, [], []))


def _held_reads(model: torch.nn.Module) -> tuple:
    """A snapshot (the layout ``attributes`` returns) of what a forward reads through objects its modules hold:
    the plain options of an instance of the user's own class (``self.opts.scale``), and what a held function
    reads (a lambda's closure, a partial's arguments, a callable object's attributes: ``self.act = lambda t:
    t * k[0]`` bakes k[0] into the trace). Taken after the trace and compared at every call, not across the
    trace (these objects are not the module's own state)."""
    configs, seen, callables = [], set(), []
    for path, mod in model.named_modules():
        for k, v in mod.__dict__.items():
            if k.startswith("_"):
                continue
            if _user_object(v):
                _config_entries(f"{path}.{k}" if path else k, v, seen, configs)
            elif (callable(v) and not isinstance(v, (type, torch.Tensor, torch.nn.Module))
                  and not isinstance(getattr(v, "__self__", None), torch.nn.Module)):
                callables.append((f"fn {'model.' + path if path else 'model'}.{k}", v))
    held = ([label for label, _, _, _ in configs], [d for _, d, _, _ in configs], [k for _, _, k, _ in configs],
            [v for _, _, _, v in configs], [], [], [], [], [], [])
    return joined(held, callable_reads(callables))


def joined(*snapshots: tuple) -> tuple:
    """One snapshot (the layout ``attributes`` returns) holding every entry of ``snapshots``."""
    out = [[] for _ in range(10)]
    seen: set = set()
    for snap in snapshots:
        if not snap:
            continue
        for group in ((0, 1, 2, 3), (4, 5, 6, 7)):  # (paths, dicts, keys, values), the same by identity
            for entry in zip(*(snap[i] for i in group)):
                d, k = entry[1], entry[2]
                # One closure cell seen through two functions' views is one entry.
                slot = ("cell", id(d._cells[k])) if isinstance(d, _Closure) and k in d._cells else (id(d), k)
                if (group[0], slot) not in seen:
                    seen.add((group[0], slot))
                    for i, e in zip(group, entry):
                        out[i].append(e)
        for i in (8, 9):
            out[i] += list(snap[i])
    return tuple(out) if any(out) else ()


def changed(snapshot: tuple) -> list[tuple[str, str, object, object]]:
    """(module path, attribute, value in the snapshot, value now) for every attribute that changed."""
    if not snapshot:
        return []
    paths, dicts, keys, values, tpaths, tdicts, tkeys, tensors, fpaths, fdicts = snapshot
    try:  # the common case: two loops in C
        if list(map(operator.getitem, dicts, keys)) == values and all(
                map(operator.is_, map(operator.getitem, tdicts, tkeys), tensors)) and not any(
                map(operator.contains, fdicts, itertools.repeat("forward", len(fdicts)))):
            return []
    except KeyError:  # an attribute was deleted: the slow path names it
        pass
    out = []
    for path, d, k, was in zip(paths, dicts, keys, values):
        now = d.get(k, _MISSING)
        if isinstance(was, _Keys):
            if was != now:
                out.append((path, k, was, _Keys(now if isinstance(now, dict) else {})))
            continue
        if now is not was and not (type(now) is type(was) and now == was):
            out.append((path, k, was, now))
    for path, d, k, was in zip(tpaths, tdicts, tkeys, tensors):
        now = d.get(k)  # None: deleted
        if now is not was:
            out.append((path, k, _Short(was), _Short(now)))
    for path, d in zip(fpaths, fdicts):
        if "forward" in d:
            out.append((path, "forward", _Short(None), _Short(d["forward"])))
    return out


class _Short:
    """A tensor as a message shows it: its shape and its first values, not all of them."""

    def __init__(self, t):
        self.t = t

    def __repr__(self) -> str:
        if isinstance(self.t, torch.nn.Module):
            return f"a {type(self.t).__name__} module"
        if not isinstance(self.t, torch.Tensor):
            if self.t is None or self.t is _MISSING:
                return "(none)"
            text = repr(self.t)
            return text if len(text) <= 80 else text[:77] + "..."
        flat = self.t.detach().reshape(-1)[:4].tolist()
        return f"a tensor of shape {tuple(self.t.shape)} ({', '.join(f'{v:.4g}' for v in flat)}{', ...' if self.t.numel() > 4 else ''})"


class _Keys(_Short):
    """The names of a module's submodules: equal to a ``_modules`` dict holding the same names, in order."""

    def __init__(self, table: dict):
        super().__init__(None)
        self.names = tuple(table)

    def __eq__(self, other) -> bool:
        if isinstance(other, _Keys):
            return self.names == other.names
        return isinstance(other, dict) and tuple(other) == self.names

    __hash__ = None

    def __repr__(self) -> str:
        text = ", ".join(self.names[:8]) + (", ..." if len(self.names) > 8 else "")
        return f"submodules ({text})"


def traced_changes(model: torch.nn.Module, snapshot: tuple) -> list:
    """The scalar attributes a trace of ``model`` changed (a forward counting its calls), put back as
    they were; a tensor attribute a forward replaces (a cache) is not one of them."""
    out = [c for c in changed(snapshot) if not isinstance(c[2], _Short)]
    put(snapshot, out, new=False)
    return out


def put(snapshot: tuple, changes: list, *, new: bool) -> None:
    """Writes each of ``changes`` (from ``changed(snapshot)``) back where it was read: its new value, or
    the value it had when ``snapshot`` was taken."""
    paths, dicts, keys = snapshot[:3]
    where = {(path, key): d for path, d, key in zip(paths, dicts, keys)}
    for path, key, was, now in changes:
        where[(path, key)][key] = now if new else was  # the module's (or its config's) own __dict__, as setattr writes it


class _Items:
    """A list read as a mapping from index to item (``get``), for a snapshot of the tensors it holds."""

    def __init__(self, items: list):
        self._items = items

    def get(self, i: int, default=None):
        return self._items[i] if i < len(self._items) else default

    def __getitem__(self, i: int):
        if i >= len(self._items):
            raise KeyError(i)  # (the list shrank: the slow path of ``changed`` names it)
        return self._items[i]


def describe(path: str, key: str) -> str:
    """``model.<path>.<key>``, the attribute as the user reaches it (``<class>.forward`` for a class's)."""
    if path.startswith("item "):
        return f"{path[len('item '):]}[{key!r}]"
    if path.startswith("class "):
        return f"{path[len('class '):]}.{key} (on the class)"
    if path.startswith("global "):
        return f"{path[len('global '):]}.{key} (a module-level value the traced code reads)"
    if path.startswith("hook "):
        return f"{path[len('hook '):]}: {key!r}"
    if path.startswith("closure "):
        return f"{key!r} (a closure variable {path[len('closure '):]} reads)"
    if path.startswith("fn "):
        return f"{path[len('fn '):]}: {key!r}"
    return f"{'model.' + path if path else 'model'}.{key}"


def change_message(changes: list, built: str) -> str:
    """One sentence naming the first change (and how many more), for a refusal."""
    path, key, was, now = changes[0]
    more = f" (and {len(changes) - 1} more changed attributes)" if len(changes) > 1 else ""
    if isinstance(was, _Keys):
        return f"{'model.' + path if path else 'model'} has {now!r} now, {was!r} when {built}{more}"
    if isinstance(was, _Short):
        return f"{describe(path, key)} was replaced by {now!r} (when {built}: {was!r}){more}"
    mode = " (eval mode)" if key == "training" and now is False else " (train mode)" if key == "training" else ""
    # Which attributes the forward reads is not known here: every public one is checked. Bookkeeping
    # the forward never reads (a step counter kept on the model) can opt out by its name.
    hint = ("" if key == "training" or path.startswith("global ") else
            f" (if the hook's output never depends on {key!r}, keep it under a name starting with '_', which is not "
            "checked)" if path.startswith("hook ") else
            f" (if the result never depends on {key!r}, keep it under a name starting with '_', which is not "
            "checked)" if path.startswith(("fn ", "closure ")) else
            f" (if forward never reads {key!r}, keep it under a name starting with '_', which is not checked)")
    return f"{describe(path, key)} is {now!r}{mode} now, {was!r} when {built}{more}{hint}"


# ---- hooks

_MODULE_HOOKS = (("_forward_pre_hooks", "register_forward_pre_hook"), ("_forward_hooks", "register_forward_hook"),
                 ("_backward_pre_hooks", "register_full_backward_pre_hook"),
                 ("_backward_hooks", "register_full_backward_hook"))
_GLOBAL_HOOKS = (("_global_forward_pre_hooks", "register_module_forward_pre_hook"),
                 ("_global_forward_hooks", "register_module_forward_hook"),
                 ("_global_backward_pre_hooks", "register_module_full_backward_pre_hook"),
                 ("_global_backward_hooks", "register_module_full_backward_hook"))
_PARAM_HOOKS = (("_backward_hooks", "Tensor.register_hook"),
                ("_post_accumulate_grad_hooks", "Tensor.register_post_accumulate_grad_hook"))
_OPTIMIZER_HOOKS = (("_optimizer_step_pre_hooks", "register_step_pre_hook"),
                    ("_optimizer_step_post_hooks", "register_step_post_hook"))
_GLOBAL_OPTIMIZER_HOOKS = (("_global_optimizer_pre_hooks", "register_optimizer_step_pre_hook"),
                           ("_global_optimizer_post_hooks", "register_optimizer_step_post_hook"))


def _hook_dicts(model: torch.nn.Module, gradients: bool, optimizers) -> list:
    """(where, how it is registered, the hook dict) for every hook dict that changes what ``model``
    computes: its modules' and torch's global forward (pre-)hooks; with ``gradients`` also the backward
    ones and its parameters' gradient hooks; the ``optimizers``' step hooks and torch's global ones."""
    from torch.nn.modules import module as module_mod
    from torch.optim import optimizer as optim_mod

    out = []
    for name, m in model.named_modules():
        where = f"module '{name}' ({type(m).__name__})" if name else f"the model ({type(m).__name__})"
        for attr, how in _MODULE_HOOKS[:4 if gradients else 2]:
            d = m.__dict__.get(attr)
            if d is not None:
                out.append((where, how, d, m))
    for attr, how in _GLOBAL_HOOKS[:4 if gradients else 2]:
        d = getattr(module_mod, attr, None)
        if d is not None:
            out.append(("every module", how, d, None))
    if gradients:
        for name, p in model.named_parameters():
            for attr, how in _PARAM_HOOKS:
                d = getattr(p, attr, None)
                if d is not None:
                    out.append((f"parameter '{name}'", how, d, None))
    for opt in optimizers:
        for attr, how in _OPTIMIZER_HOOKS:
            d = getattr(opt, attr, None)
            if d is not None:
                out.append((f"optimizer {type(opt).__name__}", how, d, None))
    if optimizers:
        for attr, how in _GLOBAL_OPTIMIZER_HOOKS:
            d = getattr(optim_mod, attr, None)
            if d is not None:
                out.append(("every optimizer", how, d, None))
    return out


def _library_wiring(fn, owner) -> bool:
    """A hook a library installs on the model's own submodules at its first eager call, not the user's:
    TransformerLens's TransformerBridge (BlockBridge._maybe_wire_capture_hooks: it captures the pre-LN residual
    for the attention and routes the MLP input through hook_mlp_in, a HookPoint whose own hooks are checked;
    hooks on HookPoints, where TransformerLens registers the user's hooks through its own wrapper, are never
    this), and transformers 5's output_hidden_states / output_attentions recorders (output_capturing_hook,
    installed at the first call that asks for them: it returns nothing, only recording the output while that
    call's collector is active, so the call computes the same with it or without it)."""
    module = getattr(fn, "__module__", None) or ""
    if module.startswith("transformers.") and getattr(fn, "__name__", "") == "output_capturing_hook":
        return True
    return (module.startswith("transformer_lens.") and owner is not None
            and not any(c.__name__ == "HookPoint" for c in type(owner).__mro__))


def _hook_set(dicts: list) -> set:
    return {(where, how, key) for where, how, d, owner in dicts for key, fn in list(d.items())
            if not _library_wiring(fn, owner)}


def _next_hook_id() -> int:
    return torch.utils.hooks.RemovableHandle.next_id


class _Closure:
    """A function's closure cells as a live mapping from free-variable name to contents: read by the hook
    snapshot (an empty cell reads as missing), written back by TracedWrites."""

    def __init__(self, fn: types.FunctionType):
        self._cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))

    def __getitem__(self, name: str):
        try:
            return self._cells[name].cell_contents
        except ValueError:  # an empty cell
            raise KeyError(name) from None

    def get(self, name: str, default=None):
        try:
            return self[name]
        except KeyError:
            return default

    def items(self):
        return [(k, self.get(k, _MISSING)) for k in self._cells]

    def keys(self):
        return list(self._cells)

    def __setitem__(self, name: str, value) -> None:
        self._cells[name].cell_contents = value

    def __delitem__(self, name: str) -> None:
        del self._cells[name].cell_contents


def _hook_label(fn) -> str:
    from ._build_cache import _is_library

    if isinstance(fn, types.FunctionType) and _is_library(fn):  # a library's wrapper: the user's hook it holds
        for cell in fn.__closure__ or ():
            try:
                inner = cell.cell_contents
            except ValueError:
                continue
            if callable(inner) and not isinstance(inner, (type, torch.nn.Module)):
                return _hook_label(inner)
    inner = fn.func if isinstance(fn, functools.partial) else fn
    inner = getattr(inner, "__func__", inner)
    return getattr(inner, "__name__", None) or type(inner).__name__


def _callable_parts(fn, depth: int = 0):
    """The Python objects a callable keeps its state in, as ("partial", p), ("instance", obj) or
    ("function", f): a partial and then its function, a bound method's instance and then its function, a
    callable object and then its class's ``__call__``, and, inside a library's wrapper around the user's
    callable (TransformerLens's ``add_hook`` registers its own ``full_hook`` holding the user's hook in its
    closure), the user's callables it holds. The one walk behind every check of what a hook reads or writes."""
    from ._build_cache import _is_library

    if depth > 2:
        return
    if isinstance(fn, functools.partial):
        yield "partial", fn
        yield from _callable_parts(fn.func, depth + 1)
    elif isinstance(fn, types.MethodType):
        yield "instance", fn.__self__
        yield from _callable_parts(fn.__func__, depth + 1)
    elif isinstance(fn, types.FunctionType):
        if not _is_library(fn):
            yield "function", fn
            return
        for cell in fn.__closure__ or ():
            try:
                inner = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if callable(inner) and not isinstance(inner, (type, torch.nn.Module)):
                yield from _callable_parts(inner, depth + 1)
    elif callable(fn) and not isinstance(fn, type) and not _is_library(type(fn)):
        yield "instance", fn
        call = getattr(type(fn), "__call__", None)
        if isinstance(call, types.FunctionType):
            yield from _callable_parts(call, depth + 1)


def _hook_holders(fn) -> list:
    """(mapping, keys) a forward hook reads its Python values from: a function's closure and the module-level
    names its code reads, a hook object's (or a bound method's instance's) attributes, a partial's
    arguments (_callable_parts: also inside a library's wrapper). Each mapping is the live one (a later
    ``alpha = 3.0`` at module level is seen through it); ``keys``: those to read, in the mapping's order."""
    from ._build_cache import _global_names

    out = []
    for kind, obj in _callable_parts(fn):
        if kind == "partial":
            out.append(({"args": obj.args}, ("args",)))
            if obj.keywords:
                out.append((obj.keywords, tuple(obj.keywords)))
        elif kind == "instance":
            d = getattr(obj, "__dict__", None)
            if isinstance(d, dict):
                out.append((d, tuple(d)))
        else:
            if obj.__closure__:
                cells = _Closure(obj)
                out.append((cells, tuple(cells.keys())))
            names = set(_global_names(obj.__code__)) - _stored_globals(obj.__code__)
            env = obj.__globals__
            out.append((env, tuple(sorted(n for n in names if n in env and not n.startswith("__")
                                          and not isinstance(env[n], (types.ModuleType, type))))))
    return out


def _forward_hooks(dicts: list) -> list:
    """(label, hook) for every forward (pre-)hook of ``dicts`` (from _hook_dicts)."""
    return [(f"forward hook {_hook_label(fn)} on {where}", fn) for where, how, d, owner in dicts
            if "forward" in how for fn in list(d.values()) if not _library_wiring(fn, owner)]


def hook_reads(dicts: list) -> tuple:
    """A snapshot (the layout ``attributes`` returns) of the Python values the forward hooks of ``dicts``
    read (callable_reads). The trace bakes each in, so a hook's knob changed after the build
    (``steer.alpha = 3.0``) made eager calls and the program differ, silently."""
    return callable_reads([("hook " + label, fn) for label, fn in _forward_hooks(dicts)])


def callable_reads(pairs: list) -> tuple:
    """A snapshot (the layout ``attributes`` returns) of the Python values the callables of ``pairs``
    ((path, fn): forward hooks, a step's loss_fn) read through their closures, objects, partial arguments
    and module-level names (_hook_holders): plain values (numbers, strings, small containers of them:
    ``scale = [2.0]``) by value, tensors and callables by identity. Names starting with "_" and closure
    variables the function assigns are its bookkeeping, not checked."""
    paths, dicts_, keys, values = [], [], [], []
    tpaths, tdicts, tkeys, objs = [], [], [], []
    for label, fn in pairs:
        stored = set().union(*(_assigned_cells(f) for kind, f in _callable_parts(fn) if kind == "function"))
        for holder, names in _hook_holders(fn):
            for k in names:
                v = holder.get(k, _MISSING)
                if v is _MISSING or (isinstance(k, str) and k.startswith("_")) or k in stored:
                    continue  # bookkeeping: a name starting with "_", a closure variable the hook assigns
                if isinstance(v, _SCALARS) or (isinstance(v, _CONTAINERS) and len(v) <= _GLOBAL_CONTAINER_LIMIT
                                               and _plain(v)):
                    paths.append(label)
                    dicts_.append(holder)
                    keys.append(k)
                    values.append(v if isinstance(v, _SCALARS) else copy.deepcopy(v))
                elif isinstance(v, torch.Tensor) or (callable(v) and not isinstance(v, type)):
                    tpaths.append(label)
                    tdicts.append(holder)
                    tkeys.append(k)
                    objs.append(v)
    return paths, dicts_, keys, values, tpaths, tdicts, tkeys, objs, [], []


def _assigned_cells(fn) -> frozenset:
    """The closure variables a hook function assigns (``nonlocal calls; calls += 1``): its own bookkeeping."""
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    return frozenset() if code is None else _stored_cells(code)


def _stored_cells(code: types.CodeType) -> frozenset:
    """The closure variables ``code`` assigns or deletes (STORE_DEREF, DELETE_DEREF)."""
    return _stored_names(code, ("STORE_DEREF", "DELETE_DEREF"), False)


def _traced_tensor(v) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return isinstance(v, torch.Tensor) and (is_fake(v) or type(v).__name__ in ("FunctionalTensor", "Proxy"))


def stored_trace_tensors(dicts: list) -> list[tuple[str, str, torch.Tensor]]:
    """(hook label, name, tensor) for every tensor of a trace a forward hook of ``dicts`` kept in the Python
    state it reads (its closure, its attributes, a module-level dict or list, one level into containers):
    a hook that stores activations (``acts[name] = out``) ran only while traced."""
    out = []
    for label, fn in _forward_hooks(dicts):
        for holder, names in _hook_holders(fn):
            for k in names:
                v = holder.get(k)
                inner = (list(v.values()) if isinstance(v, dict) else list(v) if isinstance(v, (list, tuple))
                         else [v]) if isinstance(v, (dict, list, tuple, torch.Tensor)) else []
                if len(inner) <= _GLOBAL_CONTAINER_LIMIT:
                    hit = next((t for t in inner if _traced_tensor(t)), None)
                    if hit is not None:
                        out.append((label, k, hit))
    return out


class Hooks:
    """The hooks on a model (and its optimizers) when a program was traced from it, checked on every call.

    A program does not run hooks: forward hooks present at the trace are in it, and gradient and step
    hooks are refused at build. A hook registered after the build would run in eager code and not in
    the program, and one removed after it would still act in the program. Every hook torch registers
    takes its key from the global counter ``RemovableHandle.next_id``, so the common case costs one
    comparison: no hook was registered anywhere since the last check, and the (rare) dicts that held
    hooks at build still hold as many. Otherwise the hook dicts are listed again and compared."""

    def __init__(self, model: torch.nn.Module, *, gradients: bool = False, optimizers=()):
        """Taken right after the trace: a forward hook that stored a tensor of the trace is refused here."""
        self.model, self.gradients, self.optimizers = model, gradients, tuple(optimizers)
        dicts = _hook_dicts(model, gradients, self.optimizers)
        self.built = _hook_set(dicts)
        self.nonempty = [(d, len(d)) for _, _, d, _ in dicts if d]
        self.seen = _next_hook_id()
        stored = stored_trace_tensors(dicts)
        if stored:
            label, name, t = stored[0]
            raise ValueError(f"{label} stored a tensor of the trace in {name!r} ({type(t).__name__} of shape "
                             f"{tuple(t.shape)}): hooks run while the forward is traced, never when the program "
                             "runs, so it would hold that placeholder and no call's values; take activations from "
                             "the program's outputs instead (a loss_fn returning (loss, aux), or a ReactiveGraph's "
                             "run_with_cache / value), or remove the hook before building")
        self.reads = hook_reads(dicts) if self.nonempty else ()  # the values the traced hooks read

    def changed(self) -> tuple[list, list]:
        """(added, removed): (where, how) of the hooks registered or removed since the build."""
        if _next_hook_id() == self.seen and all(len(d) == n for d, n in self.nonempty):
            return [], []
        now = _hook_set(_hook_dicts(self.model, self.gradients, self.optimizers))
        added, removed = sorted(now - self.built), sorted(self.built - now)
        if not added and not removed:  # hooks registered elsewhere (another model, library wiring): fast path again
            self.seen = _next_hook_id()
            self.nonempty = [(d, len(d)) for d, _ in self.nonempty]
        return [(w, h) for w, h, _ in added], [(w, h) for w, h, _ in removed]

    def message(self, built: str) -> str | None:
        """A sentence naming the first added or removed hook, or None when the hooks are as at the build."""
        added, removed = self.changed()
        if not added and not removed:
            values = changed(self.reads)
            if values:
                return (f"{change_message(values, built)}; the program holds the value the hook read when traced, "
                        "eager code would use the new one")
            return None
        n = len(added) + len(removed)
        more = f" (and {n - 1} more hook changes)" if n > 1 else ""
        if added:
            where, how = added[0]
            return (f"{where} has a hook registered ({how}) after {built}{more}; eager code would run it, the "
                    "program (traced before it existed) never does")
        where, how = removed[0]
        return (f"a hook on {where} ({how}) was removed after {built}{more}; the program traced it and still "
                "applies it, eager code no longer does")


# ---- tensor state a traced forward writes (the pure step's joint trace and the inference trace alike)
class ForwardWrites:
    """The buffers and plain tensor attributes of ``model``'s modules as a traced forward starts; ``settle()``,
    called as it ends (inside the trace), carries or refuses what the forward did to them:

    - a buffer rebound (``self.prev = h.mean(0).detach()``, ``register_buffer`` again) is what eager's next
      call reads, but torch.export drops the rebinding (make_fx kept it on the traced copy): the program
      kept the old value forever. Rebound to the same shape and dtype it is written into the traced buffer
      instead, a buffer mutation like ``self.prev.copy_(...)``; to another shape or dtype it is refused.
    - a tensor attribute that is neither a parameter nor a buffer (``self.ema = torch.zeros(8)``) is a
      constant to torch.export, which drops an in-place write to it (``self.ema.mul_(0.5).add_(m)``):
      eager reads the updated value at the next call. Refused, naming it.

    ``keeps``: why a buffer must keep its shape and dtype, for the message (the step's state, the graph's)."""

    def __init__(self, model: torch.nn.Module, keeps: str):
        modules = list(torch.nn.Module.named_modules(model))
        self.keeps = keeps
        self.held = [(path, mod, key, b) for path, mod in modules for key, b in mod._buffers.items()]
        self.plain = [(path, key, t, t._version) for path, mod in modules for key, t in vars(mod).items()
                      if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter)]

    def settle(self) -> None:
        for path, mod, key, was in self.held:
            deleted = key not in mod._buffers
            now = mod._buffers.get(key)
            if now is was and not deleted:
                continue
            name = f"{path}.{key}" if path else key
            if was is None or not isinstance(now, torch.Tensor) or now.shape != was.shape or now.dtype != was.dtype:
                got = (f"a tensor of shape {tuple(now.shape)} and dtype {now.dtype}" if isinstance(now, torch.Tensor)
                       else "(deleted)" if deleted else repr(type(now).__name__))
                had = f"shape {tuple(was.shape)} and dtype {was.dtype}" if was is not None else "None"
                raise ValueError(f"forward rebinds buffer '{name}' ({had}) to {got}: {self.keeps} keeps each "
                                 "buffer's shape and dtype from one call to the next, so only a rebinding to the same "
                                 "shape and dtype can be carried (as an in-place write)")
            mod._buffers[key] = was
            with torch.no_grad():
                was.copy_(now)
        written = [f"{path}.{key}" if path else key for path, key, t, version in self.plain if t._version != version]
        if written:
            raise ValueError(f"forward writes in place into {', '.join(repr(w) for w in written)}, a tensor attribute "
                             "that is neither a parameter nor a buffer: torch.export treats it as a constant and drops "
                             "the write, where eager's next call reads the new value. Register it as a buffer "
                             "(self.register_buffer(name, tensor)) so that the write is carried")


def _generator_state(obj):
    """The state of a Python-level random generator object a forward may draw from (``random.Random``,
    numpy's ``Generator``, ``RandomState`` and bit generators), or _MISSING for anything else (and for
    ``random.SystemRandom``, which has no state: it reads the OS's entropy)."""
    import random

    if isinstance(obj, random.Random):
        if isinstance(obj, random.SystemRandom):
            return _MISSING
        return obj.getstate()
    np = __import__("sys").modules.get("numpy")
    if np is None:
        return _MISSING
    if isinstance(obj, np.random.Generator):
        return copy.deepcopy(obj.bit_generator.state)
    if isinstance(obj, np.random.RandomState):
        return copy.deepcopy(obj._bit_generator.state)
    if isinstance(obj, np.random.BitGenerator):
        return copy.deepcopy(obj.state)
    return _MISSING


def _same_state(a, b) -> bool:
    np = __import__("sys").modules.get("numpy")
    if np is not None and isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    return a == b


def _set_generator_state(obj, state) -> None:
    import random

    if isinstance(obj, random.Random):
        obj.setstate(state)
    elif hasattr(obj, "bit_generator"):
        obj.bit_generator.state = state
    elif hasattr(obj, "_bit_generator"):
        obj._bit_generator.state = state
    else:
        obj.state = state


class OwnGenerators:
    """The Python-level random generator objects of the user's own (``self.rng = np.random.default_rng()``,
    a ``random.Random(seed)`` held by a module, a list of them, a generator a forward or a loss function names
    as a global, or holds in a closure or default argument), with their states at construction.

    Tracing runs a draw from one once and bakes the numbers into the program, where eager draws anew at every
    call. Process-global generators (``random``'s, ``numpy.random``'s) are not these: they are seen by
    ``_compat.python_random_draws``. ``drawn()`` names those whose state the block since changed;
    ``restore()`` puts those states back (a refused build leaves the user's generators as it found them)."""

    def __init__(self, model: torch.nn.Module, functions=()):
        import random
        import sys

        from ._build_cache import _global_names, _is_library

        np = sys.modules.get("numpy")
        shared = {id(random._inst)}
        if np is not None and getattr(np.random.mtrand, "_rand", None) is not None:
            shared.add(id(np.random.mtrand._rand))
            shared.add(id(np.random.mtrand._rand._bit_generator))
        self._found: list[tuple[str, object, object]] = []
        seen_objs: set = set()
        seen_fns: set = set()

        def take(label: str, v, depth: int = 0) -> None:
            if id(v) in shared or id(v) in seen_objs:
                return
            state = _generator_state(v)
            if state is not _MISSING:
                seen_objs.add(id(v))
                self._found.append((f"{label} (a {type(v).__module__}.{type(v).__qualname__})", v, state))
                return
            if depth >= 2:
                return
            if isinstance(v, dict):
                for k, e in list(v.items())[:1000]:
                    take(f"{label}[{k!r}]", e, depth + 1)
            elif isinstance(v, (list, tuple)):
                for i, e in enumerate(v[:1000]):
                    take(f"{label}[{i}]", e, depth + 1)
            elif isinstance(v, functools.partial):
                for i, e in enumerate(v.args):
                    take(f"{label}.args[{i}]", e, depth + 1)
                for k, e in v.keywords.items():
                    take(f"{label}.keywords[{k!r}]", e, depth + 1)
            elif isinstance(v, types.MethodType):
                take(f"{label}.__self__", v.__self__, depth + 1)
                function(v.__func__, label)
            elif isinstance(v, types.FunctionType):
                function(v, label)

        def function(fn, label: str) -> None:
            if id(fn) in seen_fns or not isinstance(fn, types.FunctionType) or _is_library(fn):
                return
            seen_fns.add(id(fn))
            for i, d in enumerate(fn.__defaults__ or ()):
                take(f"{label} (default argument {i})", d, 1)
            for k, d in (fn.__kwdefaults__ or {}).items():
                take(f"{label} (default argument {k})", d, 1)
            for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
                try:
                    take(f"{label} (closure variable {name})", cell.cell_contents, 1)
                except ValueError:  # an empty cell
                    pass
            env = fn.__globals__
            for name in _global_names(fn.__code__):
                if name in env:
                    v = env[name]
                    if _generator_state(v) is not _MISSING or isinstance(v, types.FunctionType):
                        take(f"global {env.get('__name__', '?')}.{name}", v, 1)

        classes: set = set()
        for path, mod in model.named_modules():
            for k, v in mod.__dict__.items():
                if k in ("_parameters", "_buffers", "_modules") or isinstance(v, (torch.Tensor, torch.nn.Module)):
                    continue
                take(f"{path or 'model'}.{k}", v)
            for cls, k, v in _user_class_members(mod, classes):
                if isinstance(v, types.FunctionType):
                    function(v, f"{cls.__qualname__}.{k}")
                elif _generator_state(v) is not _MISSING:
                    take(f"{cls.__qualname__}.{k}", v)
        for i, fn in enumerate(functions):
            take(getattr(fn, "__qualname__", f"function {i}"), fn)

    def drawn(self) -> list[str]:
        """Labels of the generators whose state changed since construction."""
        return [label for label, obj, state in self._found if not _same_state(state, _generator_state(obj))]

    def restore(self) -> None:
        for _, obj, state in self._found:
            if not _same_state(state, _generator_state(obj)):
                _set_generator_state(obj, state)


# ---- Python state a user's forward writes on its own modules while traced (a lazy first-call path, a counter)
_OWN_MUTATORS = frozenset({"append", "extend", "add", "update", "insert", "appendleft", "discard", "remove", "pop",
                           "clear", "setdefault"})


@functools.lru_cache(maxsize=4096)
def _own_write_reads(code: types.CodeType) -> frozenset:
    """Offsets of the attribute loads of ``code`` whose value only feeds a write back to the same attribute:
    ``self.n += 1`` (COPY, LOAD_ATTR n, ..., STORE_ATTR n) and a mutator called on it (``self.log.append(v)``)."""
    import dis

    ins = list(dis.get_instructions(code))
    out = set()
    for i, op in enumerate(ins):
        if op.opname not in ("LOAD_ATTR", "LOAD_METHOD"):
            continue
        if i > 0 and ins[i - 1].opname == "COPY" and ins[i - 1].arg == 1:
            depth = next((j for j in range(i + 1, min(i + 64, len(ins))) if ins[j].opname == "STORE_ATTR"), None)
            if depth is not None and ins[depth].argval == op.argval and ins[depth - 1].opname == "SWAP":
                out.add(op.offset)
        elif i + 1 < len(ins) and ins[i + 1].opname == "LOAD_METHOD" and ins[i + 1].argval in _OWN_MUTATORS:
            out.add(op.offset)
    return frozenset(out)


_WILDCARD = "*"  # code that reads attributes by a computed name (getattr, hasattr, vars, __dict__)
_NOT_TRACED = frozenset({"__init__", "__repr__", "__str__", "extra_repr", "__setstate__", "__getstate__"})


@functools.lru_cache(maxsize=4096)
def _code_reads(code: types.CodeType) -> frozenset:
    """The attribute names ``code`` (and the code nested in it) reads other than to write them back (``self.n += 1``,
    ``self.log.append(v)``); ``_WILDCARD`` when it reads attributes by a computed name."""
    import dis

    own = _own_write_reads(code)
    out = set()
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and ins.offset not in own:
            out.add(_WILDCARD if ins.argval == "__dict__" else ins.argval)
        elif ins.opname in ("LOAD_GLOBAL", "LOAD_NAME") and ins.argval in ("getattr", "hasattr", "vars"):
            out.add(_WILDCARD)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out |= _code_reads(const)
    return frozenset(out)


def _function_codes(fn, depth: int = 0) -> list:
    if depth > 2:
        return []
    if isinstance(fn, functools.partial):
        return _function_codes(fn.func, depth + 1)
    if isinstance(fn, types.MethodType):
        return _function_codes(fn.__func__, depth + 1)
    if isinstance(fn, types.FunctionType):
        return [fn.__code__]
    call = getattr(type(fn), "__call__", None)
    return _function_codes(call, depth + 1) if isinstance(call, types.FunctionType) else []


def _state_reads(modules: list, functions: list) -> frozenset:
    """What the code that runs while a forward is traced may read of the user's modules, found in its bytecode (a
    tracer may run it by dynamo, torch.cond's branches, where no Python-level hook can watch it): every attribute
    name the user's module classes' functions (and the instance forwards, the hooks, a loss function) load."""
    from ._build_cache import _is_library

    out: set = set()
    seen: set = set()
    for mod in modules:
        f = mod.__dict__.get("forward")
        codes = _function_codes(f) if f is not None else []
        for cls in type(mod).__mro__:
            if cls in seen or _is_library(cls):
                continue
            seen.add(cls)
            for k, v in vars(cls).items():
                if k in _NOT_TRACED:
                    continue
                if isinstance(v, (staticmethod, classmethod)):
                    v = v.__func__
                if isinstance(v, property):
                    codes += [c for g in (v.fget, v.fset, v.fdel) if g is not None for c in _function_codes(g)]
                elif isinstance(v, types.FunctionType):
                    codes.append(v.__code__)
        for code in codes:
            out |= _code_reads(code)
    for fn in functions:
        for code in _function_codes(fn):
            out |= _code_reads(code)
    return frozenset(out)


_TORCH_MODULE_KEYS = frozenset(vars(torch.nn.Module()))


def _tensors_swapped(was, v) -> bool:
    """A container whose items differ only in tensors (the trace lifts the tensors a list or dict attribute
    holds, and puts them back): not state the forward wrote (a tensor of the trace stored is refused apart)."""
    if isinstance(was, set):
        return False
    items = list(v.items()) if isinstance(v, dict) else list(enumerate(v))
    return len(items) == len(was) and all(
        k == k2 and (e is e2 or (isinstance(e, torch.Tensor) and isinstance(e2, torch.Tensor)))
        and (inner is None or _same_contents(inner, e2) or _tensors_swapped(inner, e2))
        for (k, e, inner), (k2, e2) in zip(was, items))


def _state_value(v) -> bool:
    return not isinstance(v, (torch.Tensor, torch.nn.Module))


@dataclasses.dataclass
class StateWrite:
    """An attribute a user's forward wrote on its own module while traced: ``now`` is what the trace left."""
    where: str
    holder: dict
    key: str
    was: object
    now: object
    read: bool  # code that runs while traced reads it (other than to write it back): its path may depend on it
    contents: object = None  # a container's items before, when it was changed in place

    @property
    def snapshot_covers(self) -> bool:
        """A public attribute the module snapshot (``attributes``) compares by value."""
        return not self.key.startswith("_") and self.was is not _MISSING and self.contents is None and (
            isinstance(self.was, _SCALARS) or _plain(self.was))

    def put(self, new: bool) -> None:
        if self.contents is not None:
            if not new:
                _put_contents(self.was, self.contents)
            return
        v = self.now if new else self.was
        if v is _MISSING:
            self.holder.pop(self.key, None)
        else:
            self.holder[self.key] = v

    def describe(self) -> str:
        def show(v):
            return "(missing)" if v is _MISSING else repr(_Short(v))
        if self.contents is not None:
            return f"{self.where}.{self.key} (changed in place)"
        return f"{self.where}.{self.key} {show(self.was)} -> {show(self.now)}"


def read_back_message(writes: list, what: str) -> str:
    """The refusal for a forward that reads state it writes itself while traced (``TracedWrites.state_writes``)."""
    w = writes[0]
    more = f" (and {len(writes) - 1} more)" if len(writes) > 1 else ""
    return (f"forward writes {w.describe()}{more} while traced and reads it: eager's next call reads the value it "
            f"left and can take another path (a first-call branch, a counter a branch reads), {what} keeps the path "
            f"traced once. The build put the attribute back; keep such state in a buffer (register_buffer) or pass "
            f"it as an input (a value forward writes and never reads, a counter for logging, is accepted)")


# ---- Python state a trace writes (hooks' bookkeeping, activations stored by a hook or a forward)
def _live_holders(fn, label: str) -> list:
    """(label, mapping, names or None) where a hook (or a loss function) keeps Python state it can write: a
    function's closure cells and the module-level names its code reads or assigns, a hook object's (a bound
    method's instance's) attributes, a partial's arguments (_callable_parts: also inside a library's
    wrapper). ``names``: the keys to watch (None: all of them, new ones included). A module's own attributes
    are the module state's, not watched here."""
    from ._build_cache import _global_names

    out = []
    for kind, obj in _callable_parts(fn):
        if kind == "partial":
            out.append((label, dict(enumerate(obj.args)), None))  # not rebindable: watched for their contents
            if obj.keywords:
                out.append((label, obj.keywords, None))
        elif kind == "instance":
            d = getattr(obj, "__dict__", None)
            if isinstance(d, dict) and not isinstance(obj, torch.nn.Module):
                out.append((label, d, None))
        else:
            if obj.__closure__:
                out.append((label, _Closure(obj), tuple(obj.__code__.co_freevars)))
            names = set(_global_names(obj.__code__)) | _stored_globals(obj.__code__)
            env = obj.__globals__
            names = {n for n in names if not n.startswith("__")
                     and not isinstance(env.get(n), (types.ModuleType, type, types.FunctionType))}
            out.append((label, env, tuple(sorted(names))))
    return out


def _contents(v, depth: int = 0):
    """A copy of a mutable container's items, by identity, with the same of the containers it holds (two
    levels: ``ACTS["layer"]["out"] = out`` into a module-level dict of dicts), or None for anything else."""
    if depth > 2 or not isinstance(v, (list, dict, set)) or len(v) > _GLOBAL_CONTAINER_LIMIT:
        return None
    if isinstance(v, set):
        return set(v)
    items = list(v.items()) if isinstance(v, dict) else list(enumerate(v))
    return [(k, e, _contents(e, depth + 1)) for k, e in items]


def _same_contents(was, v) -> bool:
    if isinstance(was, set):
        return isinstance(v, set) and was == v
    items = list(v.items()) if isinstance(v, dict) else list(enumerate(v))
    return len(items) == len(was) and all(
        k == k2 and e is e2 and (inner is None or _same_contents(inner, e2))
        for (k, e, inner), (k2, e2) in zip(was, items))


def _put_contents(v, was) -> None:
    if isinstance(was, set):
        v.clear()
        v.update(was)
        return
    if isinstance(v, list):
        v[:] = [e for _, e, _ in was]
    else:
        v.clear()
        v.update((k, e) for k, e, _ in was)
    for _, e, inner in was:
        if inner is not None and not _same_contents(inner, e):
            _put_contents(e, inner)


def _holds_traced_tensor(v, depth: int = 0) -> torch.Tensor | None:
    if _traced_tensor(v):
        return v
    if depth >= 3 or not isinstance(v, (list, tuple, dict, set)) or len(v) > _GLOBAL_CONTAINER_LIMIT:
        return None
    for e in (v.values() if isinstance(v, dict) else v):
        hit = _holds_traced_tensor(e, depth + 1)
        if hit is not None:
            return hit
    return None


class TracedWrites:
    """What a trace writes into the user's Python state, put back as it was when the trace ends.

    Hooks and the loss function run while the forward is traced, never when the program runs. Whatever they
    write (``acts[name] = out``, ``outs.append(out)``, ``self.calls += 1`` on a hook object, a closure counter,
    ``module.cached = out``) is written once, by the trace: left there, a dict kept a FakeTensor of the trace,
    a counter counted a call that never ran. Every write of the forward hooks (and the loss function) is put
    back; a forward storing a tensor of the trace on a module (``self.attn = weights``, a list it appends to) is
    put back too. ``settle()`` (called as the trace ends, also when it raises) does so and returns, for a
    refusal, (who, where, tensor) of each tensor of the trace that was stored: no call of the program would
    store anything there. Other Python writes of a forward to its modules are the module snapshot's
    (``attributes`` / ``traced_changes``)."""

    def __init__(self, model: torch.nn.Module, functions=(), root: str = "model"):
        from ._build_cache import _is_library

        self._entries = []  # (who, where, mapping, key, value, contents, all writes or traced ones only, refused)
        self._keysets = []  # (who, where, mapping, keys before, all writes or traced ones only, names only, refused)
        seen: set = set()
        dicts = _hook_dicts(model, False, ())
        hooked = {id(owner) for _, how, d, owner in dicts if "forward" in how and owner is not None
                  and any(not _library_wiring(fn, owner) for fn in d.values())}
        watched = [(label, fn) for label, fn in _forward_hooks(dicts)]
        watched += [(f"loss_fn {_hook_label(fn)}", fn) for fn in functions]
        for who, fn in watched:
            for _, holder, names in _live_holders(fn, who):
                if id(holder) in seen:
                    continue
                seen.add(id(holder))
                self._watch(who, _holder_name(holder), holder, names, everything=True)
        for path, mod in torch.nn.Module.named_modules(model):
            d = mod.__dict__
            if id(d) not in seen:
                seen.add(id(d))
                # A library's module keeping a tensor of the trace (TransformerLens 4's attention bridge keeps
                # the pre-LN residual) is its own cache: put back, not refused. The user's modules, and those
                # the user's hooks are on, are refused.
                refused = not _is_library(type(mod)) or id(mod) in hooked
                where = f"model.{path}" if path else "model"
                who = f"forward (or a forward hook on {where})" if id(mod) in hooked else "forward"
                self._watch(who, where, d, None, everything=False, refused=refused)
        # The user's own modules: every Python value (new attributes and those starting with '_' included) their
        # forward writes, and whether the trace read it, for ``state_writes``.
        self._user = []
        for path, mod in torch.nn.Module.named_modules(model):
            if not _is_library(type(mod)):
                d = mod.__dict__
                keep = {k: v for k, v in d.items() if k not in _TORCH_MODULE_KEYS and _state_value(v)}
                self._user.append((f"{root}.{path}" if path else root, mod, d, keep,
                                   {k: c for k, v in keep.items() if (c := _contents(v)) is not None}))
        self._reads = _state_reads([mod for _, mod, _, _, _ in self._user],
                                   list(functions) + [fn for _, fn in watched])
        self.state_writes: list[StateWrite] = []
        self._settled = False
        # What the modules hold as the traced forward returns: torch.export puts a root module's attributes back
        # itself before the trace returns, so the module's dict alone would not show what forward wrote.
        self._observed: dict = {}
        self._observer = None
        if self._user:
            self._observer = torch.nn.Module.register_forward_hook(model, self._observe, always_call=True)

    def _observe(self, *_) -> None:
        for _, mod, d, _, _ in self._user:
            self._observed[id(mod)] = (dict(d), {k: c for k, v in d.items() if (c := _contents(v)) is not None})

    def _watch(self, who, where, holder, names, everything: bool, refused: bool = True) -> None:
        keys = names if names is not None else [k for k in holder.keys() if not (isinstance(k, str) and (
            k.startswith("__") or k in ("_parameters", "_buffers", "_modules") or k.endswith("hooks")))]
        for k in keys:
            v = holder.get(k, _MISSING)
            self._entries.append((who, where, holder, k, v, _contents(v), everything, refused))
        if isinstance(holder, dict):
            self._keysets.append((who, where, holder, set(holder) if names is None else set(names), everything,
                                  names is not None, refused))

    def _settle_state(self) -> None:
        """Once: ``state_writes`` of the user's modules, each put back as it was except the public attributes the
        module snapshot compares (``traced_changes`` handles those)."""
        if self._settled:
            return
        self._settled = True
        if self._observer is not None:
            self._observer.remove()
        for where, mod, d, before, contents in self._user:
            seen, seen_contents = self._observed.get(id(mod), ({}, {}))
            keys = list(before) + [k for k in d if k not in before]
            for k in keys + [k for k in seen if k not in before and k not in d]:
                if k in _TORCH_MODULE_KEYS or k.endswith("hooks") or (
                        k not in d and k not in before and hasattr(getattr(type(mod), k, None), "__set__")):
                    continue  # (a property's setter: what it stores is an attribute of its own)
                was, now = before.get(k, _MISSING), d.get(k, _MISSING)
                if now is was and seen.get(k, _MISSING) is not was and id(mod) in self._observed:
                    now = seen.get(k, _MISSING)  # written, then put back by the tracer itself (torch.export)
                if not (_state_value(was) and _state_value(now)):
                    continue
                inner = None
                if was is now:
                    inner = contents.get(k)
                    if inner is None or _same_contents(inner, now) or _tensors_swapped(inner, now):
                        continue
                elif type(was) is type(now) and _plain(was) and was == now:
                    continue
                elif type(was) is type(now) and k in contents and _tensors_swapped(contents[k], now):
                    continue  # a container of tensors the trace rebound to a copy (its tensors lifted)
                w = StateWrite(where, d, k, was, now, k in self._reads or _WILDCARD in self._reads, inner)
                self.state_writes.append(w)
                if not w.snapshot_covers:
                    w.put(new=False)

    def settle(self) -> list[tuple[str, str, torch.Tensor]]:
        stored = []
        for who, where, holder, k, was, contents, everything, refused in self._entries:
            now = holder.get(k, _MISSING)
            if now is not was:
                hit = _holds_traced_tensor(now)
                if everything or hit is not None:
                    if hit is not None and refused:
                        stored.append((who, _where(where, k), hit))
                    if was is _MISSING:
                        holder.pop(k, None) if isinstance(holder, dict) else holder.__delitem__(k)
                    else:
                        holder[k] = was
            elif contents is not None and not _same_contents(contents, now):
                hit = _holds_traced_tensor(now)
                if everything or hit is not None:
                    if hit is not None and refused:
                        stored.append((who, _where(where, k), hit))
                    _put_contents(now, contents)
        for who, where, holder, before, everything, only_named, refused in self._keysets:
            if only_named:
                continue  # a closure's or a module's globals: the names watched are entries
            for k in [k for k in holder if k not in before]:
                hit = _holds_traced_tensor(holder[k])
                if everything or hit is not None:
                    if hit is not None and refused:
                        stored.append((who, _where(where, k), hit))
                    del holder[k]
        self._settle_state()  # (after the tensors of the trace were taken out, and refused, above)
        return stored


def _holder_name(holder) -> str:
    if isinstance(holder, _Closure):
        return "closure"
    if isinstance(holder, dict) and "__name__" in holder and "__builtins__" in holder:
        return f"global {holder['__name__']}"
    return "attributes"


def _where(where: str, key) -> str:
    if where in ("closure", "attributes"):
        return repr(key)
    if where.startswith("global "):
        return f"{key!r} ({where})"
    return f"{where}.{key}"


def stored_trace_message(stored: list, who_runs: str, instead: str) -> str:
    """The refusal for tensors of a trace that hooks, a loss function or a forward stored (``TracedWrites``)."""
    who, where, t = stored[0]
    more = f" (and {len(stored) - 1} more)" if len(stored) > 1 else ""
    return (f"{who} stored a tensor of the trace in {where} ({type(t).__name__} of shape {tuple(t.shape)}){more}: "
            f"it runs while the forward is traced, never when {who_runs} runs, so it would hold that placeholder and "
            f"no call's values (the build put back what was there); {instead}")
