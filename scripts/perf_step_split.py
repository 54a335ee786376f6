"""CPU time per step of eager and an AOTInductor package, split by `perf` samples into MKL GEMM,
kernel (page faults) and the rest, each side in its own fresh process (one thread), perf attached
after warm-up so that imports, export and compiles are not sampled.

torch.profiler does not see inside a package (its extern GEMM calls go to ATen's out= kernels
directly), and wall-clock ratios on a shared machine move with the load; CPU samples per symbol do not.
GPT-2 (one thread, load 7-8): eager 381 ms CPU a step, 181 in MKL sgemm and 70 in the kernel (37,000
first-touch page faults a step in a fresh process); the package 262 ms, 182 in MKL sgemm, 2 in the kernel.

    python scripts/perf_step_split.py --case gpt2 --package gpt2.pt2 [--steps 8]

(--package: a step.to_aoti(path, donate=True) package of this case's step; build one with
 `step.to_aoti`, as bench_step.py does.)
"""
import argparse
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def child(case, mode, steps, package, perf_out):
    import torch
    import torch_ext
    from bench_step import eager_and_pure_step

    torch.set_num_threads(1)
    _, eager, step, batch = eager_and_pure_step(case)
    fn = eager
    if mode == "aoti":
        pkg = torch_ext.load_step(package)
        box = {"s": step.init_state(seed=0)}

        def fn():
            _, box["s"] = pkg(box["s"], *batch)[:2]
    for _ in range(2):
        fn()
    perf = subprocess.Popen(["perf", "record", "-q", "-F", "999", "-p", str(os.getpid()), "-o", perf_out])
    time.sleep(1.0)
    times, f0 = [], resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / steps
    perf.send_signal(signal.SIGINT)
    perf.wait()
    print(f"{mode}: wall {statistics.median(times):.1f} ms/step (median), {faults:.0f} minor page faults/step", flush=True)


def split(perf_out, steps, mode):
    rep = subprocess.run(["perf", "report", "-i", perf_out, "--no-children", "--sort", "sym", "-q", "-n"],
                         capture_output=True, text=True).stdout
    total = gemm = kernel = 0
    rest = []
    for line in rep.splitlines():
        parts = line.split()
        if len(parts) < 4 or not parts[1].isdigit():
            continue
        n = int(parts[1])
        total += n
        sym = " ".join(parts[3:])
        if "mkl_blas" in sym or "dnnl" in sym:
            gemm += n
        elif parts[2] == "[k]":
            kernel += n
        else:
            rest.append((n, sym))
    ms = lambda n: n / steps / 0.999  # noqa: E731 (999 Hz samples of one thread)
    print(f"{mode}: CPU {ms(total):.0f} ms/step: GEMM (MKL/oneDNN) {ms(gemm):.0f}, kernel {ms(kernel):.0f}, "
          f"rest {ms(total - gemm - kernel):.0f}; largest of the rest: "
          + ", ".join(f"{s[:60]} {ms(n):.1f}" for n, s in sorted(rest, reverse=True)[:8]))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="gpt2")
    ap.add_argument("--package", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--perf-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.case, args.child, args.steps, args.package, args.perf_out)
    with tempfile.TemporaryDirectory() as d:
        for mode in ("eager", "aoti"):
            out = os.path.join(d, f"{mode}.data")
            subprocess.run([sys.executable, os.path.abspath(__file__), "--case", args.case, "--package", args.package,
                            "--steps", str(args.steps), "--child", mode, "--perf-out", out], check=True)
            split(out, args.steps, mode)
    print("load", open("/proc/loadavg").read().split()[:3])


if __name__ == "__main__":
    main()
