"""Planned execution of a pure step and the memory report. Planning and every analysis are C++
(csrc/passes/schedule.h, plan_memory.h, memory_algorithms.h, lower_out_variants.h,
memory_analysis.h); this module runs them and formats or plots the results."""
from __future__ import annotations

import contextlib
import copy
import itertools
import json
from dataclasses import asdict, dataclass, field

import torch

from . import _C, _compat


class PlannedStep:
    """A pure step scheduled for the lowest peak and run inside one preallocated arena.

    With ``donate=True`` (JAX ``donate_argnums`` semantics) the state passed in is consumed: its
    tensors are updated in place and returned in the new state, so the caller must not reuse the
    old state. Results are bit-exact with the unplanned executor.
    """

    def __init__(self, step, plan: bool = True, donate: bool = True, memory_budget=None):
        self.step = step
        self.donate = bool(donate)
        # batch_shapes="cache": one planned program per batch shapes the step has met (its variants),
        # planned on first use with the same options.
        self._options = (plan, self.donate, memory_budget)
        self._variants: dict[int, PlannedStep] = {}
        budget = _budget_bytes(step, memory_budget, plan)  # checked before any work
        graph = step.graph.clone()
        if plan:
            # Before scheduling, so that the order can free a conv's saved input after its weight
            # gradient, and the weight gradient's scratch is gone before the input gradient exists.
            splits = _splits_that_lower_the_peak(graph)
            if step.process_group is not None:
                # Measured per process: the ranks take rank 0's choice, so that they schedule one program.
                import torch.distributed as dist

                chosen = [splits]
                dist.broadcast_object_list(chosen, src=dist.get_global_rank(step.process_group, 0),
                                           group=step.process_group)
                splits = chosen[0]
            self.split_convolutions = graph.split_convolution_backward(splits)
            self.schedule, self.candidates = graph.schedule(self.donate)
        else:
            self.schedule, self.candidates, self.split_convolutions = "export", [], []
        self.remat = None  # with memory_budget: what rematerialize_for_budget chose (csrc/passes/rematerialize.h)
        if budget is not None:
            self.remat = graph.rematerialize_for_budget(budget, self.donate)
            if not self.remat["feasible"]:
                r = self.remat
                raise ValueError(
                    f"memory_budget={memory_budget!r} ({budget} bytes) cannot be met: the smallest planned peak found is "
                    f"{r['min_peak']} bytes ({r['min_peak'] / 2**20:.2f} MiB; {r['peak_before']} bytes without "
                    f"recomputation, {len(r['recomputed'])} activations recomputed); pass a budget of at least "
                    f"{r['min_peak']} bytes")
        self.graph = graph
        self._ex = _C.ArenaExecutor(graph._g, len(step.state_names), self.donate)
        self._plan = (len(self._ex.fallbacks()), self._ex.plan())  # (len(fallbacks) when read, the plan)
        if step.process_group is not None:  # each rank scheduled on its own
            from .distributed import check_collective_order

            check_collective_order(graph, self.plan["order"], step.process_group, "compile", step._state_names)

    @property
    def plan(self) -> dict:
        """The memory plan (a dict). A node whose out= kernel fell back at run time (``fallbacks``) allocates its
        result from then on: read again after a call, ``dynamic`` and ``dynamic_bytes`` (``peak_bytes``) count it."""
        fallbacks = len(self._ex.fallbacks())
        if self._plan[0] != fallbacks:
            self._plan = (fallbacks, self._ex.plan())
        return self._plan[1]

    @property
    def peak_bytes(self) -> int:
        """The planned peak: arena, kernel-allocated buffers, escaping outputs, state and batch."""
        return self.plan["peak_bytes"]

    @property
    def out_variant_nodes(self) -> int:
        return self._ex.num_out_variant()

    @property
    def inplace_updates(self) -> int:
        return self._ex.num_inplace_updates()

    @property
    def fallbacks(self) -> list[str]:
        """Nodes whose kernels allocate their results outside the arena: no out= overload with a kernel
        of its own, or left to the allocator by the plan (``plan["dynamic"]``, counted in ``dynamic_bytes``)."""
        return self._ex.fallbacks()

    def __call__(self, state, *batch):
        step = self.step
        if step.batch_shapes != "cache":
            inputs = step.flat_inputs(state, *batch)  # refuses a state an earlier donating call consumed
            return self._run(state, inputs)
        # A batch of other shapes (the last, partial batch of an epoch) runs the program the step built
        # for them (step(state, *batch) does the same), planned here once: it was refused as of another
        # shape than the example's.
        step._check_call(state)
        flat_batch = step._check_batch(batch)
        program = step._program_for(flat_batch)
        if program is step:
            return self._run(state, step._checked_inputs(state, flat_batch))
        planned = self._variants.get(id(program))
        if planned is None:
            plan, donate, budget = self._options
            planned = self._variants[id(program)] = PlannedStep(program, plan=plan, donate=donate, memory_budget=budget)
        from .train_step import in_layout_of

        inputs = program._gather(state, [in_layout_of(t, ex, f"batch[{i}]")
                                         for i, (t, ex) in enumerate(zip(flat_batch, program._example_leaves))])
        return planned._run(state, inputs, finish=step)

    def _run(self, state, inputs, finish=None):
        """Runs the planned program on its flat inputs; ``finish`` (the step whose call this is: the
        step itself, or the one whose batch_shapes='cache' variant this plan runs) builds the result."""
        finish = self.step if finish is None else finish
        if not self.donate:
            outs = self._ex.run(inputs)
        else:
            # A call that fails part-way (say in the second step of an unrolled program) may already
            # have updated donated tensors in place. Version counters tell exactly whether it did: if
            # so the state is consumed, as by a call that succeeded, so that no retry trains on it.
            versions = [getattr(t, "_version", None) for t in inputs]
            try:
                outs = self._ex.run(inputs)
            except Exception as e:
                written = [name for (name, _), t, v in zip(self.step._inputs, inputs, versions)
                           if getattr(t, "_version", None) != v]
                if written:
                    state.consumed_by = (f"a failed call of step.compile(donate=True), which had already updated "
                                         f"{written[:3]}{' ...' if len(written) > 3 else ''} in place")
                    note = (f"{e}\n(the donated {state.describe()} was partly updated in place before the error "
                            "and is now marked consumed: start again from a saved or returned state)")
                    try:
                        wrapped = type(e)(note)
                    except Exception:  # an exception type with another constructor
                        wrapped = RuntimeError(note)
                    raise wrapped from e
                raise
        # With donation the input tensors now hold the new values: mark the old state consumed.
        return finish._finish(state, outs, donated_to="step.compile(donate=True)" if self.donate else None)


