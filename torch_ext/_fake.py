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


@torch.library.register_fake("torch_ext::mkldnn_rnn_layer_backward")
def _(input, weight1, weight2, weight3, weight4, hx_, cx_tmp, output, hy_, cy_, grad_output, grad_hy, grad_cy,
      reverse, mode, hidden_size, num_layers, has_biases, train, bidirectional, batch_first, workspace):
    # ATen's CPU kernel's gradients (input, weight1, weight2, the two biases, hx, cx), contiguous: float32 for a
    # bfloat16 layer (oneDNN's backward runs in float32; eager's engine casts them), else the input's dtype.
    dtype = torch.float32 if input.dtype == torch.bfloat16 else input.dtype
    return tuple(t.new_empty(t.shape, dtype=dtype)
                 for t in (input, weight1, weight2, weight3, weight3, hx_, cx_tmp))


@torch.library.register_fake("torch_ext::mkldnn_rnn_layer")
def _(input, weight0, weight1, weight2, weight3, hx_, cx_, reverse, mode, hidden_size, num_layers, has_biases,
      bidirectional, batch_first, train):
    # (output, hy, cy, workspace): aten.mkldnn_rnn_layer's meta kernel, except the workspace, whose byte size oneDNN
    # picks at run time (a size of its own, unknown until then; empty when not training).
    seq, batch = (input.shape[1], input.shape[0]) if batch_first else (input.shape[0], input.shape[1])
    out_shape = (batch, seq, hidden_size) if batch_first else (seq, batch, hidden_size)
    size = torch.library.get_ctx().new_dynamic_size() if train else 0
    return (input.new_empty(out_shape), hx_.new_empty(hx_.shape), cx_.new_empty(cx_.shape),
            input.new_empty((size,), dtype=torch.uint8))
