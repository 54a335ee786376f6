"""Where the AOTInductor step's time goes, next to eager's, op by op (bench_step.py's cases).

The package is compiled with Inductor's kernel profile (cpp.enable_kernel_profile: each fused kernel
records itself, named after the ops it fused) and the same donating layout as bench_step's aoti
column; eager is the plain torch.optim loop. Both run under torch.profiler (CPU), after warm-up, the
profiled part under --lock. Prints per step: wall time, the GEMM / convolution extern calls
(aten::mm ... in eager, aoti_torch_cpu_*_out in the package), the rest, the largest items, and the
minor page faults per step (this VM pays ~2.6 us per first-touched 4 KB page; the package runs in
load_step's call pool, which reuses its blocks across calls).

    python scripts/profile_aoti_step.py [--case gpt2|resnet18] [--threads 1] [--steps 4] [--lock FILE]
"""
import argparse
import atexit
import fcntl
import os
import resource
import shutil
import sys
import tempfile
import time

os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="prof_aoti_")  # a cold compile, removed at exit
atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch, torch_ext
from bench_step import eager_and_pure_step
ap = argparse.ArgumentParser(); ap.add_argument("--case", default="gpt2"); ap.add_argument("--threads", type=int, default=1)
ap.add_argument("--steps", type=int, default=4)
ap.add_argument("--lock", help="flock this file around the timed part")
args = ap.parse_args()
torch.set_num_threads(args.threads)
name, eager, step, batch = eager_and_pure_step(args.case)
real = torch._inductor.aoti_compile_and_package
def with_profile(program, package_path=None, inductor_configs=None):
    return real(program, package_path=package_path, inductor_configs={**(inductor_configs or {}), "cpp.enable_kernel_profile": True})
torch._inductor.aoti_compile_and_package = with_profile
pkg_dir = tempfile.mkdtemp()
atexit.register(shutil.rmtree, pkg_dir, ignore_errors=True)
pkg = torch_ext.load_step(step.to_aoti(pkg_dir + "/p.pt2", donate=True))
box = {"s": step.init_state(seed=0)}
def aoti():
    _, box["s"] = pkg(box["s"], *batch)[:2]
for f in (eager, aoti):
    for _ in range(2): f()
EXTERN_AOTI = ("aoti_torch_cpu_mm_out", "aoti_torch_cpu_addmm_out", "aoti_torch_cpu_bmm_out", "aoti_torch_cpu_baddbmm_out",
               "aoti_torch_cpu_convolution", "aoti_torch_cpu_convolution_backward", "aoti_torch_cpu_mkldnn_convolution",
               "aoti_torch_cpu__scaled_dot_product_flash_attention_for_cpu",
               "aoti_torch_cpu__scaled_dot_product_flash_attention_for_cpu_backward")
GEMM = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_addmm_activation", "aten::mkldnn_convolution",
        "aten::convolution_backward", "aten::_convolution", "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward")
lk = open(args.lock, "a") if args.lock else None
if lk: fcntl.flock(lk, fcntl.LOCK_EX)
print(name, f"{args.threads} thread(s), load", open("/proc/loadavg").read().split()[:3])
res = {}
for k, f in (("eager", eager), ("aoti", aoti)):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    for _ in range(args.steps): f()
    plain = (time.perf_counter() - t0) / args.steps * 1e3
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / args.steps
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps): f()
        wall = (time.perf_counter() - t0) / args.steps * 1e3
    ev = prof.key_averages()
    per = {e.key: e.self_cpu_time_total / args.steps / 1e3 for e in ev}
    res[k] = (plain, wall, per, faults)
if lk: fcntl.flock(lk, fcntl.LOCK_UN)
e_plain, e_wall, e, e_flt = res["eager"]; a_plain, a_wall, a, a_flt = res["aoti"]
eg = sum(v for k, v in e.items() if k in GEMM)
ag = sum(v for k, v in a.items() if k in EXTERN_AOTI or k in GEMM)
print(f"minor page faults per step: eager {e_flt:.0f}, aoti {a_flt:.0f}")
print(f"eager: {e_plain:.0f} ms/step unprofiled, {e_wall:.0f} profiled; GEMM/conv self {eg:.0f} ms ({100*eg/sum(e.values()):.1f}% of profiled self time), rest {sum(e.values())-eg:.0f} ms")
print(f"aoti:  {a_plain:.0f} ms/step unprofiled, {a_wall:.0f} profiled; GEMM/conv extern calls {ag:.0f} ms "
      f"({100*ag/sum(a.values()):.1f}% of profiled self time), rest {sum(a.values())-ag:.0f} ms")
print("eager top non-GEMM:", ", ".join(f"{k} {v:.1f}" for k, v in sorted(((k, v) for k, v in e.items() if k not in GEMM), key=lambda kv: -kv[1])[:12]))
print("eager GEMM:", ", ".join(f"{k} {v:.1f}" for k, v in sorted(((k, v) for k, v in e.items() if k in GEMM), key=lambda kv: -kv[1])))
print("aoti top:", ", ".join(f"{k} {v:.1f}" for k, v in sorted(a.items(), key=lambda kv: -kv[1])[:14]))
