"""Which output elements a sweep's metric reads, found by running it once (``sweep(reads="auto")``).

The metric is called on copies of the clean outputs under a dispatch mode that follows every output element
through the ops that only move elements (views, indexing with constant indices, copies, dtype casts) and records
the elements that reach any other op (arithmetic, a reduction, ``.item()``): those are what it reads. The result
is a ``reads`` dict in the form a user would write, ``{output node: per-dim int64 coordinates}`` (or full slices
for an output read whole), so the sweep computes only what reaches them, as with a declared ``reads=``.

An inference is a guess about every later call from one call: a metric whose reads depend on the values (Python
control flow on them, an index computed from them in Python) may read other elements at another site. It is not
trusted: the sweep checks every site's metric as it checks a declared ``reads=`` (_ReadCheck: the undeclared
elements poisoned four ways), and a site whose result moves with them makes the sweep start again without
``reads`` (reactive.sweep). So an inference that is too small costs a rerun, never a wrong metric; one that is
too large (an element that flowed into an op whose result the metric then dropped) only computes more.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Ops whose result's elements are elements of their first argument (`self`), picked by their other arguments,
# which must not be output elements themselves: the same call on the element ids says which.
# (Composite ops such as reshape never reach a dispatch mode: it sees what they decompose into.)
_MOVES = {
    aten.view, aten._unsafe_view, aten.select, aten.slice, aten.index, aten.index_select,
    aten.gather, aten.take, aten.transpose, aten.permute, aten.expand, aten.unsqueeze, aten.squeeze, aten.t,
    aten.narrow, aten.diagonal, aten.unfold, aten.unbind, aten.split, aten.split_with_sizes, aten.chunk,
    aten.flatten, aten.movedim, aten.repeat, aten.flip, aten.roll, aten.squeeze_copy, aten.view_copy,
    aten.select_copy, aten.slice_copy, aten.permute_copy, aten.expand_copy, aten.t_copy, aten.transpose_copy,
    aten.unsqueeze_copy, aten.alias_copy,
}
# Ops that keep every element where it is (a copy, a cast): the ids pass through unchanged.
_SAME = {aten.clone, aten._to_copy, aten.contiguous, aten.to, aten.detach_copy, aten.alias, aten.detach,
         aten.lift_fresh, aten.lift_fresh_copy, aten._conj, aten.resolve_conj, aten.resolve_neg}

# Ops that read only an output's shape, dtype and device, never its elements: their results are not output elements.
_SHAPE_ONLY = {aten.empty_like, aten.zeros_like, aten.ones_like, aten.full_like, aten.new_empty, aten.new_zeros,
               aten.new_ones, aten.new_full, aten.new_empty_strided}


class _GiveUp(Exception):
    pass


class _Tracker(TorchDispatchMode):
    """Follows output elements by id through element-moving ops; records those any other op consumes."""

    def __init__(self, sources: dict[int, tuple[int, torch.Tensor, torch.Tensor]]):
        super().__init__()
        # id(tensor) -> (flat output index, element ids of the same shape (float64 flat positions), the tensor):
        # the tensor is held so that its id() is not reused by a new object during the call.
        self.ids = dict(sources)
        self.read: dict[int, list[torch.Tensor]] = {}
        self.gave_up: str | None = None  # set as well as raised: a metric may catch the exception

    def _of(self, a):
        return self.ids.get(id(a)) if isinstance(a, torch.Tensor) else None

    def _mark(self, entry) -> None:
        k, ids, _ = entry
        self.read.setdefault(k, []).append(ids.reshape(-1))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flat = pytree.tree_leaves((args, kwargs))
        tracked = [(i, e) for i, a in enumerate(flat) if (e := self._of(a)) is not None]
        if not tracked:
            return out
        for i, formal in enumerate(func._schema.arguments):
            if getattr(formal.alias_info, "is_write", False):
                written = args[i] if i < len(args) else kwargs.get(formal.name)
                if any(self._of(w) is not None for w in pytree.tree_leaves(written)):
                    # An output (or a view or copy of one) written in place: its elements are no longer the
                    # graph's, and what reads them later reads the write. Not followed.
                    self.gave_up = f"{func} writes into an output element"
                    raise _GiveUp(self.gave_up)
        packet = func.overloadpacket
        if packet in _SHAPE_ONLY:
            return out
        self_entry = self._of(args[0]) if args else None
        moved = self_entry is not None and [i for i, _ in tracked] == [0] and packet in (_MOVES | _SAME)
        if not moved:
            for _, e in tracked:
                self._mark(e)
            return out
        k, ids, _ = self_entry
        if packet in _SAME:
            out_ids = ids
        else:
            out_ids = func(ids, *args[1:], **{n: v for n, v in kwargs.items() if n not in ("dtype", "device")})
        outs = out if isinstance(out, (list, tuple)) else [out]
        id_outs = out_ids if isinstance(out_ids, (list, tuple)) else [out_ids]
        for o, oi in zip(outs, id_outs):
            if isinstance(o, torch.Tensor) and isinstance(oi, torch.Tensor) and tuple(o.shape) == tuple(oi.shape):
                self.ids[id(o)] = (k, oi, o)
            elif isinstance(o, torch.Tensor):
                self._mark(self_entry)  # shapes disagree: count the whole source as read
        return out


def infer_reads(metric: Callable, outputs: list, names: list, user: Callable) -> tuple[dict | None, str]:
    """(reads, why): the ``reads`` dict a sweep's metric needs, keyed by output node name, or None (read
    everything: nothing to gain, or it could not be found) with the reason.

    ``outputs``: the flat output values (clean), ``names``: their node names (None for a constant), ``user``:
    the flat outputs as the metric receives them (ReactiveGraph._user)."""
    sources: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}
    given = []
    for k, (v, name) in enumerate(zip(outputs, names)):
        if name is not None and isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel():
            copy = v.detach().clone()  # the metric may not see (nor write) the cached value itself
            ids = torch.arange(v.numel(), dtype=torch.float64).reshape(v.shape)
            sources[id(copy)] = (k, ids, copy)
            given.append(copy)
        else:
            given.append(v)
    if not sources:
        return None, "no floating-point output"
    tracker = _Tracker(sources)
    try:
        with torch.no_grad(), tracker:
            result = metric(user(given))
    except _GiveUp as e:
        return None, str(e)
    except Exception as e:  # noqa: BLE001 - the user's metric; the sweep then runs it as it is
        return None, f"the metric failed when traced: {type(e).__name__}: {e}"
    if tracker.gave_up is not None:
        return None, tracker.gave_up
    for leaf in pytree.tree_leaves(result):  # an output element returned as it is (``lambda o: o[0, -1, 3]``)
        entry = tracker._of(leaf)
        if entry is not None:
            tracker._mark(entry)
    reads: dict[str, Any] = {}
    for k, parts in tracker.read.items():
        v = outputs[k]
        flat = torch.unique(torch.cat(parts).to(torch.int64))
        if flat.numel() == v.numel():
            index = (slice(None),) * v.dim()
        else:
            index = tuple(torch.unravel_index(flat, tuple(v.shape))) if v.dim() else ()
        if names[k] in reads:  # the same node returned twice: read it whole
            index = (slice(None),) * v.dim()
        reads[names[k]] = index
    if not reads:
        return None, "the metric reads no output element through torch ops"
    if all(all(isinstance(i, slice) for i in index) for index in reads.values()) and \
            len(reads) == len(sources):
        return None, "the metric reads every element"
    return reads, f"{sum(_count(outputs[names.index(n)], i) for n, i in reads.items())} of " \
                  f"{sum(outputs[k].numel() for k, _, _ in sources.values())} output elements"


def _count(v: torch.Tensor, index) -> int:
    if all(isinstance(i, slice) for i in index):
        return v.numel()
    return int(index[0].numel()) if index else 1

