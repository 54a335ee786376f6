"""torch-ext: pure training steps, memory plans and reactive sweeps from the command line.

MODEL is `package.module:factory` (importable from the current folder) or `path/to/file.py:factory`.
The factory takes no arguments and returns 4 or 5 items:
  model          an nn.Module
  optimizer      a torch.optim optimizer (or a list of them)
  loss_fn        loss_fn(model, *batch) -> scalar tensor
  example_batch  a tuple of loss_fn's batch arguments, e.g. (x, y)
  batches        optional: a list of such tuples to train on (cycled)
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import math
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERNAL = 3

EXIT_CODES_HELP = """exit status:
  0  ok
  1  a check failed (parity with eager, a non-finite loss or state, a memory budget; `check` and `demo`)
  2  usage or input error (bad option, MODEL not found, a factory or model that torch_ext refuses)
  3  internal error (a bug in torch_ext: rerun with --debug and report the traceback)
"""

STRICT_RTOL_REASON = "bit-exact expected: the pure step runs eager's kernels"

FACTORY_SHAPE = "(model, optimizer, loss_fn, example_batch[, batches])"
MODEL_HELP = "package.module:factory or path/to/file.py:factory, returning " + FACTORY_SHAPE


class UserError(Exception):
    """An input error reported as one line (exit 2), without a traceback unless --debug."""


# ---------------------------------------------------------------- output
_stdout_closed = False


def _out(text: str = "") -> None:
    """Prints to stdout; a reader that went away (`| head`) silences the rest instead of crashing."""
    global _stdout_closed
    if _stdout_closed:
        return
    try:
        print(text, flush=True)
    except BrokenPipeError:
        _silence_stdout()


def _silence_stdout() -> None:
    global _stdout_closed
    _stdout_closed = True
    # Point fd 1 at /dev/null so the interpreter's final flush cannot raise again.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _json_value(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None  # strict JSON has no NaN/Infinity
    if isinstance(v, (list, tuple)):
        return [_json_value(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _json_value(x) for k, x in v.items()}
    return v


def _flatten(d: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}: --json output keeps one level of keys."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _emit_json(d: dict) -> None:
    _out(json.dumps(_json_value(d), indent=2, allow_nan=False))


def _table(rows, header=None, indent: str = "") -> str:
    """Rows of cells as left-aligned text columns (numbers right-aligned)."""
    rows = [list(r) for r in rows]
    ncols = max((len(r) for r in rows), default=0)
    numeric = [all(isinstance(r[i], (int, float)) for r in rows if i < len(r)) for i in range(ncols)]
    rows = [[_cell(c) for c in r] for r in rows]
    if header:
        rows.insert(0, list(header))
    if not rows:
        return ""
    widths = [max(len(r[i]) for r in rows if i < len(r)) for i in range(max(len(r) for r in rows))]
    lines = []
    for r in rows:
        cells = [c.rjust(widths[i]) if numeric[i] else c.ljust(widths[i]) for i, c in enumerate(r)]
        lines.append(indent + "  ".join(cells).rstrip())
    return "\n".join(lines)


def _cell(c) -> str:
    if isinstance(c, float):
        return f"{c:.4g}" if math.isfinite(c) else str(c)
    return str(c)


class _Status:
    """One line on stderr per slow stage ("torch-ext: exporting ... done in 3.1 s"), TTY or not."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self._open = False  # a stage line is printed but not finished

    @contextlib.contextmanager
    def stage(self, what: str):
        if self.quiet:
            yield
            return
        t0 = time.perf_counter()
        print(f"torch-ext: {what} ...", end="", file=sys.stderr, flush=True)
        self._open = True
        # Warnings raised inside the stage are shown after its line, not in the middle of it.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            try:
                yield
            except BaseException:
                self.abort()
                _replay(caught)
                raise
        self._open = False
        print(f" done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        _replay(caught)

    def abort(self) -> None:
        """Ends an unfinished stage line, so that an error message starts on a line of its own."""
        if self._open:
            self._open = False
            print(" failed", file=sys.stderr, flush=True)


def _replay(caught) -> None:
    for w in caught:
        warnings.showwarning(w.message, w.category, w.filename, w.lineno)


def _bars(args) -> bool:
    """Progress bars only on a terminal; elsewhere they would print one line per update."""
    return not args.no_progress and sys.stderr.isatty()


@contextlib.contextmanager
def _stage_unless_bar(args, what: str):
    """A status line for a loop that draws its own bar on a terminal (the two would share one line)."""
    if _bars(args):
        yield
        return
    with args.status.stage(what):
        yield


def _loop(iterable, total: int, args, desc: str):
    """A progress bar on a terminal; otherwise one status line for the whole loop."""
    if _bars(args):
        from tqdm import tqdm

        yield from tqdm(iterable, total=total, desc=desc, leave=False)
        return
    with args.status.stage(f"{desc} ({total} iterations)"):
        yield from iterable


# ---------------------------------------------------------------- MODEL
def _import_model_module(target: str):
    if target.endswith(".py") or "/" in target or os.sep in target:
        path = Path(target).expanduser()
        if not path.is_file():
            raise UserError(f"MODEL file {str(path)!r} does not exist")
        path = path.resolve()
        # Siblings of the file are importable from it, as when running `python path/to/file.py`.
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))
        name = f"_torch_ext_model_{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise UserError(f"cannot load {str(path)!r} as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[name]
            raise UserError(f"running {str(path)!r} failed: {type(e).__name__}: {e}") from e
        return module
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        if e.name == target or target.startswith(f"{e.name}."):
            raise UserError(f"cannot import {target!r} from {os.getcwd()}: {e}; give a file path instead "
                            f"(path/to/{target.replace('.', '/')}.py:factory)") from e
        raise UserError(f"importing {target!r} failed: {e}") from e
    except Exception as e:
        raise UserError(f"importing {target!r} failed: {type(e).__name__}: {e}") from e


