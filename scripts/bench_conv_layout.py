"""Does channels-last make ResNet-18's convolutions faster on this CPU? One convolution forward +
backward (grad of input and weight, as in a training step) per ResNet-18 shape at batch 16, 64x64
images, one thread, process CPU time (median of --repeats), three layouts:

- nchw: input and weight contiguous (what the pure step and its AOTInductor package see);
- x_nhwc: channels-last input, contiguous weight (a layout choice inside a compiled step whose state
  keeps the user's contiguous weights: ATen then converts the weight to channels-last on every call);
- both_nhwc: input and weight channels-last (the weights stored channels-last).

Every distinct convolution of ResNet-18 is measured, and the sums are weighted by how often each
occurs in the network (20 convolutions), with one more column: auto, the layout
``to_aoti(channels_last="auto")`` picks per convolution (both_nhwc where the input has at least
torch_ext._aoti.CHANNELS_LAST_MIN_POSITIONS positions, nchw below).

    python scripts/bench_conv_layout.py [--repeats 15] [--lock FILE]
"""
import argparse
import fcntl
import os
import statistics
import time

import torch

from torch_ext._aoti import CHANNELS_LAST_MIN_POSITIONS

# (in channels, out channels, input height = width, kernel, stride, occurrences) of ResNet-18 at 64x64
SHAPES = [(3, 64, 64, 7, 2, 1), (64, 64, 16, 3, 1, 4), (64, 128, 16, 3, 2, 1), (64, 128, 16, 1, 2, 1),
          (128, 128, 8, 3, 1, 3), (128, 256, 8, 3, 2, 1), (128, 256, 8, 1, 2, 1), (256, 256, 4, 3, 1, 3),
          (256, 512, 4, 3, 2, 1), (256, 512, 4, 1, 2, 1), (512, 512, 2, 3, 1, 3)]
LAYOUTS = {"nchw": (torch.contiguous_format, torch.contiguous_format),
           "x_nhwc": (torch.channels_last, torch.contiguous_format),
           "both_nhwc": (torch.channels_last, torch.channels_last)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--lock", help="flock this file around the timed part")
    args = ap.parse_args()
    torch.set_num_threads(1)
    lk = open(args.lock, "a") if args.lock else None
    if lk:
        fcntl.flock(lk, fcntl.LOCK_EX)
    print(f"load {os.getloadavg()[0]:.2f}; ms per forward + backward, median of {args.repeats}")
    total = dict.fromkeys([*LAYOUTS, "auto"], 0.0)
    for cin, cout, hw, k, s, count in SHAPES:
        x0, w0 = torch.randn(16, cin, hw, hw), torch.randn(cout, cin, k, k)
        row = {}
        for name, (xf, wf) in LAYOUTS.items():
            x = x0.contiguous(memory_format=xf).requires_grad_(cin != 3)  # the stem's input needs no gradient
            w = w0.contiguous(memory_format=wf).requires_grad_()

            def f():
                y = torch.nn.functional.conv2d(x, w, None, s, k // 2)
                return torch.autograd.grad(y, [x, w] if x.requires_grad else [w], torch.ones_like(y))

            for _ in range(3):
                f()
            ts = []
            for _ in range(args.repeats):
                c0 = time.process_time()
                f()
                ts.append(time.process_time() - c0)
            row[name] = statistics.median(ts) * 1e3
        row["auto"] = row["both_nhwc" if hw * hw >= CHANNELS_LAST_MIN_POSITIONS else "nchw"]
        for name, v in row.items():
            total[name] += count * v
        print(f"{count}x {cin:4}->{cout:<4} {hw:3}x{hw:<3} k{k} s{s}  "
              + "  ".join(f"{n} {v:6.2f}" for n, v in row.items()), flush=True)
    print("ResNet-18 sum" + " " * 19 + "  ".join(f"{n} {v:6.2f}" for n, v in total.items()))
    if lk:
        fcntl.flock(lk, fcntl.LOCK_UN)


if __name__ == "__main__":
    main()