_SPLIT_PEAKS: dict = {}  # call signature -> (fused peak, split peak), measured once per process


def _splits_that_lower_the_peak(graph) -> list[str]:
    """The splittable convolution_backward calls whose split (csrc/passes/split_convolution_backward.h)
    lowers the call's own peak, measured on its device: the kernels' scratch decides, and the IR does
    not see it. The weight part runs first, so its outputs are held while the input part runs."""
    names = []
    for name in graph.splittable_convolution_backwards():
        node = graph.node(name)
        types = [graph.node(a.name).type for a in node.args[:3]]
        key = (repr(types), repr(node.args[3:]))
        if key not in _SPLIT_PEAKS:
            _SPLIT_PEAKS[key] = _measure_split(types, list(node.args[3:10]), node.args[10], node.type)
        fused, split = _SPLIT_PEAKS[key]
        if fused is not None and split < fused:
            names.append(name)
    return names


def _measure_split(types, params, mask, out_type):
    """(peak of the fused call, peak of the split pair) above their inputs, in bytes; (None, None) on a
    device without a way to measure here."""
    from .ir import _SHORT_DTYPE

    device = torch.device(types[0][4])
    go, x, w = (torch.empty_strided(t[2], t[3], dtype=_SHORT_DTYPE[t[1]], device=device).zero_() for t in types)
    op = torch.ops.aten.convolution_backward.default
    call = lambda m: lambda: op(go, x, w, *params, m)  # noqa: E731
    weight_out = sum(_numel(e) * _SHORT_DTYPE[e[1]].itemsize for e in out_type[1][1:] if e[0] == "tensor")
    fused = _call_peak(call(list(mask)), device)
    if fused is None:
        return None, None
    split = max(_call_peak(call([False, mask[1], mask[2]]), device),
                weight_out + _call_peak(call([True, False, False]), device))
    return fused, split