def load_factory(spec: str):
    """Resolves MODEL, calls the factory and checks what it returned."""
    import torch

    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise UserError(f"MODEL must look like package.module:factory or path/to/file.py:factory, got {spec!r}")
    obj = _import_model_module(target)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UserError(f"{target!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UserError(f"{spec} is a {type(obj).__name__}, not a factory function")
    try:
        out = obj()
    except Exception as e:
        raise UserError(f"the factory {spec} raised {type(e).__name__}: {e}") from e
    if not isinstance(out, (tuple, list)):
        raise UserError(f"{spec} must return 4 or 5 items {FACTORY_SHAPE}, got a single {type(out).__name__}")
    if len(out) not in (4, 5):
        got = ", ".join(type(x).__name__ for x in out)
        raise UserError(f"{spec} returned {len(out)} items ({got}); expected 4 or 5: {FACTORY_SHAPE}")
    model, opt, loss_fn, example = out[:4]
    if not isinstance(model, torch.nn.Module):
        raise UserError(f"{spec}: item 1 (model) must be an nn.Module, got {type(model).__name__}")
    opts = opt if isinstance(opt, (list, tuple)) else [opt]
    if not opts or not all(isinstance(o, torch.optim.Optimizer) for o in opts):
        raise UserError(f"{spec}: item 2 (optimizer) must be a torch.optim.Optimizer or a list of them, "
                        f"got {type(opt).__name__}")
    if not callable(loss_fn):
        raise UserError(f"{spec}: item 3 (loss_fn) must be callable as loss_fn(model, *batch), "
                        f"got {type(loss_fn).__name__}")
    if not isinstance(example, (tuple, list)):
        raise UserError(f"{spec}: item 4 (example_batch) must be a tuple of loss_fn's batch arguments, e.g. (x, y), "
                        f"got {type(example).__name__}")
    batches = None
    if len(out) == 5:
        try:
            batches = list(out[4])
        except TypeError as e:
            raise UserError(f"{spec}: item 5 (batches) must be a list of batch tuples, "
                            f"got {type(out[4]).__name__}") from e
        if not batches:
            raise UserError(f"{spec}: item 5 (batches) is empty; return 4 items to train on example_batch")
        for i, b in enumerate(batches):
            if not isinstance(b, (tuple, list)):
                raise UserError(f"{spec}: batches[{i}] must be a tuple like example_batch, got {type(b).__name__}")
    return model, opt, loss_fn, tuple(example), batches


def _batches(example, batches, n):
    if batches:
        return [tuple(batches[i % len(batches)]) for i in range(n)]
    return [example] * n


def _num_ops(step) -> int:
    return sum(1 for n in step.graph.nodes() if n.kind == "call")


# ---------------------------------------------------------------- plots
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def memory_figure(report, title: str):
    """Live bytes over one step, eager vs planned, with the bounds named in the legend (outside the data)."""
    plt = _pyplot()
    top = max([report.eager_peak, report.merged_planned, report.lb_graph, report.lb_sched, 1])
    unit, scale = ("MiB", 2**20) if top >= 2**20 else ("KiB", 2**10)
    fig, ax = plt.subplots(figsize=(10, 4.2))
    for series, label in ((report.eager_timeline, f"eager step, measured (peak {report.eager_peak / scale:.1f} {unit})"),
                          (report.planned_timeline,
                           f"torch_ext planned step (peak {report.merged_planned / scale:.1f} {unit})")):
        if series:
            n = max(len(series) - 1, 1)
            ax.plot([100 * i / n for i in range(len(series))], [b / scale for b in series], label=label,
                    linewidth=1.4)
    ax.axhline(report.lb_graph / scale, color="gray", linestyle=":",
               label="LB_graph: lower bound for any order\n(state, batch, and what every order holds at once)")
    ax.axhline(report.lb_sched / scale, color="black", linestyle="--", linewidth=0.8,
               label="LB_sched: lower bound for the chosen order")
    ax.set_xlabel("progress through one training step (% of profiler events / schedule positions)")
    ax.set_ylabel(f"live memory ({unit})")
    ax.set_ylim(0, 1.12 * top / scale)
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0, fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def sweep_figure(result, title: str, row_labels: dict | None = None, key_name: str = "position",
                 baseline: float | None = None):
    """Node x key heatmap when sites carry a key (e.g. a position); a bar per node otherwise: the
    figure of ``SweepResult.figure``, with the colour scale centred on ``baseline`` (the unpatched run)."""
    _pyplot()
    return result.figure(title, row_labels or {}, key_name, baseline)


def _save(fig, path: str) -> str:
    plt = _pyplot()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------- demo
def _one_content_check(command):
    """A command is one call chain: nothing writes the model between its reads, so each graph compares the
    weights by content once in it (reactive._one_check_per_call), not again at every demand, value and sweep
    (a pass over every weight byte each time: ~20 ms on GPT-2 small)."""
    def checked_once(args) -> int:
        from .reactive import _one_check_per_call

        with _one_check_per_call():
            return command(args)
    checked_once.__name__, checked_once.__doc__ = command.__name__, command.__doc__
    return checked_once


@_one_content_check
def _demo(args) -> int:
    import torch
    import torch.nn.functional as F

    import torch_ext
    from torch_ext.models import TinyTransformer
    from torch_ext.testing import step_parity

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    torch.manual_seed(0)
    vocab, seq, batch, d_model = 64, 16, 8, 32
    model = TinyTransformer(vocab=vocab, d_model=d_model, n_heads=4, n_layers=2, seq=seq)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)

    def loss_fn(m, idx, tgt):
        return F.cross_entropy(m(idx).reshape(-1, vocab), tgt.reshape(-1))

    # Synthetic task: predict the next token of a repeating pattern.
    g = torch.Generator().manual_seed(0)

    def make_batch():
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        idx = (start + torch.arange(seq + 1) * 3) % vocab
        return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()

    batches = [make_batch() for _ in range(args.steps)]
    _out("torch-ext demo: tiny transformer (2 blocks, d_model 32, 4 heads, seq 16, vocab 64), AdamW, synthetic data")

    # 1. the pure step
    t0 = time.perf_counter()
    with args.status.stage("building the pure step (torch.export of the joint forward/backward graph)"):
        step = torch_ext.make_train_step(model, opt, loss_fn, batches[0])
    _out(f"[1/4] pure step built in {time.perf_counter() - t0:.1f} s: one graph of {_num_ops(step)} ops, "
         f"{len(step.state_names)} state tensors in and out, lr and step count as inputs")

    # 2. training
    state = step.init_state()
    losses = []
    for b in _loop(batches, len(batches), args, "training on the C++ executor"):
        loss, state = step(state, *b)
        losses.append(float(loss))
    _out(f"[2/4] trained {len(batches)} steps on the C++ executor: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    n_parity = min(20, len(batches))
    with args.status.stage(f"replaying {n_parity} steps with eager torch.optim"):
        parity = step_parity(model, opt, loss_fn, batches[:n_parity])
    _out(f"      parity with eager torch.optim over {parity['steps']} steps: max relative difference "
         f"loss {parity['loss']:.3g}, state {parity['state']:.3g}")

    # 3. memory
    with args.status.stage("measuring the eager peak and planning the pure step"):
        report = torch_ext.memory_report(step, batches[0])
    _out("[3/4] memory report")
    _out("\n".join("      " + line for line in str(report).splitlines()))
    timeline = _save(memory_figure(report, "Live memory during one AdamW step of the demo transformer:\n"
                                           "eager torch.optim vs the torch_ext planned pure step"),
                     str(out_dir / "demo_memory_timeline.png"))
    _out(f"      wrote {timeline}")

    # 4. reactive residual-stream patching sweep
    step.write_back(state)
    model.eval()
    clean = batches[0][0][:1]
    corrupt = clean.clone()
    corrupt[0, 3] = (corrupt[0, 3] + 7) % vocab
    with args.status.stage("exporting the model for the reactive engine"):
        rg = torch_ext.ReactiveGraph(model, (corrupt,))
    adds = rg.values(rg.nodes("add*"))  # the weights are compared by content once, not once per node
    resid = [n for n, v in adds.items() if tuple(v.shape) == (1, seq, d_model)]
    corrupted = {n: adds[n].clone() for n in resid}
    del adds  # the engine reuses a value's buffer only while it holds the sole reference
    rg.run(clean)
    target = int(batches[0][1][0, -1])
    sites = [(n, p) for n in resid for p in range(seq)]

    def patch(clean_value, site):
        v = clean_value.clone()
        v[:, site[1]] = corrupted[site[0]][:, site[1]]
        return v

    def metric(logits):
        return float(logits[0, -1, target] - logits[0, -1].mean())

    clean_metric = metric(rg.demand())
    with _stage_unless_bar(args, f"reactive sweep over {len(sites)} sites"):
        result = torch_ext.sweep(rg, sites, patch, metric, progress=_bars(args))
    rows = _residual_labels(rg, resid)
    heat = _save(sweep_figure(result, "Activation patching: logit difference of the target token when one position "
                                      "of a residual stream\ncomes from the corrupted run (token 3 changed)",
                              rows, "token position", clean_metric),
                 str(out_dir / "demo_sweep_heatmap.png"))
    _out(f"[4/4] reactive sweep over {len(resid)} residual nodes x {seq} positions = {len(sites)} sites")
    _out(f"      evaluations: measured {result.measured_evaluations}, predicted from cones "
         f"{result.predicted_evaluations}, full recomputation {result.full_evaluations}")
    _out(f"      rho = {result.rho:.3f} predicted, {result.rho_measured:.3f} measured; "
         f"sweep took {result.wall_time * 1e3:.0f} ms")
    _out(f"      wrote {heat}")
    _out(f"done in {time.perf_counter() - t_start:.1f} s")
    # As `check` by default: bit-exact (rtol 0) and finite; a NaN step matched eager NaN for NaN and passed.
    ok = (not parity["nonfinite"] and not parity["nonfinite_state"] and parity["loss"] == 0 and parity["state"] == 0
          and result.measured_evaluations == result.predicted_evaluations)
    return EXIT_OK if ok else EXIT_CHECK_FAILED


def _residual_labels(rg, resid: list) -> dict:
    """'add_1 (after blocks.0.attn.proj)': a residual add named by the module that wrote into it."""
    info = {n.name: n for n in rg.graph.nodes()}
    labels = {}
    for n in resid:
        args = [str(a).lstrip("%") for a in info[n].args]
        if not any(a in resid for a in args):
            labels[n] = f"{n} (embeddings)"
            continue
        writer = next((info[a].module_path for a in args if a not in resid and a in info), "")
        labels[n] = f"{n} (after {writer})" if writer else n
    return labels


# ---------------------------------------------------------------- step / plan / sweep / check
def _build_step(args, model, opt, loss_fn, example, unroll: int = 1):
    import torch_ext

    with args.status.stage("building the pure step (torch.export of the joint forward/backward graph)"):
        return torch_ext.make_train_step(model, opt, loss_fn, example, unroll=unroll)


def _check_step_args(args) -> None:
    """Refuses option combinations of `step` before anything is built or launched."""
    if args.shard_optimizer_state and args.nproc < 2:
        raise UserError(f"--shard-optimizer-state shards the optimizer state across ranks: it needs --nproc 2 or "
                        f"more, got --nproc {args.nproc}")
    exports = [f"--{o}" for o in ("export", "aoti", "onnx") if getattr(args, o)]
    if args.nproc > 1 and exports:
        raise UserError(f"--nproc {args.nproc} trains data-parallel; {', '.join(exports)} exports the one-process step: "
                        "run them without --nproc")
    if args.onnx:
        path = Path(args.onnx).expanduser()
        if path.suffix != ".onnx":
            raise UserError(f"--onnx {args.onnx!r}: the file name must end in .onnx")
        if not path.resolve().parent.is_dir():
            raise UserError(f"--onnx {args.onnx!r}: folder {str(path.resolve().parent)!r} does not exist")


def _launch_ranks(args) -> int:
    """`step --nproc N` outside torchrun: runs the same command on N local ranks through torchrun."""
    import subprocess

    # torchrun would take --nproc (a prefix of its --nproc-per-node) as its own option: the ranks get
    # the same command line with the alias --world-size.
    argv, it = [], iter(args.argv)
    for a in it:
        if a == "--nproc":
            next(it, None)
        elif not a.startswith("--nproc="):
            argv.append(a)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           "-m", "torch_ext", *argv, f"--world-size={args.nproc}"]
    if not args.quiet:
        print(f"torch-ext: launching {args.nproc} ranks through torchrun (gloo, this machine)", file=sys.stderr,
              flush=True)
    # The ranks run the same command line (torch-ext step ... --nproc N) and see torchrun's WORLD_SIZE.
    return subprocess.run(cmd).returncode


