"""ReactiveGraph and sweep: the Python face of csrc/reactive/engine.h.

Counting conventions are those of shared/docs/cost-model.md: every call node (getitem and grafted
nodes included) counts one evaluation; placeholders and the output are never counted. A patch at
``s`` costs exactly |V+(s)| evaluations at the next demand; ``restore()`` costs zero.
"""
from __future__ import annotations

import contextlib
import fnmatch
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable, Sequence

import torch
import torch.utils._pytree as pytree

from . import _C
from .ir import Graph


def _functional_program(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    # Cached values must never be aliased by an in-place op: functionalize, keep composite ops.
    return ep.run_decompositions({})


class ReactiveGraph:
    """A reactive cache over an exported graph.

    ``ReactiveGraph(model, example_inputs)`` exports ``model`` (an ``nn.Module``) with
    ``torch.export``; an ``ExportedProgram`` is used as it is. Every node keeps its value after
    :meth:`run`; :meth:`patch`, :meth:`restore` and :meth:`graft` invalidate exactly the affected
    cone, and :meth:`demand` recomputes only that.
    """

    def __init__(self, ep_or_module, example_inputs: Sequence | None = None, *, cutoff: bool = False):
        if isinstance(ep_or_module, torch.nn.Module):
            if example_inputs is None:
                raise ValueError("ReactiveGraph(module, example_inputs): example_inputs are required to export a module")
            self._module = ep_or_module
            ep = torch.export.export(ep_or_module, tuple(example_inputs))
        elif isinstance(ep_or_module, torch.export.ExportedProgram):
            self._module = None
            ep = ep_or_module
        else:
            raise TypeError(f"ReactiveGraph expects an nn.Module or an ExportedProgram, got {type(ep_or_module).__name__}")
        self.program = _functional_program(ep)
        self.graph = Graph.from_exported(self.program)
        self._engine = _C.Engine(self.graph._g)
        self._engine.set_cutoff(bool(cutoff))
        sig = self.program.graph_signature
        state = {**self.program.state_dict, **self.program.constants}
        self._slots = [None if spec.kind.name == "USER_INPUT" else state[spec.target] for spec in sig.input_specs]
        self._num_user = self._slots.count(None)
        self._in_spec = self.program.call_spec.in_spec
        self._out_spec = self.program.call_spec.out_spec
        kinds = [spec.kind.name for spec in sig.output_specs]
        self._user_outputs = [i for i, k in enumerate(kinds) if k == "USER_OUTPUT"]
        # A joint program's outputs are the loss and the parameter gradients (no user outputs).
        self._loss_output = kinds.index("LOSS_OUTPUT") if "LOSS_OUTPUT" in kinds else None
        self._grad_outputs = [(i, spec.target) for i, spec in enumerate(sig.output_specs)
                              if spec.kind.name == "GRADIENT_TO_PARAMETER"]
        self._module_paths = {n["name"]: n["module_path"] for n in self.graph.nodes()}
        self._countable = [n["name"] for n in self.graph.nodes() if n["kind"] == "call"]
        self._example_inputs = tuple(example_inputs) if example_inputs is not None else None
        self._last_inputs = None
        self._batched: dict[int, tuple] = {}
        if example_inputs is not None:
            self.run(*example_inputs)

    # ---- evaluation
    def _flat_inputs(self, args, kwargs):
        flat, spec = pytree.tree_flatten((args, kwargs))
        if self._in_spec is not None and spec != self._in_spec:
            raise TypeError(f"inputs do not match the exported signature: expected {self._in_spec}, got {spec}")
        it = iter(flat)
        return [next(it) if s is None else s for s in self._slots]

    def _user(self, outs):
        if self._loss_output is not None and not self._user_outputs:
            # Training mode: (loss, {parameter name: gradient}).
            return outs[self._loss_output], {name: outs[i] for i, name in self._grad_outputs}
        return pytree.tree_unflatten([outs[i] for i in self._user_outputs], self._out_spec)

    def run(self, *args, **kwargs):
        """Full evaluation (N evaluations); becomes the baseline. Returns the outputs."""
        self._engine.run(self._flat_inputs(args, kwargs))
        self._last_inputs = (args, kwargs)
        return self.demand()

    def demand(self):
        """The outputs, recomputing only stale nodes."""
        return self._user(self._engine.demand())

    def value(self, node: str) -> torch.Tensor:
        """A node's current value, recomputing only its stale ancestors."""
        return self._engine.value(node)

    def baseline(self, node: str) -> torch.Tensor:
        """A node's value with no patch active (from the overlay, no evaluation)."""
        return self._engine.baseline(node)

    # ---- mutations
    def patch(self, node: str, value) -> None:
        """Pins ``node`` to ``value`` (a tensor of the node's shape and dtype, or ``f(clean) -> tensor``)."""
        if callable(value):
            value = value(self._engine.baseline(node))
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"patch {node!r}: expected a tensor or a callable returning one, got {type(value).__name__}")
        self._engine.patch(node, value.detach())

    def restore(self, node: str | None = None) -> None:
        """Drops every patch (zero evaluations), or only the patch at ``node``."""
        if node is None:
            self._engine.restore()
        else:
            self._engine.restore_node(node)

    def graft(self, src: str, dst_or_block, block=None) -> list[str]:
        """Splices ``block`` into the edge ``src -> dst``, or after ``src`` for every consumer.

        ``block`` is an ``nn.Module`` or a function of one tensor returning a tensor of the same
        shape and dtype. It is exported with ``torch.export`` and spliced in; the new node names
        are returned.
        """
        dst = ""
        if block is None:
            block = dst_or_block
        else:
            if not isinstance(dst_or_block, str):
                raise TypeError("graft(src, dst, block): dst must be a node name")
            dst = dst_or_block
        if not isinstance(block, torch.nn.Module):
            if not callable(block):
                raise TypeError(f"graft: block must be an nn.Module or a callable, got {type(block).__name__}")
            block = _FunctionBlock(block)
        example = self._engine.value(src)
        ep = _functional_program(torch.export.export(block, (example,)))
        bgraph = Graph.from_exported(ep)
        state = {**ep.state_dict, **ep.constants}
        params = [state[spec.target] for spec in ep.graph_signature.input_specs if spec.kind.name != "USER_INPUT"]
        names = self._engine.graft(src, dst, bgraph._g, params)
        self._countable.extend(names)
        for n in names:
            self._module_paths[n] = ""
        return names

    @contextlib.contextmanager
    def batch(self):
        """Applies many mutations with one invalidation wave at the next demand."""
        self._engine.begin_batch()
        try:
            yield self
        finally:
            self._engine.end_batch()

    # ---- inspection
    @property
    def stats(self) -> dict:
        """``evaluations``, ``cost`` (FLOP-weighted), ``cutoffs``, ``invalidated``, ``restored``."""
        return self._engine.stats()

    def reset_stats(self) -> None:
        self._engine.reset_stats()

    def cone(self, node: str) -> set[str]:
        """V+(node): the strict downstream cone, as node names."""
        return set(self._engine.cone(node))

    def nodes(self, pattern: str | None = None) -> list[str]:
        """Countable node names, filtered by a glob on the name or on the module path."""
        if pattern is None:
            return list(self._countable)
        return [n for n in self._countable
                if fnmatch.fnmatchcase(n, pattern) or fnmatch.fnmatchcase(self._module_paths.get(n, ""), pattern)]

    @property
    def num_nodes(self) -> int:
        """N: the number of countable nodes (one full recomputation)."""
        return self._engine.num_countable()

    def set_cutoff(self, enabled: bool) -> None:
        self._engine.set_cutoff(bool(enabled))

    def check_invariants(self) -> None:
        self._engine.check_invariants()

    def __str__(self) -> str:
        return str(self._engine)

    # ---- batched sites
    def _batched_graph(self, k: int) -> "ReactiveGraph":
        """The same model exported at k times the batch size, holding k copies of the current inputs."""
        if self._last_inputs is None:
            raise ValueError("batched sites need a ReactiveGraph that has run (give example_inputs or call run())")
        args, kwargs = self._last_inputs
        if kwargs:
            raise ValueError("batched sites support positional inputs only")
        stacked = tuple(torch.cat([x] * k) if isinstance(x, torch.Tensor) else x for x in args)
        cached = self._batched.get(k)
        if cached is None:
            module = self._module if self._module is not None else self.program.module()
            self._batched[k] = (ReactiveGraph(module, stacked, cutoff=False), args)
        elif cached[1] is not args:
            cached[0].run(*stacked)  # the graph moved to other inputs since
            self._batched[k] = (cached[0], args)
        return self._batched[k][0]