def _numel(t) -> int:
    n = 1
    for d in t[2]:
        n *= d
    return n


def _call_peak(fn, device):
    """The most bytes fn has allocated at once (its result included), after one warm-up call."""
    fn()
    if device.type == "cpu":
        return _running_peak(_compat.profile_memory_deltas(fn))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    return None


def _generators_kept(model) -> contextlib.ExitStack:
    """A context that puts torch's global generators (the CPU one, and those of the devices ``model``
    lives on) back as they were: the eager step it measures draws from them (dropout), and the
    user's next ``step.init_state()`` copies the CPU one, as an eager loop after ``torch.manual_seed``
    draws from it."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.random.fork_rng(devices=[]))
    devices: dict[str, set] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        if t.device.type not in ("cpu", "meta"):
            devices.setdefault(t.device.type, set()).add(0 if t.device.index is None else t.device.index)
    for kind, indices in devices.items():
        stack.enter_context(torch.random.fork_rng(devices=sorted(indices), device_type=kind))
    return stack


def _budget_bytes(step, memory_budget, plan):
    """memory_budget in bytes: an int is bytes, a float in (0, 1] a fraction of the measured eager peak."""
    if memory_budget is None:
        return None
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float)):
        raise TypeError(f"compile: memory_budget must be an int (bytes) or a float in (0, 1] (a fraction of the eager "
                        f"peak), got {memory_budget!r}")
    if not plan:
        raise ValueError("compile: memory_budget needs plan=True (recomputation is scheduled with the plan)")
    if isinstance(memory_budget, float):
        if not 0.0 < memory_budget <= 1.0:
            raise ValueError(f"compile: a float memory_budget is a fraction of the eager peak in (0, 1], got "
                             f"{memory_budget!r} (pass an int for bytes)")
        eager, _ = _eager_peak(step, step._example_batch)
        return max(int(memory_budget * eager), 1)
    if memory_budget <= 0:
        raise ValueError(f"compile: memory_budget must be positive, got {memory_budget} bytes")
    return int(memory_budget)


@dataclass
class MemoryReport:
    """Peak memory of one training step, in bytes, measured and planned side by side.

    ``lb_sched`` bounds any arena placement of the chosen order; ``lb_graph`` bounds every order
    and placement (both proven at ``graph_lower_bound`` in csrc/passes/plan_memory.cpp), so
    ``merged_planned >= lb_sched >= lb_graph``.
    """

    eager_peak: int
    separate_planned: int
    separate_parts: dict
    merged_unplanned: int
    merged_planned: int
    arena_bytes: int
    persistent_bytes: int
    dynamic_bytes: int
    lb_sched: int
    lb_graph: int
    aliases_applied: int
    aliases_refused: int
    refused_reasons: list = field(default_factory=list)
    schedule: str = ""
    candidates: dict = field(default_factory=dict)
    fallback_nodes: int = 0
    eager_timeline: list = field(default_factory=list, repr=False)
    planned_timeline: list = field(default_factory=list, repr=False)
    # memory_report(budgets=...): one dict per point (label, budget, planned_peak, measured_peak,
    # step_time_s, feasible, note): eager, checkpoint-per-block, the plan without a budget, each budget.
    pareto: list = field(default_factory=list)

    def ratios(self) -> dict:
        return {
            "planned/eager": self.merged_planned / self.eager_peak,
            "planned/separate": self.merged_planned / self.separate_planned,
            "arena/LB_sched(arena part)": (self.arena_bytes + self.dynamic_bytes) / max(self.lb_sched - self.persistent_bytes, 1),
            "planned/LB_graph": self.merged_planned / self.lb_graph,
        }

    def __str__(self) -> str:
        mib = lambda b: f"{b / 2**20:10.3f} MiB"  # noqa: E731
        rows = [
            ("eager step (measured, torch.profiler)", self.eager_peak),
            ("forward+backward+update planned separately", self.separate_planned),
            ("merged graph, unplanned (export order)", self.merged_unplanned),
            ("merged graph, planned (arena + state)", self.merged_planned),
            ("  of which arena", self.arena_bytes),
            ("  of which allocated by kernels (no out=)", self.dynamic_bytes),
            ("  of which persistent state and batch", self.persistent_bytes),
            ("lower bound LB_sched (chosen order)", self.lb_sched),
            ("lower bound LB_graph", self.lb_graph),
        ]
        lines = [f"{'peak memory of one training step':46} {'bytes':>12} {'':>14}"]
        lines += [f"{name:46} {value:12d} {mib(value)}" for name, value in rows]
        lines.append(f"schedule: {self.schedule}; in-place aliases applied {self.aliases_applied}, refused "
                     f"{self.aliases_refused}; {self.fallback_nodes} nodes without an out= variant")
        lines += [f"  {k}: {v:.3f}" for k, v in self.ratios().items()]
        return "\n".join(lines)

    def to_json(self) -> str:
        d = asdict(self)
        d.pop("eager_timeline")
        d.pop("planned_timeline")
        d["ratios"] = self.ratios()
        return json.dumps(d, indent=2)

    def plot_pareto(self, path: str) -> str:
        """PNG of measured peak against measured step time (memory_report(budgets=...)): the eager
        point, torch.utils.checkpoint per block, the plan and each budget, and the bounds."""
        if not self.pareto:
            raise ValueError("plot_pareto: this report has no Pareto points; call memory_report(step, batch, budgets=[...])")
        return _plot_pareto(self, path)

    def plot(self, path: str) -> str:
        """Live bytes over the step, eager (profiler timeline) and planned (schedule positions)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4))
        for series, label in ((self.eager_timeline, "eager torch.optim step"),
                              (self.planned_timeline, "torch_ext planned step")):
            if series:
                n = max(len(series) - 1, 1)
                ax.plot([i / n for i in range(len(series))], [b / 2**20 for b in series], label=label)
        ax.axhline(self.lb_graph / 2**20, color="gray", linestyle=":", label="LB_graph")
        ax.set_xlabel("progress through one training step (fraction of events / schedule positions)")
        ax.set_ylabel("live memory (MiB)")
        ax.set_title("peak memory: eager vs planned pure step")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path