def _step_rank(args, model, opt, loss_fn, example, batches) -> int:
    """One rank of `step --nproc N` under torchrun: the data-parallel pure step on this rank's batches."""
    import torch
    import torch.distributed as dist

    import torch_ext
    from torch_ext.distributed import assert_states_in_sync

    world = int(os.environ["WORLD_SIZE"])
    if world != args.nproc:
        raise UserError(f"--nproc {args.nproc} but torchrun started {world} ranks (WORLD_SIZE); make them agree")
    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        if rank != 0:  # rank 0 reports for everyone
            args.status = _Status(True)
        with args.status.stage(f"building the data-parallel pure step on {world} ranks"):
            step = torch_ext.make_train_step(model, opt, loss_fn, example, unroll=args.unroll,
                                             process_group=dist.group.WORLD,
                                             shard_optimizer_state=args.shard_optimizer_state)
        state = step.init_state()
        per = _batches(example, batches, args.steps * args.unroll * world)
        losses = []
        for i in _loop(range(args.steps), args.steps, args, f"training on {world} ranks (C++ executor, gloo)"):
            mine = per[(i * world + rank) * args.unroll:(i * world + rank + 1) * args.unroll]
            loss, state = step(state, *[t for b in mine for t in b])
            losses.append(loss.detach().reshape(-1).double())
        assert_states_in_sync(state)
        mean = [0.0]
        if losses:  # the loss averaged over the ranks, as DDP's gradients are
            total = torch.cat(losses)
            dist.all_reduce(total)
            mean = (total / world).tolist()
        step.write_back(state)  # a collective with sharded optimizer state
        opt_bytes = sum(v.numel() * v.element_size() for v in state.opt.values())
        if rank != 0:
            return EXIT_OK
        summary = {"model": args.model, "ranks": world, "ops": _num_ops(step), "state_entries": len(step.state_names),
                   "unroll": args.unroll, "steps": args.steps, "shard_optimizer_state": args.shard_optimizer_state,
                   "optimizer_state_bytes_per_rank": opt_bytes, "states_in_sync": True,
                   "losses": mean if losses else []}
        if losses:
            summary["loss_first"], summary["loss_last"] = mean[0], mean[-1]
        if args.json:
            _emit_json(summary)
            return EXIT_OK
        rows = [("model", args.model),
                ("pure step", f"{summary['ops']} ops, gradients all-reduced inside the graph on {world} ranks (gloo)"
                              + (", optimizer state sharded (ZeRO-1)" if args.shard_optimizer_state else "")),
                ("optimizer state", f"{opt_bytes} bytes per rank")]
        if losses:
            rows.append(("trained", f"{args.steps} steps, mean loss over ranks {mean[0]:.4f} -> {mean[-1]:.4f}"))
        rows.append(("states", f"identical on all {world} ranks"))
        _out(_table(rows))
        return EXIT_OK
    finally:
        dist.destroy_process_group()


