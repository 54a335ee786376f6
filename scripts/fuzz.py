#!/usr/bin/env python
"""Structure-aware fuzzer for the IR front end and the runtimes.

Mutates valid IR texts (the seeds: printed zoo graphs under tests/python/fuzz_corpus/seeds/,
refreshed with --regen-seeds) and drives each mutant through

    Graph.parse -> verify -> Executor(graph).run(inputs) -> reactive Engine run + demand

in a worker subprocess, so that a crash (a signal) or a hang (past --timeout seconds per case)
is caught instead of killing the fuzzer. The only acceptable outcomes are success or one of
the project's own errors: RuntimeError / ValueError / TypeError / IndexError /
NotImplementedError whose message is not a PyTorch internal assert. Anything else (a signal,
a hang, UnicodeDecodeError, SystemError, "INTERNAL ASSERT FAILED", ...) is a finding: it is
minimised line by line and saved as tests/python/fuzz_corpus/<kind>-<hash>.ir, which
tests/python/test_fuzz.py replays as a regression case.

    python scripts/fuzz.py --minutes 30            # long run
    python scripts/fuzz.py --seconds 60 --seed 1   # the bounded CI run
    python scripts/fuzz.py --replay                # replay the saved corpus only
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import struct
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "python" / "fuzz_corpus"
SEEDS = CORPUS / "seeds"

# Runtime limits inside the worker: loops stop early and nothing big is allocated, so every
# case finishes well within the per-case timeout.
WORKER_ENV = {"TORCH_EXT_MAX_LOOP_ITERATIONS": "1000"}
STARTUP_TIMEOUT = 300.0  # importing torch on a loaded machine
MAX_INPUT_BYTES = 1 << 24  # the harness does not run graphs whose inputs exceed 16 MiB
OK_ERRORS = ("RuntimeError", "ValueError", "TypeError", "IndexError", "NotImplementedError")
BAD_MARKERS = ("INTERNAL ASSERT FAILED", "please report a bug to PyTorch")

# ------------------------------------------------------------------------------ worker side
WORKER = r'''
import os, struct, sys, traceback
import torch
import torch_ext
from torch_ext import _C

MAX_INPUT_BYTES = int(sys.argv[1])
_ITEMSIZE = {"f32": 4, "f64": 8, "f16": 2, "bf16": 2, "i64": 8, "i32": 4, "i16": 2, "i8": 1, "u8": 1,
             "b8": 1, "c64": 8, "c128": 16}
_DTYPE = {"f32": torch.float32, "f64": torch.float64, "f16": torch.float16, "bf16": torch.bfloat16,
          "i64": torch.int64, "i32": torch.int32, "i16": torch.int16, "i8": torch.int8, "u8": torch.uint8,
          "b8": torch.bool, "c64": torch.complex64, "c128": torch.complex128}


def make_input(t, gen):
    kind = t[0]
    if kind == "int":
        return int(torch.randint(-3, 8, (), generator=gen))
    if kind == "float":
        return float(torch.randn((), generator=gen))
    if kind == "bool":
        return bool(torch.randint(0, 2, (), generator=gen))
    if kind != "tensor":
        return None
    _, dt, sizes, strides, device = t
    dtype = _DTYPE[dt]
    if dtype.is_floating_point or dtype.is_complex:
        x = torch.randn(sizes, generator=gen).to(dtype)
    elif dtype == torch.bool:
        x = torch.randint(0, 2, sizes, generator=gen).bool()
    else:
        x = torch.randint(0, 4, sizes, generator=gen).to(dtype)
    return x.to(device)


def input_bytes(t):
    if t[0] != "tensor":
        return 0
    n = 1
    for s in t[2]:
        n *= max(s, 0)
    return n * _ITEMSIZE.get(t[1], 8)


def run(text):
    g = _C.Graph.parse(text)
    g.verify()
    ex = _C.Executor(g)
    nodes = torch_ext.ir.Graph(g).nodes()
    types = [n.type for n in nodes if n.kind == "placeholder"]
    if sum(input_bytes(t) for t in types) > MAX_INPUT_BYTES:
        return "verified (inputs too big to run)"
    # Verified types are exact, so they bound what running costs: skip graphs whose values
    # (regions included) would exceed the budget.
    def total(t):
        return sum(total(e) for e in t[1]) if t[0] == "tuple" else input_bytes(t)
    def graph_bytes(nodes):
        return sum(total(n.type) + sum(graph_bytes(r.nodes()) for r in n.regions) for n in nodes)
    if graph_bytes(nodes) > 8 * MAX_INPUT_BYTES:
        return "verified (values too big to run)"
    if any(t[0] == "tensor" and t[4] != "cpu" for t in types):
        return "verified (non-CPU inputs)"
    gen = torch.Generator().manual_seed(0)
    inputs = [make_input(t, gen) for t in types]
    ex.run(inputs)
    try:
        eng = _C.Engine(g)
    except RuntimeError:
        return "ran (engine refused the graph)"
    eng.run(inputs)
    eng.demand()
    return "ran"


def main():
    # The protocol owns the original stdout.
    out = os.fdopen(os.dup(1), "wb")
    inp = sys.stdin.buffer
    # Warm up (the first meta-kernel call imports torch's Python meta registrations), then
    # tell the parent the per-case clock may start.
    _C.Graph.parse("graph:\n  %x : f32[2] = input()\n  %y : f32[2] = aten::neg.default(%x)\n"
                   "  return (%y)\n").verify()
    # From here on nothing else reaches the parent: stdout and stderr (start-up errors went
    # there) now go to /dev/null.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    out.write(b"RDY!")
    out.flush()
    while True:
        head = inp.read(4)
        if len(head) < 4:
            return
        (n,) = struct.unpack("<I", head)
        text = inp.read(n).decode("utf-8", "surrogateescape")
        try:
            status, detail = "ok", run(text)
        except BaseException as e:  # classified by the parent
            status, detail = type(e).__name__, str(e)[:2000]
        msg = (status + "\x00" + detail).encode("utf-8", "replace")
        out.write(struct.pack("<I", len(msg)) + msg)
        out.flush()


main()
'''


class Worker:
    """One long-lived subprocess that runs cases; restarted after a crash or a hang."""

    def __init__(self):
        self.proc = None

    def _start(self):
        env = {**os.environ, **WORKER_ENV}
        # Start-up (importing torch) is not part of any case's time budget. A start can fail when
        # the extension is being rebuilt at that moment, so it is retried.
        for attempt in range(3):
            self.proc = subprocess.Popen([sys.executable, "-c", WORKER, str(MAX_INPUT_BYTES)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=str(ROOT))
            if self._read_exactly(4, STARTUP_TIMEOUT) == b"RDY!":
                self.proc.stderr.close()  # cases may write plenty; nobody reads it
                self.proc.stderr = None
                return
            self.proc.kill()
            _, err = self.proc.communicate()
            self.proc = None
            time.sleep(5)
        raise RuntimeError(f"the fuzz worker did not start (3 attempts); last stderr:\n{err.decode(errors='replace')[-2000:]}")

    def _read_exactly(self, n: int, timeout: float) -> bytes | None:
        """n bytes from the worker, or None when it died or the timeout passed."""
        import select

        buf = b""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, n - len(buf))
            if not chunk:
                return None
            buf += chunk
        return buf

    def close(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def run(self, text: str, timeout: float) -> tuple[str, str]:
        """('ok' | exception class name | 'signal' | 'hang', detail)."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        data = text.encode("utf-8", "surrogateescape")
        try:
            self.proc.stdin.write(struct.pack("<I", len(data)) + data)
            self.proc.stdin.flush()
        except BrokenPipeError:
            return self._died()
        start = time.monotonic()
        head = self._read_exactly(4, timeout)
        if head is not None:
            (n,) = struct.unpack("<I", head)
            body = self._read_exactly(n, max(1.0, timeout - (time.monotonic() - start)))
            if body is not None:
                status, _, detail = body.decode("utf-8", "replace").partition("\x00")
                return status, detail
        if self.proc.poll() is not None:
            return self._died()
        self.close()
        return "hang", f"no answer within {timeout:.0f} s"

    def _died(self):
        rc = self.proc.wait()
        self.proc = None
        return "signal", f"worker exited with {rc}"