def _plot_pareto(report, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    mib = 2 ** 20
    pts = [p for p in report.pareto if p["feasible"]]
    plans = [p for p in pts if p["label"].startswith(("planned", "budget"))]
    if plans:
        ax.plot([p["step_time_s"] * 1e3 for p in plans], [p["measured_peak"] / mib for p in plans], "o-",
                label="torch_ext planned (measured)")
        ax.plot([p["step_time_s"] * 1e3 for p in plans], [p["planned_peak"] / mib for p in plans], "x--",
                label="torch_ext planned (planned peak)")
        for p in plans:
            ax.annotate(p["label"], (p["step_time_s"] * 1e3, p["measured_peak"] / mib), fontsize=7)
    for p, marker in ((next((q for q in pts if q["label"] == "eager"), None), "s"),
                      (next((q for q in pts if q["label"] == "checkpoint per block"), None), "^")):
        if p:
            ax.plot([p["step_time_s"] * 1e3], [p["measured_peak"] / mib], marker, markersize=9, label=p["label"])
    ax.axhline(report.lb_graph / mib, color="gray", linestyle=":", label="LB_graph (no recomputation)")
    ax.axhline(report.persistent_bytes / mib, color="black", linestyle="-.", label="state + batch (any plan)")
    ax.set_xlabel("step time (ms, measured)")
    ax.set_ylabel("peak memory (MiB)")
    ax.set_title("memory / time Pareto front of one training step")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _checkpointed_loss(model, loss_fn):
    """loss_fn with torch.utils.checkpoint on every block of ``model`` (changed in place: pass a
    copy): the elements of its first ModuleList, or of its first Sequential each module with
    parameters together with the parameter-free ones after it (conv + relu)."""
    from torch.utils.checkpoint import checkpoint

    blocks = next((m for m in model.modules() if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential))), None)
    if blocks is None:
        return None
    if isinstance(blocks, torch.nn.ModuleList):
        for blk in blocks:
            blk.forward = (lambda f: (lambda *a, **k: checkpoint(f, *a, use_reentrant=False, **k)))(blk.forward)
        return loss_fn
    segments = []
    for m in blocks:
        if not segments or next(m.parameters(), None) is not None:
            segments.append([])
        segments[-1].append(m)

    def run(x, seg):
        for m in seg:
            x = m(x)
        return x

    def forward(x):
        for seg in segments:
            x = checkpoint(run, x, seg, use_reentrant=False)
        return x

    blocks.forward = forward
    return loss_fn