class _FunctionBlock(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


Site = Hashable


@dataclass
class SweepResult:
    """What a sweep measured. ``rho = full_evaluations / predicted_evaluations``."""

    metrics: dict
    measured_evaluations: int
    predicted_evaluations: int
    full_evaluations: int
    num_nodes: int
    wall_time: float
    batched: bool = False
    groups: int = 0
    cost: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def rho(self) -> float:
        return self.full_evaluations / max(self.predicted_evaluations, 1)

    @property
    def rho_measured(self) -> float:
        return self.full_evaluations / max(self.measured_evaluations, 1)

    def to_pandas(self):
        import pandas as pd

        rows = []
        for site, value in self.metrics.items():
            node, key = (site if isinstance(site, tuple) else (site, None))
            rows.append({"site": site, "node": node, "key": key, "metric": value})
        return pd.DataFrame(rows)

    def summary(self) -> str:
        return (f"sweep over {len(self.metrics)} sites{' (batched, %d groups)' % self.groups if self.batched else ''}: "
                f"{self.measured_evaluations} evaluations measured, {self.predicted_evaluations} predicted from cones, "
                f"{self.full_evaluations} for full recomputation; rho = {self.rho:.4f} "
                f"(measured {self.rho_measured:.4f}); {self.wall_time * 1e3:.1f} ms")

    def plot(self, path: str, title: str = "patching sweep") -> str:
        """A heatmap PNG: rows are nodes (e.g. layers), columns are keys (positions or heads)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np

        df = self.to_pandas()
        nodes = list(dict.fromkeys(df["node"]))
        keys = list(dict.fromkeys(df["key"]))
        grid = np.full((len(nodes), len(keys)), np.nan)
        for _, r in df.iterrows():
            grid[nodes.index(r["node"]), keys.index(r["key"])] = r["metric"]
        fig, ax = plt.subplots(figsize=(max(4, 0.45 * len(keys) + 2), max(3, 0.45 * len(nodes) + 1.5)))
        im = ax.imshow(grid, aspect="auto", cmap="RdBu_r")
        ax.set_xticks(range(len(keys)), [str(k) for k in keys], fontsize=7)
        ax.set_yticks(range(len(nodes)), [str(n) for n in nodes], fontsize=7)
        ax.set_xlabel("site key (position / head index)")
        ax.set_ylabel("patched node")
        ax.set_title(f"{title}\nrho = {self.rho:.3f}, {self.measured_evaluations} evaluations vs {self.full_evaluations} full")
        fig.colorbar(im, ax=ax, label="metric (unitless)")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path


def _expand_sites(rg: ReactiveGraph, sites) -> list:
    if isinstance(sites, str):
        found = rg.nodes(sites)
        if not found:
            raise ValueError(f"no node matches {sites!r}")
        return found
    return list(sites)


def _progress(iterable, total, enabled, desc):
    if not enabled:
        return iterable
    import sys

    if not sys.stderr.isatty():
        return iterable
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, leave=False)


def sweep(rg: ReactiveGraph, sites, patch: Callable[[torch.Tensor, Any], torch.Tensor],
          metric: Callable[[Any], float], *, progress: bool = True, batch_sites: bool = False) -> SweepResult:
    """Patches each site, demands, measures and restores.

    ``sites`` is a glob over node names / module paths, or a list of node names or ``(node, key)``
    tuples (e.g. ``("add_3", position)``). ``patch(clean_value, site)`` returns the patched value;
    ``metric(outputs)`` returns a float. With ``batch_sites=True`` the sites that share a node (so
    their cones coincide) are evaluated together, K variants stacked along dim 0 of a K-times
    batched graph, the shared cone evaluated once; outputs must be batch-major.
    """
    site_list = _expand_sites(rg, sites)
    if not site_list:
        raise ValueError("sweep needs at least one site")

    def node_of(site):
        return site[0] if isinstance(site, tuple) else site

    for s in site_list:
        if node_of(s) not in rg._countable and node_of(s) not in {n["name"] for n in rg.graph.nodes()}:
            raise ValueError(f"sweep: unknown node {node_of(s)!r}")
    cones = {}
    for s in site_list:
        n = node_of(s)
        if n not in cones:
            cones[n] = len(rg.cone(n))
    predicted = sum(cones[node_of(s)] for s in site_list)
    full = len(site_list) * rg.num_nodes
    metrics: dict = {}
    if not batch_sites:
        before = rg.stats["evaluations"]
        cost_before = rg.stats["cost"]
        t0 = time.perf_counter()
        for s in _progress(site_list, len(site_list), progress, "sweep"):
            node = node_of(s)
            rg.patch(node, patch(rg.baseline(node), s))
            metrics[s] = float(metric(rg.demand()))
            rg.restore()
        wall = time.perf_counter() - t0
        return SweepResult(metrics, rg.stats["evaluations"] - before, predicted, full, rg.num_nodes, wall,
                           cost=rg.stats["cost"] - cost_before)

    groups: dict = {}
    for s in site_list:
        groups.setdefault(node_of(s), []).append(s)
    measured = 0
    cost = 0.0
    t0 = time.perf_counter()
    for node, members in _progress(list(groups.items()), len(groups), progress, "sweep (batched)"):
        k = len(members)
        big = rg._batched_graph(k)
        clean = rg.baseline(node)
        before = big.stats["evaluations"]
        cost_before = big.stats["cost"]
        big.patch(node, torch.cat([patch(clean, s) for s in members]))
        outs = big.demand()
        flat, spec = pytree.tree_flatten(outs)
        chunks = [torch.chunk(o, k) if isinstance(o, torch.Tensor) and o.dim() > 0 else None for o in flat]
        for i, s in enumerate(members):
            parts = []
            for o, ch in zip(flat, chunks):
                if ch is None:
                    raise ValueError("batched sites need batch-major tensor outputs (a scalar output cannot be split)")
                parts.append(ch[i])
            metrics[s] = float(metric(pytree.tree_unflatten(parts, spec)))
        big.restore()
        measured += big.stats["evaluations"] - before
        cost += big.stats["cost"] - cost_before
    wall = time.perf_counter() - t0
    predicted_batched = sum(cones[n] for n in groups)
    return SweepResult(metrics, measured, predicted_batched, full, rg.num_nodes, wall, batched=True,
                       groups=len(groups), cost=cost)
