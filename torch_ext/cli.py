"""torch-ext: pure training steps, memory plans and reactive sweeps from the command line.

MODEL is `package.module:factory`; the factory returns (model, optimizer, loss_fn, example_batch) and
may add a fifth item, a list of batches to train on.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path


class UserError(Exception):
    """An error reported as one line, without a traceback (unless --debug)."""


def _progress(iterable, total, enabled, desc):
    if not enabled or not sys.stderr.isatty():
        return iterable
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, leave=False)


def load_factory(spec: str):
    if ":" not in spec:
        raise UserError(f"MODEL must look like package.module:factory, got {spec!r}")
    mod_name, fn_name = spec.split(":", 1)
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise UserError(f"cannot import {mod_name!r}: {e}") from e
    fn = getattr(module, fn_name, None)
    if fn is None:
        raise UserError(f"{mod_name!r} has no attribute {fn_name!r}")
    out = fn()
    if not isinstance(out, tuple) or len(out) not in (4, 5):
        raise UserError(f"{spec} must return (model, optimizer, loss_fn, example_batch[, batches]), got {type(out).__name__}")
    model, opt, loss_fn, example = out[:4]
    batches = list(out[4]) if len(out) == 5 else None
    return model, opt, loss_fn, tuple(example), batches


def _batches(example, batches, n):
    if batches:
        return [tuple(batches[i % len(batches)]) for i in range(n)]
    return [example] * n


# ---------------------------------------------------------------- demo
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
    vocab, seq, batch = 64, 16, 8
    model = TinyTransformer(vocab=vocab, d_model=32, n_heads=4, n_layers=2, seq=seq)
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
    print("torch-ext demo: tiny transformer (2 blocks, d_model 32, 4 heads, seq 16, vocab 64), AdamW, synthetic data")

    # 1. the pure step
    t0 = time.perf_counter()
    step = torch_ext.make_train_step(model, opt, loss_fn, batches[0])
    n_calls = sum(1 for n in step.graph.nodes() if n["kind"] == "call")
    print(f"[1/4] pure step built in {time.perf_counter() - t0:.1f} s: one graph of {n_calls} ops, "
          f"{len(step.state_names)} state tensors in and out, lr and step count as inputs")

    # 2. training
    state = step.init_state()
    losses = []
    for b in _progress(batches, len(batches), not args.no_progress, "training"):
        loss, state = step(state, *b)
        losses.append(float(loss))
    print(f"[2/4] trained {len(batches)} steps on the C++ executor: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    parity = step_parity(model, opt, loss_fn, batches[: min(20, len(batches))])
    print(f"      parity with eager torch.optim over {parity['steps']} steps: max relative difference "
          f"loss {parity['loss']:.3g}, state {parity['state']:.3g}")

    # 3. memory
    report = torch_ext.memory_report(step, batches[0])
    print("[3/4] memory report")
    print("\n".join("      " + line for line in str(report).splitlines()))
    timeline = report.plot(str(out_dir / "demo_memory_timeline.png"))
    print(f"      wrote {timeline}")

    # 4. reactive residual-stream patching sweep
    step.write_back(state)
    model.eval()
    clean = batches[0][0][:1]
    corrupt = clean.clone()
    corrupt[0, 3] = (corrupt[0, 3] + 7) % vocab
    rg = torch_ext.ReactiveGraph(model, (corrupt,))
    resid = [n for n in rg.nodes("add*") if tuple(rg.value(n).shape) == (1, seq, 32)]
    corrupted = {n: rg.value(n).clone() for n in resid}
    rg.run(clean)
    target = int(batches[0][1][0, -1])
    sites = [(n, p) for n in resid for p in range(seq)]

    def patch(clean_value, site):
        v = clean_value.clone()
        v[:, site[1]] = corrupted[site[0]][:, site[1]]
        return v

    def metric(logits):
        return float(logits[0, -1, target] - logits[0, -1].mean())

    result = torch_ext.sweep(rg, sites, patch, metric, progress=not args.no_progress)
    heat = result.plot(str(out_dir / "demo_sweep_heatmap.png"), title="residual-stream activation patching")
    print(f"[4/4] reactive sweep over {len(resid)} residual nodes x {seq} positions = {len(sites)} sites")
    print(f"      evaluations: measured {result.measured_evaluations}, predicted from cones "
          f"{result.predicted_evaluations}, full recomputation {result.full_evaluations}")
    print(f"      rho = {result.rho:.3f} predicted, {result.rho_measured:.3f} measured; "
          f"sweep took {result.wall_time * 1e3:.0f} ms")
    print(f"      wrote {heat}")
    print(f"done in {time.perf_counter() - t_start:.1f} s")
    ok = parity["loss"] <= 1e-5 and parity["state"] <= 1e-5 and result.measured_evaluations == result.predicted_evaluations
    return 0 if ok else 1


# ---------------------------------------------------------------- step / plan / sweep / check
def _step(args) -> int:
    import torch

    import torch_ext

    model, opt, loss_fn, example, batches = load_factory(args.model)
    step = torch_ext.make_train_step(model, opt, loss_fn, example, unroll=args.unroll)
    summary = {"model": args.model, "ops": sum(1 for n in step.graph.nodes() if n["kind"] == "call"),
               "state_entries": len(step.state_names), "unroll": args.unroll, "losses": []}
    if args.steps:
        state = step.init_state()
        per = _batches(example, batches, args.steps * args.unroll)
        for i in _progress(range(args.steps), args.steps, not args.no_progress, "training"):
            flat = [t for b in per[i * args.unroll:(i + 1) * args.unroll] for t in b]
            loss, state = step(state, *flat)
            summary["losses"].append(loss.reshape(-1).tolist())
        step.write_back(state)
    if args.export:
        torch.export.save(step.program, args.export)
        summary["export"] = args.export
    if args.aoti:
        summary["aoti"] = torch._inductor.aoti_compile_and_package(step.program, package_path=args.aoti)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"pure step for {args.model}: {summary['ops']} ops, {summary['state_entries']} state tensors"
              + (f", unroll {args.unroll}" if args.unroll > 1 else ""))
        if summary["losses"]:
            print(f"trained {args.steps} steps: loss {summary['losses'][0]} -> {summary['losses'][-1]}")
        for key in ("export", "aoti"):
            if key in summary:
                print(f"wrote {summary[key]}")
    return 0


def _plan(args) -> int:
    import torch_ext

    model, opt, loss_fn, example, _ = load_factory(args.model)
    step = torch_ext.make_train_step(model, opt, loss_fn, example)
    report = torch_ext.memory_report(step, example)
    if args.plot:
        report.plot(args.plot)
    print(report.to_json() if args.json else str(report))
    return 0


def _sweep(args) -> int:
    import torch

    import torch_ext

    model, _, _, example, _ = load_factory(args.model)
    model.eval()
    rg = torch_ext.ReactiveGraph(model, (example[0],))
    nodes = [n for n in rg.nodes(args.sites) if isinstance(rg.value(n), torch.Tensor)]
    if not nodes:
        raise UserError(f"no tensor node matches --sites {args.sites!r}; try `torch-ext sweep MODEL --sites '*' --list`")
    if args.list:
        print("\n".join(nodes))
        return 0
    kind, _, arg = args.metric.partition(":")
    if kind == "norm":
        metric = lambda out: float(out.float().norm())  # noqa: E731
    elif kind == "logit":
        idx = int(arg or 0)
        metric = lambda out: float(out.reshape(-1, out.shape[-1])[-1, idx])  # noqa: E731
    else:
        raise UserError(f"--metric must be norm or logit:IDX, got {args.metric!r}")
    if args.patch == "zero":
        patch = lambda clean, site: torch.zeros_like(clean)  # noqa: E731
    elif args.patch == "mean":
        patch = lambda clean, site: clean.mean().expand_as(clean).clone()  # noqa: E731
    else:
        raise UserError(f"--patch must be zero or mean, got {args.patch!r}")
    result = torch_ext.sweep(rg, nodes, patch, metric, progress=not args.no_progress)
    if args.plot:
        result.plot(args.plot)
    if args.json:
        print(json.dumps({"metrics": result.metrics, "measured_evaluations": result.measured_evaluations,
                          "predicted_evaluations": result.predicted_evaluations,
                          "full_evaluations": result.full_evaluations, "rho": result.rho,
                          "wall_time_s": result.wall_time}, indent=2))
    else:
        print(result.to_pandas()[["node", "metric"]].to_string(index=False))
        print(result.summary())
    return 0


def _check(args) -> int:
    import torch_ext
    from torch_ext.testing import step_parity

    model, opt, loss_fn, example, batches = load_factory(args.model)
    report = {"model": args.model, "steps": args.steps, "rtol": args.rtol, "failures": []}
    parity = step_parity(model, opt, loss_fn, _batches(example, batches, args.steps))
    report["parity"] = {k: v for k, v in parity.items() if k != "losses"}
    if parity["nonfinite"]:
        report["failures"].append(f"non-finite loss at step {parity['steps']}")
    elif parity["loss"] > args.rtol or parity["state"] > args.rtol:
        report["failures"].append(f"parity: loss rel {parity['loss']:.3g}, state rel {parity['state']:.3g} "
                                  f"({parity['worst_entry']}) exceed rtol {args.rtol:g}")
    if args.max_peak_bytes is not None:
        step = torch_ext.make_train_step(model, opt, loss_fn, example)
        mem = torch_ext.memory_report(step, example)
        report["planned_peak_bytes"] = mem.merged_planned
        report["max_peak_bytes"] = args.max_peak_bytes
        if mem.merged_planned > args.max_peak_bytes:
            report["failures"].append(f"planned peak {mem.merged_planned} bytes exceeds the budget of "
                                      f"{args.max_peak_bytes} bytes")
    report["ok"] = not report["failures"]
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"check {args.model}: {'OK' if report['ok'] else 'FAILED'}")
        print(f"  parity over {parity['steps']} steps: loss rel {parity['loss']:.3g}, state rel {parity['state']:.3g}")
        if "planned_peak_bytes" in report:
            print(f"  planned peak {report['planned_peak_bytes']} bytes (budget {args.max_peak_bytes})")
        for f in report["failures"]:
            print(f"  FAIL: {f}")
    return 0 if report["ok"] else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="torch-ext", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    common.add_argument("--no-progress", action="store_true", help="no progress bars (off anyway when not a terminal)")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", parents=[common], help="the main job on a built-in tiny transformer (no files, no network)")
    d.add_argument("--steps", type=int, default=50)
    d.add_argument("--out", default="torch_ext_demo", help="folder for the PNG files")
    d.set_defaults(fn=_demo)

    s = sub.add_parser("step", parents=[common], help="build the pure training step for MODEL")
    s.add_argument("model")
    s.add_argument("--steps", type=int, default=0, help="train N steps on the factory's batches")
    s.add_argument("--export", metavar="OUT.pt2", help="torch.export.save the pure step")
    s.add_argument("--aoti", metavar="OUT.pt2", help="compile with AOTInductor into this package")
    s.add_argument("--unroll", type=int, default=1)
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=_step)

    pl = sub.add_parser("plan", parents=[common], help="memory report for MODEL's pure step")
    pl.add_argument("model")
    pl.add_argument("--plot", metavar="TIMELINE.png")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(fn=_plan)

    sw = sub.add_parser("sweep", parents=[common], help="reactive patching sweep over MODEL's nodes (input: example_batch[0])")
    sw.add_argument("model")
    sw.add_argument("--sites", default="*", help="glob over node names or module paths")
    sw.add_argument("--metric", default="norm", help="norm | logit:IDX (last row of the output)")
    sw.add_argument("--patch", default="zero", help="zero | mean ablation")
    sw.add_argument("--plot", metavar="HEATMAP.png")
    sw.add_argument("--json", action="store_true")
    sw.add_argument("--list", action="store_true", help="list the matching sites and exit")
    sw.set_defaults(fn=_sweep)

    c = sub.add_parser("check", parents=[common], help="CI check: parity with eager over N steps and a peak-memory budget")
    c.add_argument("model")
    c.add_argument("--steps", type=int, default=10)
    c.add_argument("--rtol", type=float, default=1e-5)
    c.add_argument("--max-peak-bytes", type=int)
    c.add_argument("--json", action="store_true")
    c.set_defaults(fn=_check)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # factories in the current project
    try:
        return args.fn(args)
    except UserError as e:
        print(f"torch-ext {args.command}: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - one line unless --debug
        if args.debug:
            raise
        print(f"torch-ext {args.command}: error: {type(e).__name__}: {e}", file=sys.stderr)
        print("(run with --debug for the full traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