def _step(args) -> int:
    import torch

    _check_step_args(args)
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        load_factory(args.model)  # a bad MODEL is reported here (exit 2), not by every rank
        return _launch_ranks(args)
    model, opt, loss_fn, example, batches = load_factory(args.model)
    if args.nproc > 1:
        return _step_rank(args, model, opt, loss_fn, example, batches)
    step = _build_step(args, model, opt, loss_fn, example, args.unroll)
    summary = {"model": args.model, "ops": _num_ops(step), "state_entries": len(step.state_names),
               "unroll": args.unroll, "steps": args.steps, "losses": []}
    state = None
    if args.steps:
        state = step.init_state()
        per = _batches(example, batches, args.steps * args.unroll)
        for i in _loop(range(args.steps), args.steps, args, "training on the C++ executor"):
            flat = [t for b in per[i * args.unroll:(i + 1) * args.unroll] for t in b]
            loss, state = step(state, *flat)
            summary["losses"].extend(float(x) for x in loss.reshape(-1))  # unroll N: N losses per call
        step.write_back(state)
        summary["loss_first"], summary["loss_last"] = summary["losses"][0], summary["losses"][-1]
    if args.export or args.aoti:
        with args.status.stage("exporting the pure step" + (f" to {args.export}" if args.export else "")):
            program = step.program
            if state is not None:
                # The program takes the state as inputs: ship the trained state as its example inputs.
                program.example_inputs = (tuple(step.flat_inputs(state, *(example * args.unroll))), {})
            if args.export:
                torch.export.save(program, args.export)
                summary["export"] = args.export
    if args.aoti:
        with args.status.stage(f"compiling with AOTInductor into {args.aoti} (a minute or more)"):
            summary["aoti"] = step.to_aoti(args.aoti)  # the flat layout in its metadata (torch_ext.load_step)
    if args.onnx:
        with args.status.stage(f"exporting the pure step to ONNX into {args.onnx}"):
            summary["onnx"] = step.to_onnx(args.onnx)
    if args.json:
        _emit_json(summary)
        return EXIT_OK
    rows = [("model", args.model),
            ("pure step", f"{summary['ops']} ops, {summary['state_entries']} state tensors in and out"
                          + (f", {args.unroll} steps per call" if args.unroll > 1 else ""))]
    if summary["losses"]:
        rows.append(("trained", f"{len(summary['losses'])} steps, loss {summary['loss_first']:.4f} -> "
                                f"{summary['loss_last']:.4f}"))
    if "export" in summary:
        rows.append(("exported", f"{summary['export']} (the trained state is its example_inputs)"
                                 if state is not None else summary["export"]))
    if "aoti" in summary:
        rows.append(("AOTInductor", summary["aoti"]))
    if "onnx" in summary:
        rows.append(("ONNX", f"{summary['onnx']} (trains in onnxruntime: torch_ext.load_step)"))
    _out(_table(rows))
    return EXIT_OK


