"""The driver scripts/fuzz_step.py and scripts/fuzz_sweep.py share: the command line (``--seconds``, ``--seed``,
``--first``, ``--case``, ``--spec``, ``--minimize``, ``--log``), the worker subprocess that runs cases until the
deadline (a crash, or a case past ``--case-timeout`` where the fuzzer has one, is a finding and the run goes on), the
in-process replay of one case, the classification of an exception and the greedy minimiser. Each fuzzer supplies its
cases (``case_spec``), how one runs (``one``) and its simplifications."""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Iterable

ROOT = Path(__file__).resolve().parent.parent
OK_ERRORS = ("RuntimeError", "ValueError", "TypeError", "NotImplementedError")
# "IR verification failed": torch_ext's own verifier rejected a graph its passes built (an internal error, never a refusal)
BAD_MARKERS = ("INTERNAL ASSERT FAILED", "please report a bug to PyTorch", "Traceback", "IR verification failed")


def one_intra_op_thread(run):
    """``run`` on one intra-op thread, the thread count restored after it: the tests replay cases in-process
    (pytest-xdist runs other files on the same worker next), and a count left at 1 made test_deploy's C++
    runner differ from load_step."""
    @functools.wraps(run)
    def scoped(*args, **kwargs):
        import torch

        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return run(*args, **kwargs)
        finally:
            torch.set_num_threads(before)
    return scoped


def env_set_during(name: str, value: str):
    """A decorator: ``run`` with environment variable ``name`` set to ``value`` where it is unset, and the
    environment as it was afterwards (the tests replay cases in-process; a variable left set changes later files)."""
    def wrap(run):
        @functools.wraps(run)
        def scoped(*args, **kwargs):
            before = os.environ.get(name)
            if before is None:
                os.environ[name] = value
            try:
                return run(*args, **kwargs)
            finally:
                if before is None:
                    os.environ.pop(name, None)
        return scoped
    return wrap


# Where the running case is, set by the fuzzer's run_case as it goes (``enter``): "eager" (eager PyTorch, or the
# setup both sides share: the model, its optimizers, the batches), "build" (torch_ext builds: make_train_step,
# compile, ReactiveGraph), "run" (the built object runs: a step's calls, write_back, a graph's operations),
# "compare". A case that never says where it is raised at "build" (what every raise used to be counted as).
_PHASE = ["build"]


def enter(phase: str) -> None:
    """The running case is now at ``phase`` (see _PHASE)."""
    _PHASE[0] = phase


