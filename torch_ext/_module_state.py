"""The Python values of a model's modules that tracing bakes into a program.

Tracing (torch.export, make_fx) reads every Python attribute a forward uses as a constant: the
training flag, a softmax temperature, ``Dropout.p``, ``BatchNorm.momentum``. Eager code sees a
later change at once; a program built earlier does not. ``attributes`` snapshots them at build and
``changed`` lists what differs now, so the pure step and the reactive graph refuse to compute with
values the model no longer has.
"""
from __future__ import annotations

import operator

import torch

# The training flag and every public attribute holding one of these.
_SCALARS = (bool, int, float, complex, str, type(None))
_MISSING = object()


def _scalars_only(v) -> bool:
    return isinstance(v, (list, tuple)) and all(isinstance(e, _SCALARS) for e in v)


def attributes(model: torch.nn.Module) -> tuple:
    """A snapshot of what every module holds as plain attributes, as it stands: scalars and lists or
    tuples of scalars by value, tensors (neither parameters nor buffers: the trace bakes them in as
    constants) by identity. ``(paths, dicts, keys, values, tensor paths, dicts, keys, tensors)``."""
    paths, dicts, keys, values = [], [], [], []
    tpaths, tdicts, tkeys, tensors = [], [], [], []
    for path, mod in model.named_modules():
        d = mod.__dict__
        for k, v in d.items():
            if k != "training" and k.startswith("_"):
                continue
            if isinstance(v, _SCALARS) or _scalars_only(v):
                paths.append(path)
                dicts.append(d)
                keys.append(k)
                values.append(list(v) if isinstance(v, list) else v)  # a copy: the list may be edited
            elif isinstance(v, torch.Tensor):
                tpaths.append(path)
                tdicts.append(d)
                tkeys.append(k)
                tensors.append(v)
    return paths, dicts, keys, values, tpaths, tdicts, tkeys, tensors


def changed(snapshot: tuple) -> list[tuple[str, str, object, object]]:
    """(module path, attribute, value in the snapshot, value now) for every attribute that changed."""
    if not snapshot:
        return []
    paths, dicts, keys, values, tpaths, tdicts, tkeys, tensors = snapshot
    try:  # the common case: two loops in C
        if list(map(operator.getitem, dicts, keys)) == values and all(
                map(operator.is_, map(operator.getitem, tdicts, tkeys), tensors)):
            return []
    except KeyError:  # an attribute was deleted: the slow path names it
        pass
    out = []
    for path, d, k, was in zip(paths, dicts, keys, values):
        now = d.get(k, _MISSING)
        if now is not was and not (type(now) is type(was) and now == was):
            out.append((path, k, was, now))
    for path, d, k, was in zip(tpaths, tdicts, tkeys, tensors):
        now = d.get(k, _MISSING)
        if now is not was:
            out.append((path, k, _Short(was), _Short(now)))
    return out


class _Short:
    """A tensor as a message shows it: its shape and its first values, not all of them."""

    def __init__(self, t):
        self.t = t

    def __repr__(self) -> str:
        if not isinstance(self.t, torch.Tensor):
            return "(deleted)" if self.t is _MISSING else repr(self.t)
        flat = self.t.detach().reshape(-1)[:4].tolist()
        return f"a tensor of shape {tuple(self.t.shape)} ({', '.join(f'{v:.4g}' for v in flat)}{', ...' if self.t.numel() > 4 else ''})"


def traced_changes(model: torch.nn.Module, snapshot: tuple) -> list:
    """The scalar attributes a trace of ``model`` changed (a forward counting its calls), put back as
    they were; a tensor attribute a forward replaces (a cache) is not one of them."""
    out = [c for c in changed(snapshot) if not isinstance(c[2], _Short)]
    for path, key, was, _ in out:
        setattr(model.get_submodule(path), key, was)
    return out


def describe(path: str, key: str) -> str:
    """``model.<path>.<key>``, the attribute as the user reaches it."""
    return f"{'model.' + path if path else 'model'}.{key}"


def change_message(changes: list, built: str) -> str:
    """One sentence naming the first change (and how many more), for a refusal."""
    path, key, was, now = changes[0]
    more = f" (and {len(changes) - 1} more changed attributes)" if len(changes) > 1 else ""
    if isinstance(was, _Short):
        return f"{describe(path, key)} was replaced by {now!r} (when {built}: {was!r}){more}"
    mode = " (eval mode)" if key == "training" and now is False else " (train mode)" if key == "training" else ""
    # Which attributes the forward reads is not known here: every public one is checked. Bookkeeping
    # the forward never reads (a step counter kept on the model) can opt out by its name.
    hint = ("" if key == "training" else
            f" (if forward never reads {key!r}, keep it under a name starting with '_', which is not checked)")
    return f"{describe(path, key)} is {now!r}{mode} now, {was!r} when {built}{more}{hint}"