def _time_step(fn, n=2, rounds=3) -> float:
    import statistics
    import time

    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n)
    return statistics.median(out)


def _pareto(step, batch, budgets, eager_peak) -> list:
    import types

    points = []
    model, opts = copy.deepcopy((step.model, step.optimizers))

    def eager_one(m=model, o=opts, loss_fn=step.loss_fn):
        for x in o:
            x.zero_grad(set_to_none=True)
        loss = loss_fn(m, *batch)
        (loss[0] if isinstance(loss, (tuple, list)) else loss).backward()
        for x in o:
            x.step()

    points.append(dict(label="eager", budget=None, planned_peak=None, measured_peak=eager_peak,
                       step_time_s=_time_step(eager_one), feasible=True, note=""))
    cm, copts = copy.deepcopy((step.model, step.optimizers))
    if _checkpointed_loss(cm, step.loss_fn) is not None:
        peak, _ = _eager_peak(types.SimpleNamespace(model=cm, optimizers=copts, loss_fn=step.loss_fn), batch)
        points.append(dict(label="checkpoint per block", budget=None, planned_peak=None, measured_peak=peak,
                           step_time_s=_time_step(lambda: eager_one(cm, copts)), feasible=True, note=""))
    for b in [None] + list(budgets):
        label = "planned" if b is None else f"budget {b}"
        try:
            planned = step.compile(plan=True, donate=True, memory_budget=b)
        except ValueError as e:
            points.append(dict(label=label, budget=b, planned_peak=None, measured_peak=None, step_time_s=None,
                               feasible=False, note=str(e)))
            continue
        peak, state = measured_peak(planned, step.init_state(), batch)
        box = [state]

        def one():
            _, box[0] = planned(box[0], *batch)
        points.append(dict(label=label, budget=b, planned_peak=planned.peak_bytes, measured_peak=peak,
                           step_time_s=_time_step(one), feasible=True,
                           note=f"{len(planned.remat['recomputed'])} recomputed" if planned.remat else ""))
    return points


def measured_peak(planned: PlannedStep, state, batch) -> tuple[int, object]:
    """The peak bytes of one call of ``planned``, measured with the profiler as _eager_peak measures
    eager: the state and batch, the arena (allocated at compile), and the largest sum of the
    allocations the call makes (kernels without out=, escaping outputs). Returns (peak, new state)."""
    held = _tensor_bytes(planned.step.flat_inputs(state, *batch)) + planned.plan["arena_bytes"]
    out = []
    peak = _running_peak(_compat.profile_memory_deltas(lambda: out.append(planned(state, *batch))))
    return held + peak, out[0][1]