def _plan(args) -> int:
    import torch_ext

    model, opt, loss_fn, example, _ = load_factory(args.model)
    step = _build_step(args, model, opt, loss_fn, example)
    with args.status.stage("measuring the eager peak and planning the pure step"):
        report = torch_ext.memory_report(step, example)
    if args.plot:
        _save(memory_figure(report, f"Live memory during one training step of {args.model}:\n"
                                    f"eager torch.optim vs the torch_ext planned pure step"),
              args.plot)
    if args.json:
        d = json.loads(report.to_json())
        d["model"] = args.model
        _emit_json(_flatten(d))
    else:
        _out(str(report))
        if args.plot:
            _out(f"wrote {args.plot}")
    return EXIT_OK


def _select_output(out, key: str | None):
    """The output tensor the metric reads: the only tensor, or the one named by --output."""
    import torch
    import torch.utils._pytree as pytree

    if isinstance(out, torch.Tensor) and key is None:
        return out, "output"
    leaves, _ = pytree.tree_flatten_with_path(out)
    named = {pytree.keystr(p).strip("[]'\"."): v for p, v in leaves if isinstance(v, torch.Tensor)}
    if key is not None:
        if key not in named:
            raise UserError(f"--output {key!r} is not an output of the model; outputs: {_describe(named)}")
        return named[key], key
    if len(named) == 1:
        (k, v), = named.items()
        return v, k
    raise UserError(f"the model returns {type(out).__name__} with {len(named)} tensors ({_describe(named)}); "
                    f"choose the one the metric reads with --output KEY")


