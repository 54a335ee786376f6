"""Fake (meta) kernels for torch.ops.torch_ext.*, so the ops trace through torch.export and AOTInductor.

The schemas and the CPU kernels live in csrc/ops/library.cpp and, for the optimizer updates,
csrc/optim/ (one descriptor per optimizer); the optimizers' fake kernels are generated here from
those descriptors.
"""
import torch

from . import _C


def _update_fake(slots: list[str]):
    # The functional update returns fresh tensors shaped like the parameter and each state slot.
    names = ["param", "grad", *slots]

    def fake(*args, **kwargs):
        tensors = [args[i] if i < len(args) else kwargs[n] for i, n in enumerate(names)]
        if not slots:
            return torch.empty_like(tensors[0])
        return tuple(torch.empty_like(t) for t in [tensors[0], *tensors[2:]])

    return fake


for _d in _C.optimizer_descriptors():
    # The "scheduled" overload (schedulable scalars as tensors) returns the same results.
    for _overload in ("", ".scheduled") if _d["schedulable"] else ("",):
        torch.library.register_fake(f"torch_ext::{_d['op']}{_overload}")(_update_fake([s for s, _ in _d["slots"]]))
        torch.library.register_fake(f"torch_ext::{_d['inplace_op']}{_overload}")(lambda *args, **kwargs: None)


@torch.library.register_fake("torch_ext::native_dropout_rng")
def _(input, p, train, rng_state):
    # (output, bool mask, advanced generator state), shaped as aten::native_dropout's outputs.
    return torch.empty_like(input), torch.empty_like(input, dtype=torch.bool), torch.empty_like(rng_state)


@torch.library.register_fake("torch_ext::randn_like_rng")
def _(self, rng_state):
    # (noise like self, advanced generator state)
    return torch.empty_like(self), torch.empty_like(rng_state)


@torch.library.register_fake("torch_ext::rand_like_rng")
def _(self, rng_state):
    return torch.empty_like(self), torch.empty_like(rng_state)


@torch.library.register_fake("torch_ext::randn_rng")
def _(size, dtype, rng_state):
    # (the factory's tensor, advanced generator state)
    return rng_state.new_empty(size, dtype=dtype), torch.empty_like(rng_state)


@torch.library.register_fake("torch_ext::rand_rng")
def _(size, dtype, rng_state):
    return rng_state.new_empty(size, dtype=dtype), torch.empty_like(rng_state)


@torch.library.register_fake("torch_ext::randint_rng")
def _(low, high, size, dtype, rng_state):
    return rng_state.new_empty(size, dtype=dtype), torch.empty_like(rng_state)


@torch.library.register_fake("torch_ext::bernoulli_p_rng")
def _(self, p, rng_state, fill_in_place=False):
    # (at::bernoulli(self, p)'s contiguous result, advanced generator state)
    return torch.empty_like(self, memory_format=torch.contiguous_format), torch.empty_like(rng_state)


@torch.library.register_fake("torch_ext::rng_seed")
def _(rng_state):
    # (int64 0-dim seed, advanced generator state)
    return rng_state.new_empty((), dtype=torch.int64), torch.empty_like(rng_state)
