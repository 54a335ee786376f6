"""Ops whose torch 2.9 Python CompositeImplicitAutograd kernel (torch._decomp's) the Python dispatcher of our traces
runs in place of ATen's: each traced by a small model, its pure training step compared with eager SGD bit for bit
over 3 steps and its ``ReactiveGraph`` forward with eager's. ``pad_sequence(padding_side="left")`` failed to trace
(the decomposition has no ``padding_side``: _compat.eager_pad_sequence); the others are characterisation tests of
kernels already eager's (upsampling's ``.vec`` overloads only compute sizes, ``tensor_split`` / ``unsafe_chunk`` /
``broadcast_tensors`` are views, ``native_batch_norm``'s and ``stft``'s decompositions call eager's kernels)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

import torch_ext

from helpers import eager_step


def _mse(m, x, y):
    return F.mse_loss(m(x), y)


def _differences(model, x, steps=3, lr=0.1):
    """What differs between ``steps`` SGD steps of the pure step and eager's (losses, final state), and between
    a ReactiveGraph's forward of the eval model and eager's."""
    with torch.no_grad():
        y = torch.randn_like(model(x))
    infer_model = copy.deepcopy(model).eval()
    eager = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=lr)
    step = torch_ext.make_train_step(model, opt, _mse, (x, y))
    state = step.init_state(seed=0)
    torch.manual_seed(0)
    bad = []
    for i in range(steps):
        loss, state = step(state, x, y)
        if not torch.equal(loss, eager_step(eager, eager_opt, _mse, x, y)):
            bad.append(f"loss of step {i}")
    step.write_back(state)
    bad += [n for (n, a), b in zip(model.state_dict().items(), eager.state_dict().values()) if not torch.equal(a, b)]
    rg = torch_ext.ReactiveGraph(infer_model, (x,))
    with torch.no_grad():
        if not torch.equal(rg.run(x), infer_model(x)):
            bad.append("ReactiveGraph forward")
    return bad


class _PadSequence(nn.Module):
    def __init__(self, batch_first, side):
        super().__init__()
        self.inp, self.out = nn.Linear(3, 4), nn.Linear(4, 2)
        self.batch_first, self.side = batch_first, side

    def forward(self, x):
        h = self.inp(x)
        padded = pad_sequence([h[0, :5], h[1, :3], h[2, :6]], batch_first=self.batch_first, padding_value=0.5,
                              padding_side=self.side)
        return self.out(padded.tanh())


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("side", ["left", "right"])
def test_pad_sequence_either_side(side, batch_first):
    # Before _compat.eager_pad_sequence, padding_side="left": TypeError "pad_sequence() takes from 1 to 3
    # positional arguments but 4 were given", in the step's and the ReactiveGraph's trace.
    torch.manual_seed(0)
    assert _differences(_PadSequence(batch_first, side), torch.randn(3, 7, 3)) == []


class _Around(nn.Module):
    """conv -> ``fn`` -> conv, in 1-, 2- or 3-D."""

    def __init__(self, fn, dim):
        super().__init__()
        conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dim - 1]
        self.a, self.fn, self.b = conv(2, 4, 3, padding=1), fn, conv(4, 3, 3, padding=1)

    def forward(self, x):
        return self.b(self.fn(self.a(x)))


_SIZES = {1: (7,), 2: (5, 6), 3: (3, 4, 5)}
_CASES = {
    "linear 1-D 1.7 align_corners": (1, lambda h: F.interpolate(h, scale_factor=1.7, mode="linear", align_corners=True)),
    "bilinear 0.6 recompute": (2, lambda h: F.interpolate(h, scale_factor=0.6, mode="bilinear",
                                                          recompute_scale_factor=True)),
    "bicubic antialias 0.4": (2, lambda h: F.interpolate(h, scale_factor=0.4, mode="bicubic", antialias=True)),
    "bilinear antialias 1.7": (2, lambda h: F.interpolate(h, scale_factor=1.7, mode="bilinear", antialias=True)),
    "trilinear 3-D 3.3": (3, lambda h: F.interpolate(h, scale_factor=3.3, mode="trilinear")),
    "nearest-exact 3-D 1.7": (3, lambda h: F.interpolate(h, scale_factor=1.7, mode="nearest-exact")),
    "nearest 1-D size": (1, lambda h: F.interpolate(h, size=9, mode="nearest")),
    "tensor_split": (2, lambda h: torch.cat([t * (i + 1) for i, t in enumerate(torch.tensor_split(h, 3, dim=2))], 2)),
    "unsafe_chunk": (2, lambda h: torch.cat([t.tanh() * (i + 1) for i, t in enumerate(h.unsafe_chunk(2, dim=1))], 1)),
    "broadcast_tensors": (2, lambda h: sum(t * (i + 1) for i, t in enumerate(
        torch.broadcast_tensors(h, h[:, :1], h.mean(-1, keepdim=True))))),
    "BatchNorm3d": (3, nn.BatchNorm3d(4)),
    "native_batch_norm": (2, lambda h: torch.native_batch_norm(h, None, None, None, None, True, 0.1, 1e-5)[0]),
}


@pytest.mark.parametrize("name", list(_CASES))
def test_python_decomposition_ops_bit_exact(name):
    dim, fn = _CASES[name]
    torch.manual_seed(0)
    assert _differences(_Around(fn, dim), torch.randn(2, 2, *_SIZES[dim])) == []


class _Stft(nn.Module):
    def __init__(self, inverse):
        super().__init__()
        self.lin, self.inverse = nn.Linear(64, 64), inverse

    def forward(self, x):
        window = torch.hann_window(16)
        spec = torch.stft(self.lin(x), 16, 4, window=window, center=True, return_complex=True)
        if self.inverse:
            return torch.istft(spec * 1.5, 16, 4, window=window, center=True, length=64)
        return torch.view_as_real(spec).flatten(1)


@pytest.mark.parametrize("inverse", [False, True])
def test_stft_istft_bit_exact(inverse):
    torch.manual_seed(0)
    assert _differences(_Stft(inverse), torch.randn(2, 64)) == []


_ZERO_DIM = torch.tensor(3)


class _ReadsZeroDimGlobal(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return self.lin(x) * _ZERO_DIM


def test_reactive_graph_fingerprints_a_zero_dim_global_tensor():
    # Before the fix the build cache's fingerprint viewed the 0-dim int64 tensor as bytes: RuntimeError "self.dim()
    # cannot be 0 to view Long as Byte" (any BatchNorm's num_batches_tracked reachable from a module's globals too).
    model = _ReadsZeroDimGlobal().eval()
    x = torch.randn(2, 3)
    rg = torch_ext.ReactiveGraph(model, (x,))
    with torch.no_grad():
        assert torch.equal(rg.run(x), model(x))