def _describe(named: dict) -> str:
    return ", ".join(f"{k} {list(v.shape)}" for k, v in named.items())


@_one_content_check
def _sweep(args) -> int:
    import torch

    import torch_ext

    model, _, _, example, _ = load_factory(args.model)
    model.eval()
    if not example or not isinstance(example[0], torch.Tensor):
        raise UserError("sweep feeds example_batch[0] to the model: it must be a tensor")
    with args.status.stage("exporting the model for the reactive engine"):
        rg = torch_ext.ReactiveGraph(model, (example[0],))
    info = {n.name: n for n in rg.graph.nodes()}
    # One content check of the weights for every node (rg.value per node paid it per node: ~20 ms each on
    # GPT-2 small). Shapes only: a value held here would keep the engine from reusing its buffer.
    shapes = {n: tuple(v.shape) for n, v in rg.values(rg.nodes(args.sites)).items() if isinstance(v, torch.Tensor)}
    nodes = list(shapes)
    if not nodes:
        raise UserError(f"no tensor node matches --sites {args.sites!r}; list them with "
                        f"`torch-ext sweep {args.model} --list`")
    if args.list:
        rows = [(n, info[n].module_path or "-", info[n].target, "x".join(map(str, shapes[n])) or "scalar",
                 len(rg.cone(n))) for n in nodes]
        if args.json:
            _emit_json({"sites": [dict(zip(("node", "module_path", "op", "shape", "cone"), r)) for r in rows]})
        else:
            _out(_table(rows, ("node", "module path", "op", "shape", "cone (nodes recomputed)")))
        return EXIT_OK
    _, out_name = _select_output(rg.demand(), args.output)
    kind, _, arg = args.metric.partition(":")
    if kind == "norm" and not arg:
        def metric(out):
            return float(_select_output(out, args.output)[0].float().norm())
    elif kind == "logit":
        try:
            idx = int(arg)
        except ValueError:
            raise UserError(f"--metric logit:IDX needs an integer IDX, got {args.metric!r}") from None
        t = _select_output(rg.demand(), args.output)[0]
        if t.dim() == 0 or not -t.shape[-1] <= idx < t.shape[-1]:
            raise UserError(f"--metric {args.metric}: output {out_name!r} has shape {list(t.shape)}, "
                            f"no index {idx} in its last dimension")

        def metric(out):
            o = _select_output(out, args.output)[0]
            return float(o.reshape(-1, o.shape[-1])[-1, idx])
    else:
        raise UserError(f"--metric must be norm or logit:IDX, got {args.metric!r}")
    if args.positions:
        bad = [n for n in nodes if len(shapes[n]) < 2]
        if bad:
            raise UserError(f"--positions patches dimension 1 ([batch, position, ...]); {', '.join(bad)} has fewer "
                            f"than 2 dimensions: narrow --sites")
        sites = [(n, p) for n in nodes for p in range(shapes[n][1])]
    else:
        sites = nodes

    def patch(clean, site):
        if not args.positions:
            return torch.zeros_like(clean) if args.patch == "zero" else clean.mean().expand_as(clean).clone()
        v = clean.clone()
        v[:, site[1]] = 0 if args.patch == "zero" else clean.mean(dim=(0, 1))
        return v

    clean_metric = metric(rg.demand())
    what = f"reactive sweep over {len(sites)} sites"
    if args.batched:
        what += " (batched: first builds each node's cone once per site count)"
    with _stage_unless_bar(args, what):
        result = torch_ext.sweep(rg, sites, patch, metric, progress=_bars(args), batch_sites=args.batched,
                                 positions=not args.no_positions)
    labels = {n: f"{n} ({info[n].module_path or '-'})" for n in nodes}
    if args.plot:
        what = f"{args.patch}-ablation of {'one position of ' if args.positions else ''}each node"
        _save(sweep_figure(result, f"{args.model}: {args.metric} of {out_name!r} after {what}", labels,
                           "position (dimension 1)", clean_metric), args.plot)
    records = [{"node": s[0] if isinstance(s, tuple) else s,
                "module_path": info[s[0] if isinstance(s, tuple) else s].module_path,
                **({"position": s[1]} if isinstance(s, tuple) else {}), "metric": v}
               for s, v in result.metrics.items()]
    if args.json:
        _emit_json({"model": args.model, "metric": args.metric, "output": out_name, "patch": args.patch,
                    "unpatched_metric": clean_metric, "sites": len(records), "measured_evaluations": result.measured_evaluations,
                    "predicted_evaluations": result.predicted_evaluations,
                    "full_evaluations": result.full_evaluations, "rho": result.rho, "wall_time_s": result.wall_time,
                    "row_evaluations": result.extra.get("row_evaluations"), "flops": result.cost,
                    **({"plot": args.plot} if args.plot else {}), "metrics": records})
        return EXIT_OK
    if args.positions:
        positions = sorted({r["position"] for r in records})
        grid = {(r["node"], r["position"]): r["metric"] for r in records}
        _out(_table([[labels[n]] + [grid[(n, p)] for p in positions] for n in nodes],
                    ["node (module path)"] + [str(p) for p in positions]))
    else:
        _out(_table([(r["node"], r["module_path"] or "-", r["metric"]) for r in records],
                    ("node", "module path", f"{args.metric} of {out_name}")))
    _out(f"unpatched run: {clean_metric:.4g}")
    _out(result.summary())
    if args.plot:
        _out(f"wrote {args.plot}")
    return EXIT_OK