def is_finding(status: str, detail: str) -> bool:
    if status == "ok":
        return False
    if status in OK_ERRORS:
        return any(m in detail for m in BAD_MARKERS)
    return True


def kind_of(status: str, detail: str) -> str:
    if status in OK_ERRORS:
        return "assert"
    return {"signal": "crash", "hang": "hang"}.get(status, "error")


# ------------------------------------------------------------------------------ mutator
DTYPES = ["f32", "f64", "f16", "bf16", "i64", "i32", "i8", "u8", "b8", "c64"]
EDGE_INTS = [0, 1, -1, 2, 3, 7, 64, -2, 2**31, 2**62, -(2**63), 2**63 - 1]
CONSTANTS = ["None", "True", "False", "0", "-1", "1.5", "nan", "inf", "-inf", "[]", "[0]", "[1, -1]", '"x"',
             "torch.float64", "torch.int64", "torch.bool", 'device("cpu")', 'device("meta")', "torch.strided",
             "torch.channels_last", "[[1]]", "[None]", str(2**62), "-9223372036854775808"]
ODD_TEXT = ["(", ")", "[", "]", "{", "}", "%", ",", "=", ":", "\n", "é", "€", "\U0001F600", "\x00", "\\", '"', "#"]

TYPE_RE = re.compile(r"\b(f32|f64|f16|bf16|i64|i32|i16|i8|u8|b8|c64|c128)\[([-0-9,]*)\]")
VALUE_RE = re.compile(r"%[A-Za-z0-9_]+")
INT_RE = re.compile(r"(?<![\w.%\[])-?\d+(?![\w.\]])")
TARGET_RE = re.compile(r"= ([a-z_]+::[A-Za-z0-9_]+\.[A-Za-z0-9_]+)\(")