def raised_in(exc: BaseException) -> str:
    """The file of the frame that raised ``exc`` (its traceback's innermost frame), or ""."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code.co_filename if tb is not None else ""


def raised_by_torch_ext(exc: BaseException) -> bool:
    """Whether torch_ext's own code raised ``exc`` (its Python, or its C++ through a call from it): not torch's
    error passing through (an op's check, export's assertion), which the user would get unexplained."""
    pkg = sys.modules.get("torch_ext")
    if pkg is None or not getattr(pkg, "__file__", None):
        return False
    return Path(raised_in(exc)).resolve().is_relative_to(Path(pkg.__file__).resolve().parent)


def classify(exc: BaseException, refusal: Callable[[str], str], mismatch: tuple = (),
             eager: Callable[[], BaseException | None] | None = None) -> tuple[str, str]:
    """(status, message) of a case that raised:
    "mismatch" for an exception of the ``mismatch`` types;
    "eager_failed" where eager PyTorch (or the setup both sides share) raised: not a finding, counted apart;
    "refused" where torch_ext refused at build time, with an exception of the project's own kinds, raised by its
    own code, without an internal assert (its first line through ``refusal``);
    else "error" with the traceback, a finding: the built step or graph failed at run time, or the build failed with
    an error that is not torch_ext's own. ``eager``: runs the case eagerly alone, returning what it raised (None
    where it trains); a build that failed with torch's own error where eager fails too is "eager_failed" (the user
    gets the same failure, only earlier), and so is a run-time failure where eager raises the same (its type and
    first line): eager's own failure, met where the fuzzer runs eager beside the graph (fuzz_sweep's reference)."""
    name = type(exc).__name__
    msg = str(exc)
    first = msg.splitlines()[0] if msg else ""
    phase = _PHASE[0]
    if isinstance(exc, mismatch):
        return "mismatch", msg
    if phase == "eager":
        return "eager_failed", f"{name}: {refusal(first)}"
    internal = any(m in msg for m in BAD_MARKERS)
    ours = name in OK_ERRORS and not internal and raised_by_torch_ext(exc)
    if phase == "build" and ours:
        return "refused", f"{name}: {refusal(first)}"
    where = (f"at {phase} time" if phase != "build" else
             f"at build time, not torch_ext's own (raised in {raised_in(exc) or '?'})")
    also = ""
    if eager is not None and not internal:
        try:
            theirs = eager()
        finally:
            enter(phase)
        if theirs is not None:
            e_first = str(theirs).splitlines()[0] if str(theirs) else ""
            if phase == "build":
                return "eager_failed", f"{type(theirs).__name__}: {refusal(e_first)} (the build failed too: {name})"
            if type(theirs) is type(exc) and e_first == first:
                # The same failure: eager's own (fuzz_sweep runs its eager reference inside each operation).
                return "eager_failed", f"{name}: {refusal(first)} (eager raises the same at run time)"
            also = f"; eager fails too ({type(theirs).__name__}: {e_first[:200]})"
    tb = "".join(traceback.format_exception(exc))[-3000:]
    return "error", f"{name} {where}{also}: {msg[:2000]}\n{tb}"


def minimize(spec: dict, one: Callable[[dict], dict], simplifications: Callable[[dict], Iterable[dict]],
             keep: Callable[[dict], bool] = lambda cand: True) -> dict:
    """Greedily simplifies ``spec`` while it stays a finding of the same status (candidates ``keep`` refuses are
    not tried)."""
    status = one(spec)["status"]
    changed = True
    while changed:
        changed = False
        for cand in simplifications(spec):
            if not keep(cand):
                continue
            if one(cand)["status"] == status:
                spec, changed = cand, True
                break
    return spec


def worker(seed: int, first: int, deadline: float, case_spec: Callable[[int, int], dict],
           one: Callable[[dict], dict]):
    """Runs cases ``first``, ``first + 1``, ... until ``deadline``: a ``{"start": i}`` line before each, its result
    after it (JSON lines on stdout)."""
    import torch  # noqa: F401 - imported before the first case's clock starts (--case-timeout)

    import torch_ext  # noqa: F401
    i = first
    while time.time() < deadline:
        print(json.dumps({"start": i}), flush=True)
        r = one(case_spec(seed, i))
        r["i"] = i
        print(json.dumps(r), flush=True)
        i += 1


def _lines(p, timeout: dict):
    """The worker's stdout lines; None when no line came for ``timeout["s"]`` seconds (None: no limit, while the
    worker starts up and imports torch). Read unbuffered, so a line already read never waits behind the select."""
    import os
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    buf = b""
    while True:
        if b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield line.decode()
            continue
        if not sel.select(timeout["s"]):
            yield None
            return
        chunk = os.read(p.stdout.fileno(), 1 << 16)
        if not chunk:
            return
        buf += chunk


class Tally:
    """The run's summary after its ``seed ...: cases ...`` line: the refusals by message. A fuzzer counts more
    (fuzz_sweep: operations and refused operations) by overriding ``add`` and ``report``."""

    def add(self, seed: int, r: dict) -> None:
        """Called with each case's result."""

    def report(self, refusals: dict) -> None:
        for msg, c in sorted(refusals.items(), key=lambda kv: -kv[1]):
            print(f"  refused x{c}: {msg}")