def _check(args) -> int:
    import torch_ext
    from torch_ext.testing import step_parity

    model, opt, loss_fn, example, batches = load_factory(args.model)
    # The pure step runs eager's own kernels on the executor, so it matches eager bit for bit: any
    # difference is a defect (a 1-ulp drift per step passed the former default rtol 1e-5 silently).
    rtol = 0.0 if args.rtol is None else args.rtol
    why = (STRICT_RTOL_REASON if args.rtol is None else "given by --rtol")
    report = {"model": args.model, "steps": args.steps, "rtol": rtol, "rtol_reason": why}
    failures = []
    with args.status.stage(f"running {args.steps} steps pure and eager side by side"):
        parity = step_parity(model, opt, loss_fn, _batches(example, batches, args.steps))
    report.update({"parity_steps": parity["steps"], "loss_rel": parity["loss"], "state_rel": parity["state"],
                   "worst_entry": parity["worst_entry"], "nonfinite": parity["nonfinite"],
                   "nonfinite_state": parity["nonfinite_state"] or None})
    if parity["nonfinite"]:
        failures.append(f"non-finite loss at step {parity['steps']}")
    elif parity["nonfinite_state"]:
        failures.append(f"non-finite state after step {parity['steps']}: {parity['nonfinite_state']} (finite before "
                        "training; every loss was finite)")
    elif parity["loss"] > rtol or parity["state"] > rtol:
        failures.append(f"parity: loss rel {parity['loss']:.3g}, state rel {parity['state']:.3g} "
                        f"({parity['worst_entry']}) exceed rtol {rtol:g} ({why})")
    if args.max_peak_bytes is not None:
        step = _build_step(args, model, opt, loss_fn, example)
        with args.status.stage("planning memory"):
            mem = torch_ext.memory_report(step, example)
        report["planned_peak_bytes"] = mem.merged_planned
        report["max_peak_bytes"] = args.max_peak_bytes
        if mem.merged_planned > args.max_peak_bytes:
            failures.append(f"planned peak {mem.merged_planned} bytes exceeds the budget of "
                            f"{args.max_peak_bytes} bytes")
    report["ok"] = not failures
    report["failures"] = failures
    if args.json:
        _emit_json(report)
    else:
        rows = [("parity steps", parity["steps"]),
                ("loss rel. difference", f"{parity['loss']:.3g}"),
                ("state rel. difference", f"{parity['state']:.3g}" + (f" ({parity['worst_entry']})"
                                                                     if parity["worst_entry"] else "")),
                ("rtol", f"{rtol:g} ({why})")]
        if "planned_peak_bytes" in report:
            rows.append(("planned peak", f"{report['planned_peak_bytes']} bytes (budget {args.max_peak_bytes})"))
        _out(f"check {args.model}: {'OK' if report['ok'] else 'FAILED'}")
        _out(_table(rows, indent="  "))
        for f in failures:
            _out(f"  FAIL: {f}")
    return EXIT_OK if report["ok"] else EXIT_CHECK_FAILED


