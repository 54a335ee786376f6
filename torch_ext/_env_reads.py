"""Environment variables the user's forward reads while it is traced (``os.environ["X"]``, ``.get``,
``os.getenv``, ``"X" in os.environ``).

The trace computes with the value it read as a constant, so a graph is valid only while each such
variable keeps that value. The reads are recorded during the trace (every read goes through
``os._Environ.__getitem__``), kept with the graph and its build-cache entries, and compared at every
use: a changed variable rebuilds the graph (build caches, ``patching``) or is refused (``run``,
``demand``), never answered with the old program. Reads by Python's and installed packages' own code
(torch's flags) are not recorded: only code outside them is the model's. Nor are reads inside a region dynamo traces (a
``torch.cond`` branch): dynamo cannot trace the frame walk that tells the model's code from a library's.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading

import torch

_LOCK = threading.Lock()
_SKIP_MODULES = frozenset({"os", "_collections_abc", "collections.abc", __name__, "torch_ext._trace_patches"})


def _from_user_code() -> bool:
    """Whether the read comes from code that is neither Python's nor an installed package's."""
    from ._build_cache import _is_installed_module

    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__") in _SKIP_MODULES:
        frame = frame.f_back
    if frame is None:
        return False
    name = frame.f_globals.get("__name__", "")
    return not (name == "torch_ext" or name.startswith("torch_ext.") or _is_installed_module(name))


@contextlib.contextmanager
def recording():
    """Yields a dict that fills with {variable: value read, None where unset} while the block runs (the first
    read of each counts: it is what the trace computed with). Only reads on this thread are recorded, and the
    block holds the trace patches' lock (``_trace_patches``): a trace records while no other trace runs.
    Nested, each level records the reads of its block."""
    from . import _trace_patches

    with _trace_patches.patched("env_reads") as got:
        yield got["env_reads"]


@contextlib.contextmanager
def _recorder():
    """The patch itself (entered through _trace_patches): ``recording`` without the registry."""
    from ._trace_patches import gated

    reads: dict = {}
    cls = type(os.environ)
    with _LOCK:
        original = cls.__getitem__

        def getitem(self, key):
            # Under dynamo (torch.cond's branches are traced by dynamo even in non-strict export) the frame
            # walk cannot be traced: such a read is not recorded. (is_compiling() is true in any export.)
            if self is not os.environ or torch.compiler.is_dynamo_compiling() or not _from_user_code():
                return original(self, key)
            try:
                value = original(self, key)
            except KeyError:
                reads.setdefault(key, None)
                raise
            reads.setdefault(key, value)
            return value

        cls.__getitem__ = gated(getitem, original)
    try:
        yield reads
    finally:
        with _LOCK:
            cls.__getitem__ = original


def changed(reads: dict | None) -> list[tuple[str, str | None, str | None]]:
    """(variable, value at the trace, value now) for each recorded variable whose value differs now."""
    if not reads:
        return []
    env = os.environ
    return [(k, v, env.get(k)) for k, v in reads.items() if env.get(k) != v]


def message(changes: list, built: str) -> str:
    """One sentence naming the first changed variable (and how many more)."""
    name, was, now = changes[0]
    more = f" (and {len(changes) - 1} more)" if len(changes) > 1 else ""

    def show(v):
        return "unset" if v is None else repr(v)

    return (f"the environment variable {name} the forward read is {show(now)} now, {show(was)} when {built}{more}; "
            "the graph computes with the value it was traced with")