def main(argv, *, doc: str, script: str, case_spec: Callable[[int, int], dict], one: Callable[..., dict],
         minimize: Callable[[dict], dict], replay: Callable[[dict], dict] | None = None,
         case_timeout: float | None = None, tally: Tally | None = None) -> int:
    """The fuzzer's command line. ``script``: the fuzzer's file, which workers run with ``--worker``; ``replay``:
    how ``--case``/``--spec`` run the case (default ``one``); ``case_timeout``: the default of ``--case-timeout``
    (None: the fuzzer has no such option, and a case may take any time)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--first", type=int, default=0, help="first case index")
    ap.add_argument("--case", help="SEED:I: run one generated case in-process and print it")
    ap.add_argument("--spec", help="a JSON spec (or @file) to run in-process")
    ap.add_argument("--minimize", action="store_true", help="with --case/--spec: simplify the finding first")
    ap.add_argument("--log", help="append every case's result (JSON lines) here")
    if case_timeout is not None:
        ap.add_argument("--case-timeout", type=float, default=case_timeout,
                        help="seconds one case may take before its worker is killed and the case is a finding (slow)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a.seed, a.first, a.deadline, case_spec, one)
        return 0
    if a.case or a.spec:
        if a.case:
            s, i = a.case.split(":")
            spec = case_spec(int(s), int(i))
        else:
            spec = json.loads(Path(a.spec[1:]).read_text() if a.spec.startswith("@") else a.spec)
        if a.minimize:
            spec = minimize(spec)
        print(json.dumps(spec))
        r = (replay or one)(spec)
        print(r["status"])
        print(r.get("msg", ""))
        return 0 if r["status"] in ("ok", "refused", "eager_failed") else 1

    limit = getattr(a, "case_timeout", None)
    tally = tally or Tally()
    deadline = time.time() + a.seconds
    counts: dict[str, int] = {}
    findings, refusals, eager_failures = [], {}, {}
    log = open(a.log, "a") if a.log else None
    i = a.first
    while time.time() < deadline:
        p = subprocess.Popen([sys.executable, script, "--worker", "--seed", str(a.seed), "--first", str(i),
                              "--deadline", str(deadline)], stdout=subprocess.PIPE, bufsize=0, cwd=ROOT)
        current, slow, timeout = None, False, {"s": None}
        for line in _lines(p, timeout):
            if line is None:  # one case ran past --case-timeout: a finding (a hang, or a pass gone quadratic)
                slow = True
                p.kill()
                break
            r = json.loads(line)
            if "start" in r:
                current, timeout["s"] = r["start"], limit
                continue
            current, timeout["s"] = None, None
            i = r["i"] + 1
            counts[r["status"]] = counts.get(r["status"], 0) + 1
            tally.add(a.seed, r)
            if log:
                log.write(line + "\n")
                log.flush()
            if r["status"] == "refused":
                refusals[r["msg"][:160]] = refusals.get(r["msg"][:160], 0) + 1
            elif r["status"] == "eager_failed":
                eager_failures[r["msg"][:160]] = eager_failures.get(r["msg"][:160], 0) + 1
            elif r["status"] != "ok":
                findings.append(r)
                print(f"FINDING {r['status']} case {a.seed}:{r['i']}\n{r['msg']}\n", flush=True)
        rc = p.wait()
        if current is not None:  # the worker died inside a case (a crash), or was killed as too slow
            kind = "slow" if slow else "crash"
            counts[kind] = counts.get(kind, 0) + 1
            why = f"over {limit:g} s" if slow else f"worker exit {rc}"
            findings.append({"status": kind, "i": current, "msg": why})
            if log:
                log.write(json.dumps({"status": kind, "msg": why, "i": current}) + "\n")
                log.flush()
            print(f"FINDING {kind} case {a.seed}:{current} ({why})", flush=True)
            i = current + 1
    print(f"seed {a.seed}: cases {a.first}..{i - 1}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    tally.report(refusals)
    for msg, c in sorted(eager_failures.items(), key=lambda kv: -kv[1]):
        print(f"  eager failed x{c}: {msg}")
    return 1 if findings else 0