def _running_peak(deltas) -> int:
    """The largest running sum of allocation deltas (bytes), never below 0."""
    cur = peak = 0
    for d in deltas:
        cur += d
        peak = max(peak, cur)
    return peak


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _eager_peak(step, batch):
    with _generators_kept(step.model):  # the measured eager step draws dropout masks
        return _measure_eager_peak(step, batch)


def _measure_eager_peak(step, batch):
    model, opts = copy.deepcopy((step.model, step.optimizers))

    def one():
        for o in opts:
            o.zero_grad(set_to_none=True)
        loss = step.loss_fn(model, *batch)
        (loss[0] if isinstance(loss, (tuple, list)) else loss).backward()  # (loss, aux) too
        for o in opts:
            o.step()

    one()  # steady state: optimizer state exists, as in the pure step
    for o in opts:
        o.zero_grad(set_to_none=True)
    persistent = _tensor_bytes(list(model.parameters()) + list(model.buffers()) + list(batch))
    for o in opts:
        for st in o.state.values():
            persistent += _tensor_bytes(st.values())
    deltas = _compat.profile_memory_deltas(one)
    timeline, cur, peak = [persistent], 0, 0
    for d in deltas:
        cur += d
        peak = max(peak, cur)
        timeline.append(persistent + cur)
    return persistent + peak, timeline


def memory_report(step, batch, budgets=None) -> MemoryReport:
    """Measures the eager step's peak and plans the pure step several ways (see MemoryReport).

    With ``budgets`` (each an int in bytes or a float fraction of the eager peak, as
    ``step.compile(memory_budget=)``), also the Pareto front in ``report.pareto``: planned and
    measured peak against measured step time for the eager step, torch.utils.checkpoint on every
    block, the plan and each budget (an infeasible one is kept with its error); plot it with
    ``report.plot_pareto(path)``."""
    batch = tuple(batch)
    if budgets is not None and (isinstance(budgets, (str, bytes)) or not hasattr(budgets, "__iter__")):
        raise TypeError(f"memory_report: budgets must be a list of ints (bytes) or floats (fractions), got {budgets!r}")
    budgets = list(budgets) if budgets is not None else []
    for b in budgets:
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not (0 < b <= 1 if isinstance(b, float) else b > 0):
            raise ValueError(f"memory_report: each budget must be bytes (int > 0) or a fraction in (0, 1], got {b!r}")
    eager_peak, eager_timeline = _eager_peak(step, batch)
    planned = PlannedStep(step, plan=True, donate=True)
    plan = planned.plan
    unplanned = step.graph.plan_memory(donate=False)
    analysis = planned._ex.memory_analysis()  # phases, separate plans and timeline: C++ (memory_analysis.h)
    return MemoryReport(
        eager_peak=eager_peak, separate_planned=analysis["separate_planned"], separate_parts=analysis["separate_parts"],
        merged_unplanned=unplanned["lb_sched"], merged_planned=plan["peak_bytes"], arena_bytes=plan["arena_bytes"],
        persistent_bytes=plan["persistent_bytes"], dynamic_bytes=plan["dynamic_bytes"], lb_sched=plan["lb_sched"], lb_graph=plan["lb_graph"],
        aliases_applied=sum(1 for a in plan["aliases"] if a[1]),
        aliases_refused=sum(1 for a in plan["aliases"] if not a[1]),
        refused_reasons=[f"{a[0]}: {a[2]}" for a in plan["aliases"] if not a[1]],
        schedule=planned.schedule, candidates=dict(planned.candidates), fallback_nodes=len(planned.fallbacks),
        eager_timeline=eager_timeline, planned_timeline=analysis["timeline"],
        pareto=_pareto_keeping_generators(step, batch, budgets, eager_peak) if budgets else [])


def _pareto_keeping_generators(step, batch, budgets, eager_peak) -> list:
    with _generators_kept(step.model):  # its timed eager steps draw dropout masks too
        return _pareto(step, batch, budgets, eager_peak)