def _sub_nth(regex, text, fn, rng):
    matches = list(regex.finditer(text))
    if not matches:
        return text
    m = rng.choice(matches)
    return text[:m.start()] + fn(m) + text[m.end():]


class Mutator:
    def __init__(self, seeds: list[str], rng: random.Random):
        self.seeds = seeds
        self.rng = rng
        self.targets = sorted({t for s in seeds for t in TARGET_RE.findall(s)})

    def mutate(self, text: str) -> str:
        for _ in range(self.rng.choice([1, 1, 1, 2, 3])):
            op = self.rng.choice(self.OPS)
            text = op(self, text)
        return text

    # Types: sizes and dtypes.
    def m_size(self, text):
        def f(m):
            sizes = [s for s in m.group(2).split(",") if s]
            r = self.rng.random()
            if sizes and r < 0.5:
                i = self.rng.randrange(len(sizes))
                sizes[i] = str(self.rng.choice([int(sizes[i]) + 1, int(sizes[i]) - 1, 0, 1] + EDGE_INTS))
            elif sizes and r < 0.7:
                sizes.pop(self.rng.randrange(len(sizes)))
            else:
                sizes.insert(self.rng.randrange(len(sizes) + 1), str(self.rng.choice([1, 2, 3])))
            return f"{m.group(1)}[{','.join(sizes)}]"
        return _sub_nth(TYPE_RE, text, f, self.rng)

    def m_dtype(self, text):
        return _sub_nth(TYPE_RE, text, lambda m: f"{self.rng.choice(DTYPES)}[{m.group(2)}]", self.rng)

    # Arguments: swap a value for another value or a constant; edge integers.
    def m_value(self, text):
        """Replaces a use (right of '=') by a value defined earlier at the same indent, or a constant."""
        lines = text.split("\n")
        uses = [i for i, l in enumerate(lines) if " = " in l and VALUE_RE.search(l.split(" = ", 1)[1])]
        if not uses:
            return text
        i = self.rng.choice(uses)
        indent = len(lines[i]) - len(lines[i].lstrip())
        defined = [VALUE_RE.match(l.strip()).group(0) for l in lines[:i]
                   if len(l) - len(l.lstrip()) == indent and VALUE_RE.match(l.strip())]
        lhs, rhs = lines[i].split(" = ", 1)
        def f(m):
            if defined and self.rng.random() < 0.7:
                return self.rng.choice(defined)
            return self.rng.choice(CONSTANTS)
        lines[i] = lhs + " = " + _sub_nth(VALUE_RE, rhs, f, self.rng)
        return "\n".join(lines)

    def m_int(self, text):
        return _sub_nth(INT_RE, text, lambda m: str(self.rng.choice(EDGE_INTS)), self.rng)

    def m_target(self, text):
        if not self.targets:
            return text
        return _sub_nth(TARGET_RE, text, lambda m: f"= {self.rng.choice(self.targets)}(", self.rng)

    # Lines: delete, duplicate, swap (use before definition, redefinition, missing values).
    def _body(self, text):
        lines = text.split("\n")
        idx = [i for i, l in enumerate(lines) if l.strip().startswith("%")]
        return lines, idx

    def m_delete_line(self, text):
        lines, idx = self._body(text)
        if idx:
            del lines[self.rng.choice(idx)]
        return "\n".join(lines)

    def m_duplicate_line(self, text):
        lines, idx = self._body(text)
        if idx:
            i = self.rng.choice(idx)
            lines.insert(self.rng.choice(idx), lines[i])
        return "\n".join(lines)

    def m_swap_lines(self, text):
        lines, idx = self._body(text)
        if len(idx) >= 2:
            i, j = self.rng.sample(idx, 2)
            lines[i], lines[j] = lines[j], lines[i]
        return "\n".join(lines)

    # Splice a line from another seed (new ops, foreign values).
    def m_splice(self, text):
        other = self.rng.choice(self.seeds)
        olines, oidx = self._body(other)
        lines, idx = self._body(text)
        if oidx and idx:
            lines.insert(self.rng.choice(idx), olines[self.rng.choice(oidx)])
        return "\n".join(lines)

    # Nesting and raw text.
    def m_nest(self, text):
        depth = self.rng.choice([2, 8, 63, 64, 65, 200, 5000])
        if self.rng.random() < 0.5:
            return _sub_nth(TYPE_RE, text, lambda m: "(" * depth + m.group(0) + ")" * depth, self.rng)
        return _sub_nth(VALUE_RE, text, lambda m: "[" * depth + m.group(0) + "]" * depth, self.rng)

    def m_text(self, text):
        if not text:
            return text
        i = self.rng.randrange(len(text))
        r = self.rng.random()
        if r < 0.4:
            return text[:i] + self.rng.choice(ODD_TEXT) + text[i:]
        if r < 0.7:
            return text[:i] + text[i + 1:]
        return text[:i]

    def m_return(self, text):
        names = sorted(set(VALUE_RE.findall(text)))
        if not names:
            return text
        picks = self.rng.sample(names, min(len(names), self.rng.choice([1, 2, 3])))
        return re.sub(r"return \(.*\)", "return (" + ", ".join(picks) + ")", text, count=1)

    OPS = [m_size, m_size, m_dtype, m_value, m_value, m_int, m_int, m_target, m_delete_line, m_duplicate_line,
           m_swap_lines, m_splice, m_nest, m_text, m_return]