# ---------------------------------------------------------------- arguments
def _int_at_least(lo: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v

    parse.__name__ = f"integer >= {lo}"
    return parse


def _nonnegative_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="torch-ext", description=__doc__, epilog=EXIT_CODES_HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    common.add_argument("--no-progress", action="store_true",
                        help="no progress bars (shown only on a terminal; otherwise one status line per stage)")
    common.add_argument("--quiet", action="store_true", help="no status lines on stderr")
    sub = p.add_subparsers(dest="command", required=True)

    def add(name, help_text, fn):
        sp = sub.add_parser(name, parents=[common], help=help_text, description=help_text, epilog=EXIT_CODES_HELP,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        sp.set_defaults(fn=fn)
        return sp

    d = add("demo", "the main job on a built-in tiny transformer (no files, no network)", _demo)
    d.add_argument("--steps", metavar="N", type=_int_at_least(1), default=50, help="training steps (>= 1, default 50)")
    d.add_argument("--out", default="torch_ext_demo", help="folder for the PNG files (default torch_ext_demo)")

    s = add("step", "build (and train) the pure training step for MODEL", _step)
    s.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    s.add_argument("--steps", metavar="N", type=_int_at_least(0), default=0, help="train N steps on the factory's batches (default 0)")
    s.add_argument("--export", metavar="OUT.pt2",
                   help="torch.export.save the pure step; after --steps its example_inputs hold the trained state")
    s.add_argument("--aoti", metavar="OUT.pt2", help="compile with AOTInductor into this package (a minute or more); "
                                                     "it holds no state: add --export for the trained state")
    s.add_argument("--unroll", metavar="N", type=_int_at_least(1), default=1, help="optimizer steps per graph call (default 1)")
    s.add_argument("--onnx", metavar="OUT.onnx", help="export the pure step (update included) to ONNX")
    s.add_argument("--nproc", "--world-size", metavar="N", dest="nproc", type=_int_at_least(1), default=1,
                   help="data-parallel on N local ranks through torchrun (gloo): gradients all-reduced inside the "
                        "graph, each rank on its own batches (default 1); under your own torchrun, pass "
                        "--world-size N")
    s.add_argument("--shard-optimizer-state", action="store_true",
                   help="with --nproc: each rank keeps 1/N of the optimizer state (ZeRO-1)")
    s.add_argument("--json", action="store_true", help="one flat JSON object on stdout")

    pl = add("plan", "memory report for MODEL's pure step", _plan)
    pl.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    pl.add_argument("--plot", metavar="TIMELINE.png", help="live memory over the step, eager vs planned")
    pl.add_argument("--json", action="store_true", help="one flat JSON object on stdout")

    sw = add("sweep", "reactive ablation sweep over MODEL's nodes (input: example_batch[0])", _sweep)
    sw.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    sw.add_argument("--sites", default="*", help="glob over node names or module paths (default *)")
    sw.add_argument("--metric", default="norm", help="norm | logit:IDX (last row of the output) (default norm)")
    sw.add_argument("--output", metavar="KEY", help="which output the metric reads when the model returns a dict "
                                                    "or tuple (a key or an index)")
    sw.add_argument("--patch", choices=("zero", "mean"), default="zero", help="ablation (default zero)")
    sw.add_argument("--positions", action="store_true",
                    help="one site per (node, position along dimension 1): a layer x position grid")
    sw.add_argument("--batched", action="store_true",
                    help="evaluate the sites of one node together in a batched graph (with --positions; "
                         "the model's outputs must be batch-major)")
    sw.add_argument("--no-positions", action="store_true",
                    help="turn token-granular cones off: recompute whole nodes, not only the rows a patch changes")
    sw.add_argument("--plot", metavar="HEATMAP.png", help="heatmap (with --positions) or bar chart of the metric")
    sw.add_argument("--json", action="store_true", help="one JSON object on stdout")
    sw.add_argument("--list", action="store_true", help="list the matching sites with module paths, and exit")

    c = add("check", "CI check: parity with eager over N steps and a peak-memory budget; exits 1 when it fails",
            _check)
    c.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    c.add_argument("--steps", metavar="N", type=_int_at_least(1), default=10, help="steps to compare (>= 1, default 10)")
    c.add_argument("--rtol", metavar="R", type=_nonnegative_float, default=None,
                   help="relative tolerance (>= 0; default 0: the pure step is bit-exact with eager, which runs "
                        "the same kernels)")
    c.add_argument("--max-peak-bytes", metavar="B", type=_int_at_least(1), help="fail if the planned peak exceeds this")
    c.add_argument("--json", action="store_true", help="one flat JSON object on stdout")
    return p


def _is_input_error(e: BaseException) -> bool:
    """Errors torch_ext raises for inputs it refuses (its convention: ValueError/TypeError) or export refuses."""
    if isinstance(e, (ValueError, TypeError, NotImplementedError)):
        return True
    try:
        import torch._dynamo.exc as dexc
    except ImportError:
        return False
    return isinstance(e, (dexc.UserError, dexc.Unsupported))


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)  # usage errors exit 2 here
    args.argv = list(sys.argv[1:] if argv is None else argv)  # `step --nproc N` reruns it on each rank
    args.status = _Status(args.quiet)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # factories in the current project
    prefix = f"torch-ext {args.command}: error:"
    try:
        try:
            return args.fn(args)
        except BaseException:
            # A loop's stage (a generator) may still have its line open while the error propagates.
            args.status.abort()
            raise
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_OK
    except KeyboardInterrupt:
        print(f"torch-ext {args.command}: interrupted", file=sys.stderr)
        return 130
    except UserError as e:
        if args.debug:
            traceback.print_exc()
        print(f"{prefix} {e}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:  # noqa: BLE001 - one line unless --debug
        if args.debug:
            traceback.print_exc()
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        if _is_input_error(e):
            print(f"{prefix} {type(e).__name__}: {first}", file=sys.stderr)
            code = EXIT_USAGE
        else:
            print(f"{prefix} internal error: {type(e).__name__}: {first}", file=sys.stderr)
            code = EXIT_INTERNAL
        if not args.debug:
            print("(run with --debug for the full traceback)", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
