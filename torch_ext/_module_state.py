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


def attributes(model: torch.nn.Module) -> tuple:
    """A snapshot of every module's scalar attributes, as they stand: ``(paths, dicts, keys, values)``,
    one entry per attribute (module path, the module's ``__dict__``, the name, the value)."""
    paths, dicts, keys, values = [], [], [], []
    for path, mod in model.named_modules():
        d = mod.__dict__
        for k, v in d.items():
            if (k == "training" or not k.startswith("_")) and isinstance(v, _SCALARS):
                paths.append(path)
                dicts.append(d)
                keys.append(k)
                values.append(v)
    return paths, dicts, keys, values


def changed(snapshot: tuple) -> list[tuple[str, str, object, object]]:
    """(module path, attribute, value in the snapshot, value now) for every attribute that changed."""
    if not snapshot:
        return []
    paths, dicts, keys, values = snapshot
    try:
        if list(map(operator.getitem, dicts, keys)) == values:  # the common case: one loop in C
            return []
    except KeyError:  # an attribute was deleted: the slow path names it
        pass
    out = []
    for path, d, k, was in zip(paths, dicts, keys, values):
        now = d.get(k, _MISSING)
        if now is not was and not (type(now) is type(was) and now == was):
            out.append((path, k, was, now))
    return out


def describe(path: str, key: str) -> str:
    """``model.<path>.<key>``, the attribute as the user reaches it."""
    return f"{'model.' + path if path else 'model'}.{key}"


def change_message(changes: list, built: str) -> str:
    """One sentence naming the first change (and how many more), for a refusal."""
    path, key, was, now = changes[0]
    mode = " (eval mode)" if key == "training" and now is False else " (train mode)" if key == "training" else ""
    more = f" (and {len(changes) - 1} more changed attributes)" if len(changes) > 1 else ""
    return f"{describe(path, key)} is {now!r}{mode} now, {was!r} when {built}{more}"