# ------------------------------------------------------------------------------ driver
def load_seeds() -> list[str]:
    seeds = [p.read_text() for p in sorted(SEEDS.glob("*.ir"))]
    if not seeds:
        sys.exit(f"no seeds under {SEEDS}; run with --regen-seeds")
    return seeds


def regen_seeds() -> None:
    """Prints every zoo program (as exported, and decomposed) into the seed folder."""
    sys.path.insert(0, str(ROOT / "tests" / "python"))
    import torch
    from torch_ext._compat import export_joint
    from torch_ext.ir import Graph
    from zoo import ZOO

    SEEDS.mkdir(parents=True, exist_ok=True)
    for name, entry in ZOO.items():
        for decomposed in (False, True):
            if entry.joint and decomposed:
                continue
            torch.manual_seed(0)
            model, inputs = entry.build()
            ep = torch.export.export(model, inputs)
            ep = export_joint(ep) if entry.joint else ep.run_decompositions() if decomposed else ep
            (SEEDS / f"{name}{'_decomposed' if decomposed else ''}.ir").write_text(str(Graph.from_exported(ep)))
            print("seed", name, "decomposed" if decomposed else "")


def minimise(worker: Worker, text: str, status: str, detail: str, timeout: float, budget_s: float) -> str:
    """Drops lines (then characters of the last line touched) while the same kind of finding persists."""
    want = kind_of(status, detail)
    deadline = time.monotonic() + budget_s

    def still(t):
        s, d = worker.run(t, timeout)
        return is_finding(s, d) and kind_of(s, d) == want

    lines = text.split("\n")
    changed = True
    while changed and time.monotonic() < deadline:
        changed = False
        for i in range(len(lines) - 1, 0, -1):
            if time.monotonic() >= deadline:
                break
            cand = lines[:i] + lines[i + 1:]
            if still("\n".join(cand)):
                lines, changed = cand, True
    return "\n".join(lines)


