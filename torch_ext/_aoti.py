"""What ``TrainStep.to_aoti`` hands AOTInductor in place of torch_ext's custom ops.

AOTInductor calls a custom op as an opaque extern kernel: no fusion with its neighbours, eager
allocations and eager arithmetic inside. Two kinds sit in every step program:

- the optimizer updates (``torch_ext::<kind>_update``): their ATen forms, torch_ext.optim.aten_updates;
- dropout (``torch_ext::native_dropout_rng``, passes/thread_rng.h): the C++ kernel draws an mt19937
  Bernoulli mask into a bool tensor (scalar generator, then a bool copy), multiplies the input by it
  (a float * bool promotion) and by the scale: on the GPT-2 benchmark step 7 calls, about 10% of the
  AOTInductor step. Here it becomes one 64-bit draw from the explicit state
  (``torch_ext::rng_seed``: the seed, and the state advanced past it) and Inductor's own
  counter-based stream (``prims.inductor_random``, Philox), which Inductor fuses with the mask and
  the scale. The package draws another stream than the executor (the issue asks AOTInductor only to
  stay pure), and still reads no global generator: the seed is a function of the state passed in.
"""
from __future__ import annotations

import torch
import torch._inductor.inductor_prims  # noqa: F401  (defines torch.ops.prims.inductor_random)


def _native_dropout_rng(input, p, train, rng_state):
    # aten::native_dropout's semantics (CPU kernel): p in [0, 1] (the C++ op's check runs at export);
    # no draw and the state unchanged when not training or when the input is empty.
    if (train is not None and not train) or input.numel() == 0:
        return input.clone(), torch.ones_like(input, dtype=torch.bool), rng_state.clone()
    seed, new_state = torch.ops.torch_ext.rng_seed(rng_state)
    uniform = torch.ops.prims.inductor_random.default(list(input.shape), seed, "rand")  # [0, 1)
    mask = uniform >= p  # P(keep) = 1 - p, as Bernoulli(1 - p)
    p1m = 1.0 - p
    scale = 0.0 if p1m == 0 else 1.0 / p1m
    return input * mask * scale, mask, new_state


def aoti_decompositions() -> dict:
    """{torch_ext OpOverload: its form for AOTInductor}: the optimizer updates' ATen forms and the
    dropout above. The executor and the arena keep running the C++ kernels (bit-exact with eager)."""
    from .optim import aten_updates

    table = aten_updates()
    table[torch.ops.torch_ext.native_dropout_rng.default] = _native_dropout_rng
    return table