def save_finding(text: str, status: str, detail: str) -> Path:
    CORPUS.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha1(text.encode("utf-8", "surrogateescape")).hexdigest()[:12]
    path = CORPUS / f"{kind_of(status, detail)}-{digest}.ir"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    path.with_suffix(".txt").write_text(f"{status}: {detail[:1000]}\n")
    return path


def replay(worker: Worker, timeout: float) -> list[tuple[str, str, str]]:
    """Runs every saved regression case; returns the ones that are still findings."""
    bad = []
    for p in sorted(CORPUS.glob("*.ir")):
        status, detail = worker.run(p.read_bytes().decode("utf-8", "surrogateescape"), timeout)
        if is_finding(status, detail):
            bad.append((p.name, status, detail[:300]))
    return bad


def fuzz(seconds: float, seed: int, timeout: float, save: bool) -> dict:
    rng = random.Random(seed)
    seeds = load_seeds()
    mut = Mutator(seeds, rng)
    worker = Worker()
    stats = {"cases": 0, "ok": 0, "refused": 0, "findings": []}
    by_status: dict[str, int] = {}
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            text = mut.mutate(rng.choice(seeds))
            status, detail = worker.run(text, timeout)
            stats["cases"] += 1
            by_status[status] = by_status.get(status, 0) + 1
            if not is_finding(status, detail):
                stats["ok" if status == "ok" else "refused"] += 1
                continue
            # Confirm on a fresh worker first: a worker can also die for reasons outside the case
            # (the extension being rebuilt under it on a shared machine).
            worker.close()
            status, detail = worker.run(text, timeout)
            if not is_finding(status, detail):
                stats["flaky"] = stats.get("flaky", 0) + 1
                continue
            small = minimise(worker, text, status, detail, timeout, budget_s=min(60.0, max(5.0, end - time.monotonic())))
            s2, d2 = worker.run(small, timeout)
            if not is_finding(s2, d2):  # flaky: keep the original
                small, s2, d2 = text, status, detail
            path = save_finding(small, s2, d2) if save else None
            stats["findings"].append({"kind": kind_of(s2, d2), "status": s2, "detail": d2[:300],
                                      "saved": str(path) if path else None})
            print(f"FINDING {kind_of(s2, d2)}: {s2}: {d2[:200]}" + (f" -> {path}" if path else ""), flush=True)
    finally:
        worker.close()
    stats["by_status"] = by_status
    return stats


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, help="fuzz for this many minutes")
    ap.add_argument("--seconds", type=float, help="fuzz for this many seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=20.0, help="per-case timeout in seconds")
    ap.add_argument("--no-save", action="store_true", help="do not write findings into the corpus")
    ap.add_argument("--replay", action="store_true", help="only replay the saved regression cases")
    ap.add_argument("--regen-seeds", action="store_true", help="re-export the zoo into the seed folder")
    ap.add_argument("--json", help="write the statistics to this file")
    args = ap.parse_args(argv)
    if args.regen_seeds:
        regen_seeds()
        return 0
    if args.minutes is not None and args.minutes <= 0 or args.seconds is not None and args.seconds <= 0:
        ap.error("--minutes/--seconds must be positive")
    worker = Worker()
    try:
        bad = replay(worker, args.timeout)
    finally:
        worker.close()
    for name, status, detail in bad:
        print(f"REGRESSION {name}: {status}: {detail}")
    print(f"replayed {len(list(CORPUS.glob('*.ir')))} saved cases, {len(bad)} still failing", flush=True)
    if args.replay:
        return 1 if bad else 0
    seconds = args.seconds if args.seconds is not None else 60.0 * (args.minutes if args.minutes is not None else 1)
    stats = fuzz(seconds, args.seed, args.timeout, save=not args.no_save)
    print(json.dumps({k: v for k, v in stats.items() if k != "findings"}), f"findings={len(stats['findings'])}")
    if args.json:
        Path(args.json).write_text(json.dumps(stats, indent=1))
    return 1 if bad or stats["findings"] else 0


if __name__ == "__main__":
    sys.exit(main())
